#!/usr/bin/env python3
"""The estimator's step-time model against ``bench_engine.py``'s measured step times, on this machine.

    memory-estimator calibrate                                   # once: alpha, beta, compute rates
    python benchmarks/bench_engine.py --configs s0,s1,s2,s3 --sizes 10m --rounds 8 --out /tmp/engine
    python benchmarks/check_time_model.py /tmp/engine.json       # measured vs predicted, +-15% on ratios

For each model size in the bench's JSON it asks the time model (``memory_estimator.timing.step``)
for every shardengine configuration of the run — the same GPT (the engine's exact buckets
and units, via the estimator's module path), precision, micro-batch, sequence length and
world size, on one node whose link and compute rates are this machine's calibration —
and prints measured and predicted step times and their ratios to stage 0. The measured
ratio is the median over rounds of the ratio within a round (the bench times the
configurations back to back, round-robin), so load that comes and goes between rounds
cancels; the IQR of those per-round ratios is printed beside it. A ratio passes when the
predicted one is within ``--tolerance`` (default 15%) of the measured one. Exit 1 if any misses.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memory_estimator import estimate  # noqa: E402
from memory_estimator.hardware.calibration import load_calibration  # noqa: E402
from memory_estimator.hardware.rates import calibrated_rates  # noqa: E402
from memory_estimator.hardware.interconnects import calibrated_link  # noqa: E402
from memory_estimator.timing.step import Cluster, TimedPlan, step_time  # noqa: E402
from memory_estimator.plan.timed import workload_from_estimate  # noqa: E402
from shardengine.testing.models import GPTConfig, build_gpt  # noqa: E402


def predictions(size: str, bench_args: dict, world: int, configs: list[dict], calibration_path) -> dict[str, float]:
    """Predicted seconds per step of each of our configurations in one size of the bench."""
    from dataclasses import replace

    calibration = load_calibration(calibration_path)
    vocab, seq_len, micro_batch = bench_args["vocab"], bench_args["seq_len"], bench_args["micro_batch"]
    shape = GPTConfig.preset(size, vocab_size=vocab, seq_len=seq_len)
    result = estimate(module=lambda: build_gpt(size, vocab_size=vocab, seq_len=seq_len), world_size=world,
                      precision="fp32", optimizer="adamw", micro_batch=micro_batch, seq_len=seq_len,
                      hidden=shape.n_embd, layers=shape.n_layer, heads=shape.n_head, vocab=vocab,
                      device="cpu", device_memory_bytes="64GiB")
    workload = workload_from_estimate(result)
    link = calibrated_link(calibration)
    out = {}
    for config in configs:
        if config["kind"] != "ours" or config["bf16"]:
            continue
        # "-native" forces the textbook collectives: priced as a non-Gloo backend would issue them.
        config_link = replace(link, backend="native") if config["name"].endswith("-native") else link
        cluster = Cluster(1, world, config_link, config_link, calibrated_rates(calibration))
        plan = TimedPlan(config["name"], config["stage"], offload=config["offload"])
        staged = workload_from_estimate(result, stage=2) if config["stage"] == 2 else workload  # its own buckets
        out[config["name"]] = step_time(plan, staged, cluster)
    return out


def paired_ratios(config: dict, baseline: dict) -> list[float]:
    """Per round: the configuration's median step over the baseline's, both timed in that round."""
    pairs = zip(config["step_times_s"], baseline["step_times_s"])
    return [statistics.median(mine) / statistics.median(base) for mine, base in pairs if mine and base]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bench_json", help="benchmarks/bench_engine.py's JSON output")
    parser.add_argument("--calibration", default=None, help="calibration file (default: where calibrate stores it)")
    parser.add_argument("--baseline", default="s0", help="configuration the ratios are taken to")
    parser.add_argument("--tolerance", type=float, default=0.15)
    args = parser.parse_args(argv)
    bench = json.loads(Path(args.bench_json).read_text())
    world = bench["machine"]["world_size"]
    misses = 0
    print(f"bench: {bench['machine']['note']}")
    for size_result in bench["sizes"]:
        configs = size_result["configs"]
        predicted = predictions(size_result["size"], bench["args"], world, configs, args.calibration)
        measured = {c["name"]: c for c in configs if c["name"] in predicted}
        if args.baseline not in measured:
            raise SystemExit(f"{args.baseline} is not among the measured configurations {sorted(measured)}")
        base_p = predicted[args.baseline].step_s
        print(f"\n{size_result['size']}, N={world}, {size_result['rounds']} rounds; ratios to {args.baseline} "
              f"(measured: median of per-round ratios, IQR in brackets)")
        print(f"{'config':<11}{'median s':>9}{'predicted s':>12}{'compute':>9}{'optim':>7}{'comm':>7}"
              f"{'exposed':>8}{'ratio meas':>11}{'(IQR)':>14}{'ratio pred':>11}{'diff':>8}")
        for name, time in predicted.items():
            ratios = paired_ratios(measured[name], measured[args.baseline])
            ratio_m, ratio_p = statistics.median(ratios), time.step_s / base_p
            q1, _, q3 = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else (ratio_m,) * 3
            diff = ratio_p / ratio_m - 1
            ok = abs(diff) <= args.tolerance
            misses += not ok
            print(f"{name:<11}{measured[name]['median_s']:>9.3f}{time.step_s:>12.3f}{time.compute_s:>9.3f}"
                  f"{time.optimizer_s:>7.3f}{time.comm_s:>7.3f}{time.exposed_comm_s:>8.3f}"
                  f"{ratio_m:>11.3f}{f'({q1:.2f}-{q3:.2f})':>14}{ratio_p:>11.3f}{diff:>+8.1%}{'' if ok else '  MISS'}")
    print(f"\n{'all ratios within' if not misses else f'{misses} ratio(s) outside'} ±{args.tolerance:.0%}")
    return 1 if misses else 0


if __name__ == "__main__":
    sys.exit(main())
