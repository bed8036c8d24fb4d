"""LoRA on a meta-device base: sharded at stage 3, the base streamed in by ``se.load_pretrained``.

* The adapters start exactly as ``peft.get_peft_model`` draws them on a real base
  under the same seed (default and ``"gaussian"``), on every rank; the base equals
  the checkpoint; after several AdamW steps the adapters are within 2e-4 of one
  process training the same PEFT model loaded normally, N = 2 and 3, with and
  without gradient checkpointing.
* With bf16 compute the meta flow equals, bit for bit, the flow that loads the base
  on every rank before ``shard()``.
* Inits that read the base weights are refused, naming the layer.
* Each rank's host peak while building, loading and taking the first step stays
  within its shard of the base, two units and a fixed overhead, at a size where
  the whole base would not fit in that bound (fresh processes).
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

import peft_meta_cases as cases  # noqa: E402
from engine_cases import rel_err  # noqa: E402
from rank_pool import RankPoolRegistry, run_local  # noqa: E402

pytestmark = pytest.mark.prestart(2, 3)

from peft_meta_cases import ADAPTER_TOLERANCE, FIXED_OVERHEAD, HOST_PEAK_WORLD, MiB  # noqa: E402


@pytest.fixture(scope="module")
def reference(base_folder):
    """``cases.reference`` on the module's base: one process's deterministic run, so each
    (init, checkpointing, steps) is computed once for all the tests that compare with it."""
    return functools.cache(functools.partial(cases.reference, base_folder))


@pytest.mark.parametrize("world,checkpointing", [(2, None), (2, "non_reentrant"), (2, "reentrant"),
                                                 (3, None), (3, "non_reentrant")])
def test_lora_on_a_meta_base_trains_like_one_process(rank_pools: RankPoolRegistry, base_folder: str, reference,
                                                     world: int, checkpointing) -> None:
    results = rank_pools.get(world).run(cases.train_on_meta_base, base_folder, True, checkpointing)
    want = reference(True, checkpointing)
    for result in results:
        assert result["base_equal"] and result["base_tensors"] == 21
        assert result["report"].missing == [] and result["report"].unexpected == []
        for key, value in want["initial"].items():
            assert torch.equal(result["initial"][key], value), key
    errors = {k: rel_err(results[0]["final"][k], v) for k, v in want["final"].items()}
    assert max(errors.values()) <= ADAPTER_TOLERANCE, errors
    assert all(not torch.equal(want["final"][k], want["initial"][k]) for k in want["final"])
    mean = [sum(r["losses"][s] for r in results) / world for s in range(cases.STEPS)]
    assert mean == pytest.approx(want["losses"], rel=1e-5)


def test_gaussian_adapters_on_a_meta_base_start_as_peft_draws_them(rank_pools: RankPoolRegistry,
                                                                   base_folder: str, reference) -> None:
    results = rank_pools.get(2).run(cases.train_on_meta_base, base_folder, "gaussian", None, 2)
    want = reference("gaussian", None, 2)
    for key, value in want["initial"].items():
        assert torch.equal(results[0]["initial"][key], value) and torch.equal(results[1]["initial"][key], value)
    assert max(rel_err(results[0]["final"][k], v) for k, v in want["final"].items()) <= ADAPTER_TOLERANCE


@pytest.mark.parametrize("param_dtype", [None, "bf16"])
def test_meta_flow_equals_loading_the_base_on_every_rank(rank_pools: RankPoolRegistry, base_folder: str,
                                                         param_dtype) -> None:
    for result in rank_pools.get(2).run(cases.meta_flow_equals_loaded_flow, base_folder, param_dtype):
        meta, loaded = result["meta"], result["loaded"]
        assert meta["losses"] == loaded["losses"]
        for key, value in loaded["final"].items():
            assert torch.equal(meta["initial"][key], loaded["initial"][key]), key
            assert torch.equal(meta["final"][key], value), key


def test_inits_that_read_the_base_are_refused_on_a_meta_base() -> None:
    outcome = run_local(cases.refused_inits)[0]
    assert "uses DoRA" in outcome["dora"] and "q_proj" in outcome["dora"]
    assert "init_lora_weights='orthogonal'" in outcome["orthogonal"]
    assert "init_lora_weights='eva'" in outcome["eva"]
    assert all("from_pretrained" in message for message in outcome.values())


def test_each_rank_holds_its_shard_and_two_units_while_loading(host_peaks: dict[str, list[dict]]) -> None:
    """16 layers of 12.6 MB (202 MB fp32): the whole base exceeds a rank's bound at N = 3
    (fresh ranks; see the ``host_peaks`` fixture in conftest.py)."""
    for rank, result in enumerate(host_peaks["lora"]):
        bound = result["model_bytes"] / HOST_PEAK_WORLD + 2 * result["largest_unit"] + FIXED_OVERHEAD
        assert result["model_bytes"] > bound
        used = {phase: result[phase] - result["baseline"] for phase in ("built", "loaded", "stepped")}
        assert max(used.values()) <= bound, (rank, {k: v / MiB for k, v in used.items()}, bound / MiB)


def test_shard_trainer_streams_a_meta_base_in(rank_pools: RankPoolRegistry, base_folder: str, tmp_path) -> None:
    result = rank_pools.get(2).run(cases.shard_trainer_meta_and_loaded, base_folder, str(tmp_path))[0]
    meta, loaded = result["meta"], result["loaded"]
    for key, value in loaded["base"].items():
        assert torch.equal(meta["base"][key], value), key
    errors = {k: rel_err(meta["adapters"][k], v) for k, v in loaded["adapters"].items()}
    assert max(errors.values()) <= 1e-6, errors
