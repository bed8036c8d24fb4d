"""Uneven data: max relative parameter error against one process, for a few fixed cases.

    python benchmarks/check_uneven_equivalence.py

Runs ``tests/uneven_cases.train_uneven`` (per-rank batch sizes, 0 included, and
``model.join()`` with ranks that have fewer batches) on the tests' rank pool and prints one
markdown row per case; ``tests/engine/test_uneven_data.py`` asserts the same at 2e-4 over drawn cases.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), ROOT]
from rank_pool import TEST_DIRS, RankPoolRegistry  # the tests' folders: their cases import each other by name

sys.path[:0] = TEST_DIRS
from uneven_cases import train_uneven
from test_uneven_data import spec_with
reg = RankPoolRegistry()
cases = [
  ("N=4 stage 3, [2,0,1,4]/[0,0,3,1], clip", 4, spec_with(4, [[[2, 0, 1, 4]], [[0, 0, 3, 1]]], stage=3, max_norm=0.05)),
  ("N=3 stage 2, 2 micro-steps, a 0-sample rank", 3, spec_with(3, [[[5, 0, 1], [0, 2, 2]], [[1, 1, 0], [3, 0, 0]]], stage=2, micro_steps=2)),
  ("N=4 stage 0, shares .25/.25/.10/.40 of 20", 4, spec_with(4, [[[5, 5, 2, 8]]] * 3, stage=0, max_norm=1.0)),
  ("N=4 stage 1, shares .25/.25/.10/.40, 3 micro", 4, spec_with(4, [[[5, 5, 2, 8]] * 3] * 2, stage=1, micro_steps=3)),
  ("join N=3 stage 3, fewer [3,0,1], clip, lr schedule", 3, spec_with(3, [[[1, 2, 3]], [[2, 2, 2]], [[3, 1, 1]]], stage=3, join=True, fewer=[3, 0, 1], max_norm=0.05, schedule=True)),
  ("join N=2 stage 0, fewer [0,2], 2 micro, clip", 2, spec_with(2, [[[2, 3], [1, 1]], [[2, 2], [4, 0]]], stage=0, micro_steps=2, join=True, fewer=[0, 2], max_norm=0.05)),
  ("join N=4 stage 1, fewer [0,1,2,3]", 4, spec_with(4, [[[2, 2, 1, 3]]] * 3, stage=1, join=True, fewer=[0, 1, 2, 3])),
  ("join N=3 stage 2, 2 epochs, schedule", 3, spec_with(3, [[[1, 2, 3]], [[2, 2, 2]], [[3, 1, 1]]], stage=2, join=True, fewer=[2, 0, 1], schedule=True, epochs=2)),
]
for name, world, spec in cases:
    results = reg.get(world).run(train_uneven, spec)
    worst = max(max(r["errors"].values()) for r in results)
    print(f"| {name} | {worst:.1e} |", flush=True)
reg.shutdown_all()
