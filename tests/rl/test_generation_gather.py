"""Stage 3's ``generate()``: per unit per token by default; with ``generate_gather_bytes`` the units are
gathered once per call (within the budget), the same tokens as one process (workers: generation_cases.py)."""

from __future__ import annotations

import pytest

import generation_cases as cases

pytest.importorskip("transformers")


def test_generate_gathers_the_model_once_per_call_within_the_budget(rank_pools) -> None:
    pool = rank_pools.get(2)
    per_token = pool.run(cases.generate_and_count, None, timeout=300)[0]
    once = pool.run(cases.generate_and_count, "1GiB", timeout=300)[0]
    for found in (per_token, once):
        assert found["equal"], "sharded generation must give one process's tokens"
        assert found["live_after"] == 0, "every gathered unit is freed after generate()"
    # broadcasts of each rank's half: (N-1)/N of the whole per gather of the model
    assert once["gathered"] == pytest.approx(once["whole"] / 2, rel=0.01)
    assert per_token["gathered"] >= cases.NEW_TOKENS * once["gathered"] * 0.9
    # a budget below the model: the units that fit are held, the rest gathered per token
    units = once["units"]
    partial = pool.run(cases.generate_and_count, str(sum(units[:-1])), timeout=300)[0]
    assert partial["equal"] and once["gathered"] < partial["gathered"] < per_token["gathered"]
