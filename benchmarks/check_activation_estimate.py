#!/usr/bin/env python3
"""The estimator's activation bytes per policy against what the engine measures, one process.

    python benchmarks/check_activation_estimate.py              # the 10m GPT, sequence 128, ~1 minute
    python benchmarks/check_activation_estimate.py --preset tiny --seq-len 64

One trace of the model on fake tensors (memory_estimator.model.module.traced_activations)
prices every policy; the engine then trains the same model one step under each policy at
stages 0 and 3 (world size 1) with measure_activations=True. Per row: the engine's
memory_report() peak_activations / peak_host_activations, the estimator's live peak (what
its verdict uses) and its kept-for-backward figures (profile.kept / kept_host), and their
ratios to the measured bytes.
"""
from __future__ import annotations

import argparse
import os

POLICIES = [("none", False), ("full", False), ("every-k:2", False), ("selective:mm", False),
            ("selective:mm/2", False), ("none", True), ("full", True), ("every-k:2", True)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="10m")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    import shardengine as se
    from memory_estimator.model.module import traced_activations
    from shardengine.flat.plan import find_units
    from shardengine.testing.models import build_gpt, example_inputs

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29671")
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.set_num_threads(1)
    with torch.device("meta"):
        meta = build_gpt(args.preset, vocab_size=256, seq_len=args.seq_len)
    traced = traced_activations(meta, lambda mb, s: example_inputs(mb, s), args.micro_batch, args.seq_len,
                                torch.float32, lambda root: [u for u, _, _ in find_units(root, None, None)[:-1]],
                                device="cpu")
    ids, targets = example_inputs(args.micro_batch, args.seq_len)
    print(f"{'stage':>5} {'policy':15s} {'offload':7s} {'measured':>10} {'host':>10} | {'live':>10} "
          f"{'kept':>10} {'host':>10} | live/meas kept/meas host/meas")
    for stage in (0, 3):
        for checkpointing, offload in POLICIES:
            net = build_gpt(args.preset, vocab_size=256, seq_len=args.seq_len, seed=0)
            model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters(), lr=1e-3), stage=stage,
                                        activation_checkpointing=checkpointing, activation_offload=offload,
                                        measure_activations=True)
            model(ids, targets).backward()
            optimizer.step()
            report = model.memory_report()
            priced = traced.profile(checkpointing, offload, args.micro_batch)
            device, host = report.peak_activations, report.peak_host_activations
            print(f"{stage:>5} {checkpointing:15s} {str(offload):7s} {device:>10} {host:>10} | {priced.peak:>10} "
                  f"{priced.kept:>10} {priced.kept_host:>10} | {priced.peak / device:9.3f} "
                  f"{priced.kept / device:9.3f} " + (f"{priced.kept_host / host:9.3f}" if host else f"{'-':>9}"))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
