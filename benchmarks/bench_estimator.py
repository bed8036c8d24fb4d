"""Benchmark the memory estimator: analytic 70B config, traced ~1.5B module.

Run: python benchmarks/bench_estimator.py
Prints a table and writes benchmarks/results/bench_estimator.json. The traced case
builds a GPT-2-XL-sized model (~1.56B params, 6.2 GB of fp32 weights if real) on the
meta device; the RSS growth shows that no real weights were allocated.
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import psutil
import torch

from memory_estimator import estimate
from shardengine.testing.models import GPT, GPTConfig, example_inputs

ROOT = Path(__file__).resolve().parents[1]
LLAMA_70B = ROOT / "tests" / "configs" / "llama-2-70b.json"
XL_SHAPE = GPTConfig(vocab_size=50257, seq_len=1024, n_layer=48, n_head=25, n_embd=1600)


def rss_bytes() -> int:
    return psutil.Process(os.getpid()).memory_info().rss


def timed(label: str, run, repeats: int) -> dict:
    """Best-of-``repeats`` wall time of ``run()``, plus process RSS around the first call."""
    rss_before = rss_bytes()
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return {"case": label, "best_s": min(times), "first_s": times[0], "repeats": repeats,
            "rss_before_mib": rss_before / 2**20, "rss_after_mib": rss_bytes() / 2**20,
            "params": result.params, "recommended": result.recommended,
            "max_micro_batch": result.max_micro_batch,
            "activations_bytes": result.plans[0].activations, "activation_source": result.activation_source}


def main() -> None:
    cases = [
        timed("analytic Llama-2-70B config, 64×H100-80GB, b=1, s=4096",
              lambda: estimate(config=LLAMA_70B, world_size=64, device="H100-80GB", micro_batch=1,
                               seq_len=4096, checkpointing="full"), repeats=5),
        timed("traced GPT-2-XL-size module (meta), 8×A100-80GB, bf16, b=1, s=1024",
              lambda: estimate(module=lambda: GPT(XL_SHAPE), example_inputs=example_inputs,
                               world_size=8, device="A100-80GB", micro_batch=1, seq_len=1024), repeats=1),
    ]
    header = f"{'case':<66} {'time (ms)':>10} {'params':>15} {'RSS before→after (MiB)':>24} {'act. GiB':>9}"
    print(header)
    print("-" * len(header))
    for case in cases:
        rss = f"{case['rss_before_mib']:.0f} → {case['rss_after_mib']:.0f}"
        print(f"{case['case']:<66} {case['best_s'] * 1e3:>10.1f} {case['params']:>15,} {rss:>24} "
              f"{case['activations_bytes'] / 2**30:>9.2f}")
    real_weights_mib = cases[1]["params"] * 4 / 2**20
    print(f"\nfp32 weights of the traced model, had they been allocated: {real_weights_mib:,.0f} MiB")
    out = ROOT / "benchmarks" / "results"
    out.mkdir(parents=True, exist_ok=True)
    record = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
              "cases": cases, "traced_model_fp32_weight_mib": real_weights_mib}
    (out / "bench_estimator.json").write_text(json.dumps(record, indent=2))
    print(f"wrote {out / 'bench_estimator.json'}")


if __name__ == "__main__":
    main()
