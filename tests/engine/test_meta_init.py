"""A meta-device model materialized at stage 3 is initialized as it would be on a real device.

* Hugging Face GPT-2, Llama and T5 built on meta get their own ``_init_weights``
  (rules on parent modules included): per-tensor mean and std match a CPU-built
  model within sampling error, buffers computed in ``__init__`` (rotary
  ``inv_freq``) are exact, and training from those weights matches the unwrapped
  model trained from the same weights.
* Plain torch modules: the rule runs on every submodule, children first (as
  ``module.apply``); a tensor no rule fills is an error naming it; a CPU skeleton
  (``se.model.meta_parameters()``) keeps buffers computed in ``__init__``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import shardengine as se
from shardengine.flat.meta_init import reset_parameters
from rank_pool import RankPoolRegistry, run_local
from toy_models import Block, Net, Rotary

SIGMAS = 5.0  # a statistic this many standard errors off is a wrong init, not chance


def _same_distribution(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Mean and std of two independent draws of one init agree within sampling error."""
    got, want = got.double().flatten(), want.double().flatten()
    if want.numel() < 2 or want.std() == 0:  # constants (ones, zeros): exact
        assert torch.equal(got, want), f"{name}: {got[:4].tolist()} vs {want[:4].tolist()}"
        return
    n, sigma = want.numel(), want.std().item()
    mean_tol = SIGMAS * sigma * math.sqrt(2.0 / n)
    std_tol = SIGMAS * sigma * math.sqrt(1.0 / n)  # the std of a sample std is ~sigma/sqrt(2n); two draws
    assert abs(got.mean().item() - want.mean().item()) <= mean_tol, f"{name}: mean {got.mean()} vs {want.mean()}"
    assert abs(got.std().item() - sigma) <= std_tol, f"{name}: std {got.std():.5f} vs {sigma:.5f}"


@pytest.mark.parametrize("family", ["gpt2", "llama", "t5"])
def test_hf_model_on_meta_is_initialized_like_on_cpu_and_trains_the_same(
        rank_pools: RankPoolRegistry, family: str) -> None:
    pytest.importorskip("transformers")
    import hf_cases
    steps, bigger = 2, {"vocab_size": 512}  # more embedding rows: tighter statistics
    results = rank_pools.get(2).run(hf_cases.meta_init_then_train, family, steps, bigger)
    cpu = hf_cases.build(family, seed=7, **bigger)
    for key, value in cpu.state_dict().items():
        _same_distribution(key, results[0]["initial"][key], value)
    for name, buffer in cpu.named_buffers():
        assert torch.equal(results[0]["buffers"][name], buffer), name
    # Training from the materialized weights = the unwrapped model trained from them.
    reference = hf_cases.build(family, **bigger)
    reference.load_state_dict(results[0]["initial"])
    losses = hf_cases.train(reference, hf_cases.optimizer_factory(reference.parameters()), family, steps)
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(results[0]["final"][key], value, rtol=1e-4, atol=1e-6, msg=key)
    mean = [sum(r["losses"][s] for r in results) / len(results) for s in range(steps)]
    assert mean == pytest.approx(losses, rel=1e-4)


# --------------------------------------------------------------------------- plain torch modules


def meta_net(rotary: bool = False) -> Net:
    """Three blocks whose gain (a ``Scale``) has no reset_parameters(); optionally a ``Rotary``."""
    return Net(11, 6, [6, 6], buffer=False, scaled=True, rotary=rotary)


def parent_rule(module: nn.Module) -> None:
    """Children first: the Linear's reset, then the Block overrides its weight and fills the gain."""
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()
    if isinstance(module, Block):
        with torch.no_grad():
            module.lin.weight.fill_(0.5)
            module.scale.gain.fill_(2.0)


def materialize(options: dict, rotary: bool = False, skeleton: bool = False) -> dict:
    """Build on meta (or as a skeleton), shard at stage 3; the full state, or the error."""
    torch.manual_seed(0)
    if skeleton:
        with se.model.meta_parameters():
            net = meta_net(rotary)
    else:
        with torch.device("meta"):
            net = meta_net(rotary)
    try:
        model, optimizer = se.shard(net, lambda params: torch.optim.SGD(params, lr=0.1), stage=3, **options)
    except se.ConfigError as error:
        return {"error": str(error)}
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    optimizer.step()
    return {"error": None, "state": model.full_state_dict(),
            "buffers": {name: b.clone() for name, b in net.named_buffers()}}


def test_rule_runs_on_every_submodule_children_first(rank_pools: RankPoolRegistry) -> None:
    for result in rank_pools.get(2).run(materialize, {"param_init_fn": parent_rule}):
        assert result["error"] is None, result["error"]
        for i in range(3):
            state = result["state"]
            assert torch.all(state[f"blocks.{i}.scale.gain"] != 0)  # stepped from 2.0, not NaN
            assert torch.allclose(state[f"blocks.{i}.lin.weight"], torch.full((6, 6), 0.5), atol=0.2)


def test_default_init_names_modules_it_cannot_reach() -> None:
    [result] = run_local(materialize, {})
    assert "blocks.0.scale.gain (Scale)" in result["error"] and "reset_parameters" in result["error"]
    assert "param_init_fn" in result["error"]


def test_rule_that_misses_a_tensor_is_named() -> None:
    [result] = run_local(materialize, {"param_init_fn": reset_parameters})
    assert "nothing initialized blocks.0.scale.gain (Scale)" in result["error"], result["error"]


def test_meta_buffer_without_a_rule_is_named_and_a_skeleton_keeps_it() -> None:
    [result] = run_local(materialize, {"param_init_fn": parent_rule}, True)
    assert "buffer rotary.inv_freq (Rotary)" in result["error"] and "meta_parameters()" in result["error"]
    [result] = run_local(materialize, {"param_init_fn": parent_rule}, True, True)
    assert result["error"] is None, result["error"]
    assert torch.equal(result["buffers"]["rotary.inv_freq"], Rotary(6).inv_freq)


def test_rule_that_raises_names_the_module() -> None:
    def needs_weight(module: nn.Module) -> None:
        module.weight.data.normal_()  # ModuleList, Block, ... have no weight
    [result] = run_local(materialize, {"param_init_fn": needs_weight})
    assert "initializing module" in result["error"] and "AttributeError" in result["error"]
