"""``torch.compile`` on the wrapped model trains like eager at every stage.

The compiled sharded model trains next to an eager single-process reference on the
global batch; parameters and clip norms must match as in eager training. The
engine's hooks run eagerly ([Note: engine hooks are graph breaks] in
shardengine/stages/compile_support.py): stages 0-2 compile the forward into one
graph, stage 3 into one graph per unit plus the root's pieces, and no step after
the first recompiles. Compiling is slow on CPU: tiny model, three steps, N = 2.
"""

from __future__ import annotations

import shutil

import pytest

from compile_cases import compile_spec, train_compiled
from engine_cases import check_equivalence
from rank_pool import RankPoolRegistry

HAS_COMPILER = shutil.which("g++") is not None or shutil.which("c++") is not None
# Graphs per forward of the test model (embedding, 3 blocks, head): see the module docstring.
GRAPHS = {0: 1, 1: 1, 2: 1, 3: 5}


def _check(results: list[dict], stage: int) -> None:
    check_equivalence(results, tol=2e-6, norm_tol=1e-6)
    for result in results:
        assert result["graphs"] == [GRAPHS[stage]] * len(result["graphs"]), result["graphs"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_compiled_wrapped_model_aot_eager(rank_pools: RankPoolRegistry, stage: int) -> None:
    _check(rank_pools.get(2).run(train_compiled, compile_spec(stage=stage), timeout=1200), stage)


@pytest.mark.skipif(not HAS_COMPILER, reason="inductor on CPU needs a C++ compiler")
@pytest.mark.parametrize("stage", [0, 3])
def test_compiled_wrapped_model_inductor(rank_pools: RankPoolRegistry, stage: int) -> None:
    spec = compile_spec(stage=stage, backend="inductor")
    _check(rank_pools.get(2).run(train_compiled, spec, timeout=1200), stage)


@pytest.mark.parametrize("stage", [0, 3])
def test_blocks_compiled_before_shard(rank_pools: RankPoolRegistry, stage: int) -> None:
    # torchtitan's order: the engine's hooks sit outside the compiled block frames.
    results = rank_pools.get(2).run(train_compiled, compile_spec(stage=stage, order="blocks_first"),
                                    timeout=1200)
    check_equivalence(results, tol=2e-6, norm_tol=1e-6)
