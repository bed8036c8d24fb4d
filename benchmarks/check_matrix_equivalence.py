#!/usr/bin/env python3
"""The equivalence table of the whole-tensor optimizer tests, with the measured errors.

    python benchmarks/check_matrix_equivalence.py

Runs every case of ``tests/engine/test_matrix_optimizers.py::CASES`` (Muon, Adafactor, Muon +
AdamW, SGD + AdamW at stages 0-3, N = 2, 3, 4, hybrid ``shard_group_size=2`` at N=4, with
accumulation, clipping, skipped branches, frozen and tied parameters, offload) on the
test suite's rank pools and prints the largest relative error of any parameter against
one process on the global batch (the tests assert <= 2e-4).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from rank_pool import TEST_DIRS  # noqa: E402  (the tests' folders: their cases import each other by name)

sys.path[:0] = TEST_DIRS
from matrix_cases import train_matrix  # noqa: E402
from rank_pool import RankPoolRegistry  # noqa: E402
from test_matrix_optimizers import CASES, _spec  # noqa: E402


def main() -> int:
    pools = RankPoolRegistry()
    try:
        print(f"{'N':>2} {'stage':>5} {'optimizer':<11} {'features':<44} {'max rel err':>11}")
        for world, stage, optimizer, overrides in CASES:
            results = pools.get(world).run(train_matrix, _spec(stage, optimizer, overrides))
            worst = max(error for result in results for error in result["errors"].values())
            features = ", ".join(f"{k}={v}" if k == "options" else k for k, v in overrides.items()
                                 if k != "extra_on") or "-"
            print(f"{world:>2} {stage:>5} {optimizer:<11} {features:<44} {worst:>11.1e}", flush=True)
    finally:
        pools.shutdown_all(graceful=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
