"""ShardConfig's option groups: policies and flat keywords are two spellings of one config."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import shardengine as se
from shardengine.config import FLAT_OPTIONS, OPTION_NAMES


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def _init(module: nn.Module) -> None:
    pass


FLAT = {"param_dtype": "bf16", "reduce_dtype": "fp32", "offload_optimizer": True, "shard_group_size": 2,
        "wrap": Block, "wrap_min_params": 10, "param_init_fn": _init, "prefetch": 2, "reshard_after_forward": False}
GROUPED = {"precision": se.MixedPrecision(param_dtype="bf16", reduce_dtype="fp32"),
           "offload": se.Offload(optimizer=True),
           "hybrid": se.Hybrid(shard_group_size=2),
           "stage3": se.Stage3(wrap=Block, wrap_min_params=10, param_init_fn=_init, prefetch=2,
                               reshard_after_forward=False)}


def test_flat_keywords_and_policies_build_the_same_config() -> None:
    flat, grouped = se.config.ShardConfig(stage=3, **FLAT), se.config.ShardConfig(stage=3, **GROUPED)
    assert flat == grouped
    assert flat.precision == se.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert (grouped.param_dtype, grouped.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert grouped.offload_optimizer
    assert (grouped.wrap, grouped.wrap_min_params, grouped.param_init_fn) == ((Block,), 10, _init)
    assert (grouped.prefetch, grouped.reshard_after_forward, grouped.shard_group_size) == (2, False, 2)
    assert flat.mixed_precision and not se.config.ShardConfig().mixed_precision


def test_every_flat_keyword_reads_back_what_it_was_given() -> None:
    cfg = se.config.ShardConfig(stage=3, **FLAT)
    for keyword in FLAT_OPTIONS:
        group, name = FLAT_OPTIONS[keyword]
        assert getattr(cfg, keyword) == getattr(getattr(cfg, group), name)
    assert set(cfg.options()) == set(OPTION_NAMES)
    assert set(FLAT_OPTIONS) <= set(OPTION_NAMES)


def test_every_policy_field_is_one_flat_keyword() -> None:
    """Each policy field is given as exactly one flat keyword (a policy field added without its
    ``_FlatOption`` line could not be passed to shard())."""
    from dataclasses import fields

    from shardengine.config import POLICIES

    policy_fields = sorted((group, f.name) for group, cls in POLICIES.items() for f in fields(cls))
    assert sorted(FLAT_OPTIONS.values()) == policy_fields
    assert len(OPTION_NAMES) == len(set(OPTION_NAMES))


def test_a_flat_keyword_overrides_that_field_of_a_policy_given_with_it() -> None:
    cfg = se.config.ShardConfig(stage=3, stage3=se.Stage3(prefetch=3, reshard_after_forward=False), prefetch=0)
    assert cfg.stage3 == se.Stage3(prefetch=0, reshard_after_forward=False)
    base = se.config.ShardConfig(stage=2, precision=se.MixedPrecision(param_dtype="fp16", loss_scale=128.0))
    merged = se.config.ShardConfig.from_kwargs(base, None, {"initial_loss_scale": 4.0})
    assert (merged.param_dtype, merged.loss_scale, merged.initial_loss_scale) == (torch.float16, 128.0, 4.0)
    assert dataclasses.replace(base, shard_group_size="node").hybrid == se.Hybrid("node")


@pytest.mark.parametrize("build,phrase", [
    (lambda: se.config.ShardConfig(precision="bf16"), "precision must be a MixedPrecision"),
    (lambda: se.config.ShardConfig(stage3={"prefetch": 2}), "stage3 must be a Stage3"),
    (lambda: se.config.ShardConfig(stage=1, bukcet_mb=3), r"unknown option\(s\) \['bukcet_mb'\]"),
    (lambda: se.Stage3(prefetch=-1), "prefetch must be an int >= 0"),
    (lambda: se.Stage3(wrap="Block"), "wrap must be nn.Module subclasses"),
    (lambda: se.MixedPrecision(param_dtype="bf16", loss_scale="dynamic"), "loss_scale applies to fp16 training only"),
    (lambda: se.Offload(optimizer=1), 'offload_optimizer must be True, False or "disk"'),
    (lambda: se.Hybrid(shard_group_size=0), "shard_group_size must be an int >= 1"),
    (lambda: se.config.ShardConfig(stage=0, offload=se.Offload(optimizer=True)), "offload_optimizer needs stage >= 1"),
])
def test_a_bad_policy_is_a_config_error_naming_the_field(build, phrase: str) -> None:
    with pytest.raises(se.ConfigError, match=phrase):
        build()


def test_shard_takes_policies_and_flat_keywords_alike() -> None:
    torch.manual_seed(0)
    outputs = []
    for options in ({"param_dtype": "bf16"}, {"precision": se.MixedPrecision(param_dtype="bf16")}):
        net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
        net.load_state_dict({k: torch.full_like(v, 0.1) for k, v in net.state_dict().items()})
        model, optimizer = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=1, **options)
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}  # computes in bf16
        model(torch.ones(2, 8)).float().pow(2).mean().backward()
        optimizer.step()
        outputs.append(model(torch.ones(2, 8)).detach().float())
    assert torch.equal(outputs[0], outputs[1])
