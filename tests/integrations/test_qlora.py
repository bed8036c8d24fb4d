"""QLoRA sharded at stage 3 against bitsandbytes QLoRA in one process (workers: qlora_cases.py).

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

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

import hf_cases  # noqa: E402
import qlora_cases as cases  # noqa: E402
from engine_cases import rel_err  # noqa: E402
from rank_pool import RankPoolRegistry  # noqa: E402

pytestmark = pytest.mark.prestart(2, 3)

ADAPTER_TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("llama-base"))
    hf_cases.make_pretrained("llama", folder)
    return folder


def _check_adapters(results: list[dict], want: dict, world: int) -> None:
    errors = {k: rel_err(results[0]["final"][k], v) for k, v in want["final"].items()}
    assert max(errors.values()) <= ADAPTER_TOLERANCE, errors
    assert all(not torch.equal(want["final"][k], want["initial"][k]) for k in want["final"])
    mean = [sum(r["losses"][s] for r in results) / world for s in range(cases.STEPS)]
    assert mean == pytest.approx(want["losses"], rel=1e-5)


@pytest.mark.parametrize("world,kind", [(2, "nf4"), (2, "nf4-double"), (2, "int8"), (3, "nf4-double")])
def test_a_quantized_base_loaded_on_every_rank_trains_like_one_process(rank_pools: RankPoolRegistry,
                                                                     base_folder: str, world: int, kind: str) -> None:
    results = rank_pools.get(world).run(cases.train_loaded, base_folder, kind)
    _check_adapters(results, cases.reference(base_folder, kind), world)
    for result in results:  # stage 3 holds a shard of the quantized base
        assert result["held"] < result["whole"]
