"""``python -m shardengine.selfcheck``: the run, in order, and its verdict.

    python -m shardengine.selfcheck --fast                       # this process: N=1, and N=2 simulated
    torchrun --nproc_per_node=2 -m shardengine.selfcheck --fast  # the launched world
    python -m shardengine.selfcheck --calibration-out calib.json --json-out selfcheck.json

Exit code 0 when every check passed (or was informational / not measurable
here), 1 when any failed, 2 on bad arguments.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

import shardengine as se
from shardengine.distributed.communicator import Communicator

from .calibration_file import build_calibration, write_calibration
from .correctness import TrainingCase, correctness_checks
from .device_rates import measure_device
from .environment import describe_environment, environment_checks
from .links import overlap_fraction, time_collectives
from .memory_estimate import live_memory_checks, simulated_memory_checks
from .measurement_rows import calibration_checks, device_checks, link_checks
from .verdict import Check, exit_code, render

STAGES = (0, 1, 2, 3)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m shardengine.selfcheck", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fast", action="store_true",
                        help="CI settings: 2 training steps, bf16 at stage 3 only, small buffers (<1 min on CPU)")
    parser.add_argument("--simulate", type=int, default=2,
                        help="world size simulated on a fake process group for the memory check when not "
                             "launched (default 2; 0: off)")
    parser.add_argument("--sizes-kib", default=None,
                        help="collective buffer sizes in KiB (default 64,1024,16384; --fast: 16,256)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds per collective (default 5; --fast 2)")
    parser.add_argument("--compute-dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="dtype of the matmul timing (default bfloat16 on CUDA, float32 on CPU)")
    parser.add_argument("--tolerance", type=float, default=0.10,
                        help="allowed |relative error| of the estimator's per-rank total (default 0.10)")
    parser.add_argument("--calibration-out", default=None, metavar="FILE",
                        help="write the measurements as a calibration file (memory-estimator --calibration FILE)")
    parser.add_argument("--json-out", default=None, metavar="FILE", help="write environment and every check as JSON")
    return parser


def _reduce_max(comm: Optional[Communicator], value: int, device: torch.device) -> int:
    """The largest ``value`` over the ranks: every rank exits with the same code."""
    if comm is None:
        return value
    flag = torch.tensor([float(value)], device=device)   # NCCL reduces only device tensors
    comm.all_reduce_max(flag)
    return int(flag.item())


def run(args: argparse.Namespace) -> tuple[list[Check], dict]:
    """Every check, on every rank; rank 0's list is the verdict."""
    info = se.init_distributed()
    device = info.device
    launched = info.backend is not None
    comm = Communicator.create() if launched else None
    case = TrainingCase(steps=2 if args.fast else 3)
    env = describe_environment(info.backend, info.rank, info.world_size, device)
    checks = environment_checks(env)
    if not launched and torch.cuda.is_available():
        checks.append(Check("environment", "GPU", "info", "not launched: checks run on the CPU; run under "
                            "`torchrun --nproc_per_node=1 -m shardengine.selfcheck` to check the GPU"))
    precisions = ["fp32", "bf16"]
    checks += correctness_checks(STAGES, ["fp32"], info.rank, info.world_size, device, case)
    checks += correctness_checks((3,) if args.fast else STAGES, precisions[1:], info.rank, info.world_size,
                                 device, case)
    timings, overlap = [], 0.0
    if comm is not None and info.world_size > 1:
        sizes = [int(s) * 1024 for s in (args.sizes_kib or ("16,256" if args.fast else "64,1024,16384")).split(",")]
        timings = time_collectives(comm, sizes, args.rounds or (2 if args.fast else 5), device)
        overlap = overlap_fraction(comm, device)
    dtype = getattr(torch, args.compute_dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    rates = measure_device(device, dtype, args.fast)
    calibration = build_calibration(info.backend, info.world_size, device, rates, timings,
                                    comm is not None and comm.in_place_primitives, overlap)
    checks += link_checks(timings, info.world_size, overlap) + device_checks(rates)
    if args.calibration_out and info.rank == 0:
        path = write_calibration(calibration, Path(args.calibration_out))
        checks += calibration_checks(path)
    memory_precisions = ["fp32"] if args.fast else precisions
    if launched:
        checks += live_memory_checks(STAGES, info.world_size, memory_precisions, device, args.tolerance,
                                     comm.reduces_in_place)
    else:
        # One rank of a simulated N trains every stage on the fake group: it runs, and its memory is checked
        # (its values are not: nothing is reduced). --fast leaves out N=1, whose layout has no padding.
        for world in sorted(({args.simulate} if args.fast else {1, args.simulate}) - {0}):
            checks += simulated_memory_checks(STAGES, world, memory_precisions, device, args.tolerance)
    report = {"environment": env.as_dict(), "calibration": calibration.__dict__ | {"samples": list(calibration.samples)},
              "checks": [check.__dict__ for check in checks]}
    failed = _reduce_max(comm, exit_code(checks), device)
    report["exit_code"] = failed
    return checks, report


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.simulate < 0 or (args.rounds is not None and args.rounds < 1) or not 0 < args.tolerance < 1:
        print("error: --simulate must be >= 0, --rounds >= 1 and --tolerance in (0, 1)", file=sys.stderr)
        return 2
    started = time.perf_counter()
    with contextlib.redirect_stdout(sys.stderr):   # the engine's and validate's own lines go to stderr
        checks, report = run(args)
    report["seconds"] = time.perf_counter() - started
    if report["environment"]["rank"] == 0:
        print(render(checks, f"shardengine selfcheck ({report['seconds']:.0f} s)"))
        failed = [c for c in checks if c.failed]
        print("verdict: " + ("all checks passed" if not failed else
                             f"{len(failed)} check(s) failed: " + "; ".join(f"{c.area}/{c.name}" for c in failed)))
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(report, indent=1, default=str))
    return report["exit_code"]
