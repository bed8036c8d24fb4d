#!/usr/bin/env python3
"""The first run on a GPU, prepared: one GPU, at most ten minutes, every figure in one JSON file.

    python benchmarks/gpu_check.py                      # on the GPU machine; writes $OUT/gpu_check.json
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check.json   # the same sequence on CPU, tiny sizes

Steps, in order, each in its own process with its own time budget (a crash or a
timeout is recorded and the next step runs), the results file rewritten after
every step so that a run cut short keeps what it had:

1. ``selfcheck``: ``torchrun --nproc_per_node=1 -m shardengine.selfcheck`` (NCCL, world 1):
   the verdict rows, the environment, and the calibration file it writes
   (CUDA context, fragmentation, matmul rate in bf16, ...).
2. ``cuda_streams``: the stream/event helpers of shardengine/distributed/streams.py on this
   device: a copy queued on the gather stream and read on the compute stream after its event,
   a buffer held in ``InFlight`` until its event completes, a pinned host copy.
3. ``validate``: ``python -m memory_estimator.measure.validate --json`` at stages 0-3, fp32 and bf16,
   one rank of N=2 on a fake process group: predicted per-rank peak vs
   ``torch.cuda.max_memory_allocated()``, term by term.
4. ``engine``: ``benchmarks/bench_engine.py`` under torchrun, one rank: step time, tokens/s and bytes of
   torch DDP and FSDP2 against shardengine stages 0-3 (fp32, and bf16 at stage 3), N=1, NCCL.
5. ``compiled``: bench_engine's ``--compile``: eager vs ``torch.compile`` at stages 0 and 3.
6. ``offload``: bench_engine with ``offload_optimizer=True`` (stage 2, and stage 3 in bf16)
   beside stage 2 without it.

``--dry-run`` runs the same steps on the CPU with tiny sizes and small budgets (the
compile step with dynamo's ``eager`` backend); CI runs it (tests/selfcheck/test_gpu_check.py).
Exit code 0 when every step ran and the selfcheck passed, else 1.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parent.parent
TOTAL_BUDGET_S = 570     # ten minutes of device time, less start-up and the file's last write


def _python() -> str:
    """The interpreter each step starts: ``$PYTHON_EXEC`` where set (torchrun's own override for
    its ranks, which the steps' torchrun reads too), else this one. The test of the dry run sets
    it to its preloaded interpreter, so the ten processes the steps start skip importing torch."""
    return os.environ.get("PYTHON_EXEC") or sys.executable


def _env(dry_run: bool) -> dict[str, str]:
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    # this checkout importable; left as it is when it already is, so the preloaded start still matches
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path if str(ROOT) in path else [str(ROOT), *path])}
    if dry_run:
        env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return env


def _run(command: list[str], timeout_s: float, dry_run: bool, keep_stdout: bool = False) -> dict[str, Any]:
    """Run ``command``; its exit code, seconds, and the tail of what it printed."""
    started = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, env=_env(dry_run), capture_output=True, text=True,
                              timeout=max(1.0, timeout_s))
        code, out, err = done.returncode, done.stdout, done.stderr
    except subprocess.TimeoutExpired as expired:
        code = "timeout"
        out = expired.stdout.decode(errors="replace") if isinstance(expired.stdout, bytes) else expired.stdout or ""
        err = expired.stderr.decode(errors="replace") if isinstance(expired.stderr, bytes) else expired.stderr or ""
    result = {"command": " ".join(command), "exit_code": code, "seconds": round(time.perf_counter() - started, 1),
              "stdout_tail": out[-4000:], "stderr_tail": err[-3000:]}
    if keep_stdout:
        result["stdout"] = out
    return result


def _read_json(path: Path) -> Optional[Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


# --------------------------------------------------------------------------- the steps


def step_selfcheck(args, work: Path, budget: float) -> dict:
    report, calibration = work / "selfcheck.json", work / "calibration.json"
    command = [_python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
               "-m", "shardengine.selfcheck", "--json-out", str(report), "--calibration-out", str(calibration)]
    result = _run(command + (["--fast"] if args.dry_run else []), budget, args.dry_run)
    result["report"] = _read_json(report)
    result["calibration"] = _read_json(calibration)
    return result


def step_cuda_streams(args, work: Path, budget: float) -> dict:
    return _run([_python(), str(Path(__file__).resolve()), "--streams-only"], budget, args.dry_run)


def step_validate(args, work: Path, budget: float) -> dict:
    models, precision = ("gpt-tiny", "fp32") if args.dry_run else ("gpt-tiny,gpt-10m", "fp32,bf16")
    result = _run([_python(), "-m", "memory_estimator.measure.validate", "--json", "--models", models,
                   "--stages", "0,1,2,3", "--world-size", "2", "--precision", precision], budget, args.dry_run,
                  keep_stdout=True)
    stdout = result.pop("stdout")
    try:
        result["rows"] = json.loads(stdout[stdout.index("{"):])
    except ValueError:  # no JSON: it crashed or timed out (the tails say why)
        result["rows"] = None
    return result


def _bench(args, work: Path, budget: float, name: str, extra: list[str]) -> dict:
    out = work / f"bench_{name}"
    size, rounds = ("tiny", "2") if args.dry_run else ("10m", "12")
    # Launched here: bench_engine's own launcher forwards --nproc, which torchrun takes for its --nproc-per-node.
    command = [_python(), "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
               str(ROOT / "benchmarks" / "bench_engine.py"), "--sizes", size,
               "--rounds", rounds, "--min-rounds", "1", "--warmup", "1", "--seq-len", "64" if args.dry_run else "256",
               "--micro-batch", "1" if args.dry_run else "8",
               "--budget-min", f"{max(0.1, (budget - 40) / 60):.2f}", "--out", str(out), *extra]
    result = _run(command, budget, args.dry_run)
    result["results"] = _read_json(out.with_suffix(".json"))
    return result


def step_engine(args, work: Path, budget: float) -> dict:
    return _bench(args, work, budget, "engine", ["--configs", "ddp,fsdp2,s0,s1,s2,s3,fsdp2-bf16,s3-bf16"])


def step_compiled(args, work: Path, budget: float) -> dict:
    return _bench(args, work, budget, "compiled", ["--compile", "eager" if args.dry_run else "inductor"])


def step_offload(args, work: Path, budget: float) -> dict:
    # s3-bf16-params against s3-bf16: the host copies of the parameters under the gathers (target <= 1.3x)
    return _bench(args, work, budget, "offload",
                  ["--configs", "s2,s2-offload,s3-bf16,s3-bf16-offload,s3-bf16-params"])


# (name, share of the total budget, step)
STEPS: list[tuple[str, float, Callable[[Any, Path, float], dict]]] = [
    ("selfcheck", 0.20, step_selfcheck), ("cuda_streams", 0.04, step_cuda_streams),
    ("validate", 0.14, step_validate), ("engine", 0.28, step_engine),
    ("compiled", 0.20, step_compiled), ("offload", 0.14, step_offload)]


# --------------------------------------------------------------------------- streams, in-process


def check_streams() -> dict:
    """The helpers of distributed/streams.py on this device (no-ops on a CPU): values as expected."""
    import torch

    from shardengine.distributed.streams import CommStreams, InFlight, copy_between, host_wait

    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    streams = CommStreams(device)
    source = torch.arange(1 << 20, device=device, dtype=torch.float32)
    with streams.run_on(streams.gather):      # waits for the compute stream's arange first
        gathered = source * 2
    event = streams.record(streams.gather)
    streams.wait(event)                        # compute waits for the gather stream, the host does not
    held = InFlight()
    held.hold(event, gathered)
    total = float((gathered - source * 2).abs().sum())
    host = torch.empty(source.numel(), pin_memory=device.type == "cuda")
    with streams.run_on(streams.host_copy):
        copy_between(host, source)
    copy_event = streams.record(streams.host_copy)
    host_wait(copy_event)
    drained = held.drain(streams)
    return {"device": str(device), "streams_enabled": streams.enabled, "gathered_error": total,
            "host_copy_matches": bool(torch.equal(host, source.cpu())), "held_released": drained,
            "ok": total == 0.0 and bool(torch.equal(host, source.cpu())) and drained == 1}


# --------------------------------------------------------------------------- driver


def default_out() -> Path:
    return Path(os.environ["OUT"]) / "gpu_check.json" if os.environ.get("OUT") else \
        ROOT / "benchmarks" / "results" / "gpu_check.json"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="results JSON (default $OUT/gpu_check.json, else "
                                                    "benchmarks/results/gpu_check.json)")
    parser.add_argument("--dry-run", action="store_true", help="the same sequence on CPU with tiny sizes")
    parser.add_argument("--budget-s", type=float, default=TOTAL_BUDGET_S, help="all steps together (default 570)")
    parser.add_argument("--steps", default=",".join(name for name, _, _ in STEPS), help="which steps, in order")
    parser.add_argument("--streams-only", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.streams_only:
        result = check_streams()
        print(json.dumps(result))
        return 0 if result["ok"] else 1
    out = Path(args.out) if args.out else default_out()
    out.parent.mkdir(parents=True, exist_ok=True)
    work = out.with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    wanted = args.steps.split(",")
    unknown = sorted(set(wanted) - {name for name, _, _ in STEPS})
    if unknown:
        print(f"unknown steps {unknown}; known: {[name for name, _, _ in STEPS]}", file=sys.stderr)
        return 2
    deadline = time.perf_counter() + args.budget_s
    results: dict[str, Any] = {"dry_run": args.dry_run, "budget_s": args.budget_s, "steps": {}}
    for name, share, step in STEPS:
        if name not in wanted:
            continue
        budget = min(share * args.budget_s, deadline - time.perf_counter())
        print(f"[gpu_check] {name}: up to {budget:.0f} s", flush=True)
        try:
            results["steps"][name] = step(args, work, budget) if budget > 1 else {"exit_code": "no time left"}
        except Exception as error:   # one step's failure must not lose the others' figures
            results["steps"][name] = {"exit_code": "error", "error": f"{type(error).__name__}: {error}"}
        outcome = results["steps"][name]
        print(f"[gpu_check] {name}: exit {outcome.get('exit_code')} in {outcome.get('seconds', 0)} s", flush=True)
        out.write_text(json.dumps(results, indent=1, default=str))
    results["ok"] = all(r.get("exit_code") == 0 for r in results["steps"].values())
    out.write_text(json.dumps(results, indent=1, default=str))
    print(f"[gpu_check] wrote {out}; " + ("every step ran" if results["ok"] else "some steps failed: " + ", ".join(
        n for n, r in results["steps"].items() if r.get("exit_code") != 0)), flush=True)
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
