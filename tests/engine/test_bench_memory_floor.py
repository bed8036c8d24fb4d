"""The side-by-side memory benchmark runs at a tiny size and reports every engine consistently.

One subprocess (the benchmark starts its own 2 ranks, ~15 s): the JSON names every engine
with its four figures, and shardengine's bytes alive between steps, as the allocator saw
them, are at least what ``memory_report().model_states`` accounts for, so the tracker
misses none of the engine's model states.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from rank_pool import REPO_ROOT

SCRIPT = Path(REPO_ROOT) / "benchmarks" / "bench_memory_floor.py"
ENGINES = ["ddp", "zero", "fsdp2", "fsdp2-sgo", "s0", "s1", "s2", "s3", "s3-sgo", "s3i"]  # DeepSpeed's (optional) left out


def test_tiny_run_reports_every_engine_and_covers_model_states(tmp_path, forked_python):
    out = tmp_path / "floor.json"
    done = subprocess.run([forked_python.python, str(SCRIPT), "--preset", "tiny", "--layers", "2", "--seq-len", "32",
                           "--batch", "small", "--engines", ",".join(ENGINES), "--json", str(out)],
                          env=forked_python.env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["settings"]["small"]["rows"]
    assert sorted(rows) == sorted(ENGINES)
    for name, row in rows.items():
        between, *peaks = row["bytes"]
        forward_peak = peaks[0]  # the forward starts with the bytes held between steps alive
        assert forward_peak >= between > 0, (name, row)
        if name.startswith("s"):
            assert between >= row["model_states"] > 0, (name, row)
    # Each stage shards more than the one before it: model states shrink with the stage.
    states = [rows[f"s{stage}"]["model_states"] for stage in range(4)]
    assert states == sorted(states, reverse=True), states
    assert rows["s3i"]["model_states"] == rows["s3"]["model_states"]  # the options hold no other states
    assert rows["s3-sgo"]["model_states"] == rows["s3"]["model_states"]
    assert set(result["settings"]["small"]["ratios"]) == {
        "s3/fsdp2 between", "s0/ddp peak", "s1/zero peak", "s2/fsdp2-sgo peak", "s2/fsdp2 peak", "s3/fsdp2 peak",
        "s3-sgo/fsdp2-sgo peak", "s3i/fsdp2 peak"}
    assert result["deepspeed"].startswith("DeepSpeed: not measured")
