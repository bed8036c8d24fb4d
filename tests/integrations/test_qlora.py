"""QLoRA sharded at stage 3 against bitsandbytes QLoRA in one process (workers: qlora_cases.py).

* A 4-bit base declared on the meta device, quantized as ``se.load_pretrained`` streams it in:
  its codes equal bitsandbytes' own from the same checkpoint, bit for bit, and the adapters
  after several AdamW steps equal one process, N = 2 and 3, with and without checkpointing.
* A base quantized by ``from_pretrained`` on every rank (NF4 and int8), then sharded: the same.
* int8 (the default ``BitsAndBytesConfig(load_in_8bit=True)``) the same way: codes and row
  scales equal bitsandbytes' own, adapters equal one process. Run before its load, or with
  trainable 16-bit weights, it is refused, saying what to do instead.

[Note: the QLoRA tolerance]
Every rank quantizes the same checkpoint with the same bitsandbytes code, so the base
is bit for bit the one-process base and dequantizes to the same matrices; what differs
is only the order of fp32 sums (a rank's rows against the whole batch, gradients
averaged across ranks), as in the LoRA tests. AdamW divides each gradient by its own
running scale, which turns those ~1e-7 differences into relative differences of the
adapters up to ~1e-5 over a few steps; 2e-4 is the LoRA tests' bound, and the measured
errors sit far below it.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

import qlora_cases as cases  # noqa: E402
from engine_cases import rel_err  # noqa: E402
from rank_pool import RankPoolRegistry  # noqa: E402

pytestmark = pytest.mark.prestart(2, 3)

from peft_meta_cases import ADAPTER_TOLERANCE, FIXED_OVERHEAD, HOST_PEAK_WORLD, MiB  # noqa: E402


@pytest.fixture(scope="module")
def quantized_folders(tmp_path_factory, base_folder):
    """``kind -> a folder saved by save_pretrained of the base quantized by from_pretrained``."""
    made: dict[str, str] = {}

    def folder(kind: str) -> str:
        if kind not in made:
            made[kind] = str(tmp_path_factory.mktemp(f"llama-{kind}"))
            cases.save_quantized(base_folder, kind, made[kind])
        return made[kind]
    return folder


@pytest.fixture(scope="module")
def reference(base_folder):
    """``cases.reference`` on the module's base: one process's deterministic run, so each
    (kind, checkpointing) is computed once for all the tests that compare with it."""
    return functools.cache(functools.partial(cases.reference, base_folder))


def _check_adapters(results: list[dict], want: dict, world: int) -> None:
    errors = {k: rel_err(results[0]["final"][k], v) for k, v in want["final"].items()}
    assert max(errors.values()) <= ADAPTER_TOLERANCE, errors
    assert all(not torch.equal(want["final"][k], want["initial"][k]) for k in want["final"])
    mean = [sum(r["losses"][s] for r in results) / world for s in range(cases.STEPS)]
    assert mean == pytest.approx(want["losses"], rel=1e-5)


@pytest.mark.parametrize("world,kind,stage", [(2, "nf4", 3), (2, "nf4-double", 3), (2, "int8", 3), (3, "nf4-double", 3),
                                              (2, "int8", 1)])
def test_a_quantized_base_loaded_on_every_rank_trains_like_one_process(rank_pools: RankPoolRegistry, base_folder: str,
                                                                     reference, world: int, kind: str, stage: int) -> None:
    results = rank_pools.get(world).run(cases.train_loaded, base_folder, kind, None, stage)
    _check_adapters(results, reference(kind), world)
    for result in results:  # stage 3 holds a shard of the quantized base
        assert result["held"] < result["whole"] or stage < 3


@pytest.mark.parametrize("world,kind,checkpointing", [(2, "nf4", None), (2, "nf4-double", None),
                                                      (2, "nf4-double", "non_reentrant"), (3, "nf4-double", None),
                                                      (2, "int8", None), (2, "int8", "non_reentrant"),
                                                      (3, "int8", None), (3, "int8", "non_reentrant")])
def test_a_quantized_base_declared_on_meta_is_quantized_as_it_streams_in(rank_pools: RankPoolRegistry, base_folder: str,
                                                                   reference, world: int, kind: str, checkpointing) -> None:
    results = rank_pools.get(world).run(cases.train_on_meta_base, base_folder, kind, checkpointing)
    want = reference(kind, checkpointing)
    for result in results:
        assert result["codes_equal"] and result["quantized"] == 14  # q, k, v, o, gate, up, down x 2 layers
        assert result["inference"] in (None, [True, True])
        for key, value in want["initial"].items():  # the adapters drawn as peft draws them
            assert torch.equal(result["initial"][key], value), key
    _check_adapters(results, want, world)


@pytest.mark.parametrize("world,kind", [(2, "nf4-double"), (2, "int8"), (3, "nf4"), (3, "int8")])
def test_a_pre_quantized_folder_loads_into_a_base_declared_on_meta(rank_pools: RankPoolRegistry, base_folder: str,
                                                                   reference, quantized_folders, world: int, kind: str) -> None:
    """Codes read slice by slice (the ranks together read every stored byte once, plus the
    small quantization states once per rank), states whole and in memory of their own: bit
    for bit what from_pretrained gives from that folder and from the float checkpoint; the
    adapters train as one process."""
    results = rank_pools.get(world).run(cases.train_on_meta_base, quantized_folders(kind), kind, None, base_folder)
    want = reference(kind)
    for result in results:
        assert result["codes_equal"] and result["quantized"] == 14
        assert result["files_unmapped"]  # the states are copies, not views keeping the file mapped
    stored, state = cases.stored_bytes(quantized_folders(kind))  # each rank: its slices, every state whole
    assert sum(r["bytes_read"] for r in results) == stored + (world - 1) * state
    _check_adapters(results, want, world)


def test_a_pre_quantized_folder_into_a_float_base_is_refused(rank_pools: RankPoolRegistry, quantized_folders) -> None:
    for kind in ("int8", "nf4-double"):
        for message in rank_pools.get(2).run(cases.load_error, quantized_folders(kind), None):
            assert "dtypes differ" in message and "quantization_config" in message, message


def test_pre_quantized_codes_without_their_state_are_refused(rank_pools: RankPoolRegistry, quantized_folders,
                                                            tmp_path) -> None:
    bad = str(tmp_path / "no-scales")
    cases.without_scales(quantized_folders("int8"), bad)
    for message in rank_pools.get(2).run(cases.load_error, bad, "int8"):
        assert "without their quantization state" in message and "q_proj.weight (no SCB)" in message, message


def test_an_int8_base_on_meta_refuses_a_forward_before_it_is_loaded(rank_pools: RankPoolRegistry) -> None:
    for message in rank_pools.get(2).run(cases.int8_forward_before_load):
        assert "no scales yet" in message and "se.load_pretrained" in message


def test_an_int8_base_with_trainable_16bit_weights_is_refused(rank_pools: RankPoolRegistry) -> None:
    for message in rank_pools.get(2).run(cases.int8_with_fp16_weights):
        assert "llm_int8_has_fp16_weight=False" in message


@pytest.mark.parametrize("kind", ["nf4-double", "int8"])
def test_each_rank_holds_its_shard_of_the_codes_and_two_units_while_loading(host_peaks: dict[str, list[dict]],
                                                                          kind: str) -> None:
    """16 layers of 12.6 MB in the fp32 checkpoint (202 MB; 27 MB as NF4 codes, 51 MB as int8),
    N = 3, fresh ranks (the ``host_peaks`` fixture in conftest.py): building, loading (each
    weight quantized from the checkpoint) and the first step stay within the shard of the
    stored base, two checkpoint units and the fixed overhead, which the checkpoint every rank
    would otherwise read whole exceeds. (The quantization state, whole on every rank, is inside
    the overhead: int8's row scales are 0.3 MB here.)"""
    for rank, result in enumerate(host_peaks[kind]):
        bound = result["stored_bytes"] / HOST_PEAK_WORLD + 2 * result["checkpoint_unit"] + FIXED_OVERHEAD
        assert result["checkpoint_bytes"] > bound
        used = {phase: result[phase] - result["baseline"] for phase in ("built", "loaded", "stepped")}
        assert max(used.values()) <= bound, (rank, {k: v / MiB for k, v in used.items()}, bound / MiB)
