"""Peak host memory per rank and time of se.load_pretrained / se.save_pretrained at stage 3.

    python benchmarks/bench_pretrained.py --ranks 8 --layers 8 --hidden 1024 --vocab 8000  # memory
    python benchmarks/bench_pretrained.py --ranks 2 --layers 16 --hidden 2048 --vocab 32000  # time

Launches ``--ranks`` CPU ranks (torchrun) itself. Each rank builds a Llama-shaped
``LlamaForCausalLM`` on the meta device and shards it at stage 3 (materialized and
initialized unit by unit), saves it with ``se.save_pretrained`` (sharded safetensors),
frees it, builds a fresh meta model, shards it and streams the saved folder back in with
``se.load_pretrained``; the loaded master slices must equal the saved ones bit for bit
(sha256 per bucket). Peak RSS is the kernel's high-water mark (``VmHWM``), reset through
``/proc/self/clear_refs`` right before each phase. Then, side by side in the same run,
rank 0 alone does what a non-streaming loader does: ``safetensors.torch.load_file`` of
every file (the whole model in memory) and ``save_file`` of it, for the time and memory
ratios. Results: a table on stdout and ``--json``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from launch import torchrun, under_launcher  # benchmarks/launch.py

MiB = 2**20


def rss() -> int:
    return _status_kb("VmRSS") * 1024


def peak_rss() -> int:
    return _status_kb("VmHWM") * 1024


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark restarts from the current RSS


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def build_sharded(args: argparse.Namespace):
    import transformers
    import shardengine as se
    config = transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                      num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                                      num_key_value_heads=max(1, args.hidden // 512), vocab_size=args.vocab,
                                      tie_word_embeddings=False)
    with torch.device("meta"):
        net = transformers.LlamaForCausalLM(config)
    model, _ = se.shard(net, lambda params: torch.optim.SGD(params, lr=0.0), stage=3)
    return model


def release(model) -> None:
    """Let the model be freed: torch keeps tensors with post-accumulate-grad hooks alive through
    C++, so the hooks' references back to the engine form a cycle gc cannot collect."""
    model.engine.remove_hooks()


def fingerprint(model) -> list[str]:
    return [hashlib.sha256(b.master.detach().numpy().tobytes()).hexdigest() for b in model.engine.buckets]


def phase(name: str, action, results: dict):
    gc.collect()
    dist.barrier()
    before = rss()
    reset_peak()
    started = time.perf_counter()
    value = action()
    results[name] = {"seconds": time.perf_counter() - started, "rss_before": before, "peak": peak_rss()}
    dist.barrier()
    return value


def rank_main(args: argparse.Namespace) -> None:
    import shardengine as se
    se.init_distributed()
    torch.set_num_threads(1)
    from transformers import LlamaForCausalLM  # noqa: F401 - imported before the baseline is taken
    folder = args.folder
    results: dict = {"base_rss": rss()}
    model = phase("shard (meta init)", lambda: build_sharded(args), results)
    full_bytes = sum(p.numel() * 4 for p in model.module.parameters())
    shard_bytes = sum(b.master.numel() * 4 for b in model.engine.buckets)
    largest = max(p.numel() * 4 for p in model.module.parameters())
    saved = fingerprint(model)
    phase("save_pretrained", lambda: se.save_pretrained(model, folder, max_shard_size=args.max_shard_size), results)
    release(model)
    del model
    fresh = phase("shard (fresh model)", lambda: build_sharded(args), results)
    report = phase("load_pretrained", lambda: se.load_pretrained(fresh, folder), results)
    assert fingerprint(fresh) == saved, "the loaded master slices differ from the saved ones"
    results.update(full_bytes=full_bytes, shard_bytes=shard_bytes, largest_tensor=largest,
                   bytes_read=report.bytes_read, files=len([f for f in os.listdir(folder) if f.endswith(".safetensors")]))
    release(fresh)
    del fresh
    if dist.get_rank() == 0 and not args.skip_baseline:
        results["baseline"] = non_streaming_baseline(folder)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    if dist.get_rank() == 0:
        report_results(args, gathered)
    dist.destroy_process_group()


def non_streaming_baseline(folder: str) -> dict:
    """Rank 0: the whole checkpoint through safetensors' own load_file / save_file."""
    from safetensors.torch import load_file, save_file
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    gc.collect()
    before = rss()
    reset_peak()
    started = time.perf_counter()
    state = {}
    for name in files:
        state.update({k: v.clone() for k, v in load_file(os.path.join(folder, name)).items()})
    load = {"seconds": time.perf_counter() - started, "rss_before": before, "peak": peak_rss()}
    out = tempfile.mkdtemp(dir=os.path.dirname(folder))
    started = time.perf_counter()
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    save = {"seconds": time.perf_counter() - started}
    shutil.rmtree(out)
    return {"load_file": load, "save_file": save}


def report_results(args: argparse.Namespace, ranks: list[dict]) -> None:
    first = ranks[0]
    full, shard = first["full_bytes"], first["shard_bytes"]
    print(f"\nLlamaForCausalLM, {full / 4 / 1e6:.0f} M params = {full / MiB:.0f} MiB fp32; "
          f"N = {len(ranks)} ranks, stage 3; shard {shard / MiB:.1f} MiB per rank "
          f"(model = {full / shard:.1f} x shard); largest tensor {first['largest_tensor'] / MiB:.1f} MiB; "
          f"{first['files']} files of at most {args.max_shard_size}")
    print("base: RSS after imports, before any model; before: RSS when the phase starts; "
          "peak: VmHWM during the phase (MiB)")
    print(f"{'rank':>4} | {'phase':<20} | {'seconds':>7} | {'base':>6} | {'before':>6} | {'peak':>6} | "
          f"{'peak-before':>11} | {'peak-base':>9} | {'(peak-base)/model':>17}")
    for rank, result in enumerate(ranks):
        for name in ("shard (meta init)", "save_pretrained", "shard (fresh model)", "load_pretrained"):
            p, base = result[name], result["base_rss"]
            print(f"{rank:>4} | {name:<20} | {p['seconds']:7.2f} | {base / MiB:6.0f} | {p['rss_before'] / MiB:6.0f} | "
                  f"{p['peak'] / MiB:6.0f} | {(p['peak'] - p['rss_before']) / MiB:11.1f} | "
                  f"{(p['peak'] - base) / MiB:9.1f} | {(p['peak'] - base) / full:17.2f}")
    read_mib = [round(r["bytes_read"] / MiB, 1) for r in ranks]
    load = max(r["load_pretrained"]["seconds"] for r in ranks)
    save = max(r["save_pretrained"]["seconds"] for r in ranks)
    print(f"\nload_pretrained {load:.2f} s ({full / load / 1e9:.2f} GB/s of model), "
          f"save_pretrained {save:.2f} s ({full / save / 1e9:.2f} GB/s); "
          f"bytes read per rank: {', '.join(f'{r}M' for r in read_mib)}")
    if "baseline" in first:
        b = first["baseline"]
        held = b["load_file"]["peak"] - b["load_file"]["rss_before"]
        print(f"side by side, rank 0 alone with safetensors' load_file/save_file of the whole model: "
              f"load {b['load_file']['seconds']:.2f} s (ours {load / b['load_file']['seconds']:.2f}x), "
              f"peak +{held / MiB:.0f}M = {held / full:.2f} x full model; "
              f"save {b['save_file']['seconds']:.2f} s (ours {save / b['save_file']['seconds']:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "ranks": ranks}, f, indent=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8, help="ranks (this script launches torchrun itself)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024, help="a multiple of 128 (head dim 128)")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--max-shard-size", default="200MB", help="largest safetensors file")
    parser.add_argument("--folder", default=None, help="where to save (default: a temporary folder, removed)")
    parser.add_argument("--skip-baseline", action="store_true", help="no load_file/save_file comparison")
    parser.add_argument("--json", default=None, help="write the per-rank results here")
    args = parser.parse_args(argv)
    if under_launcher():
        rank_main(args)
        return 0
    temporary = args.folder is None
    folder = args.folder or tempfile.mkdtemp(prefix="bench_pretrained_")
    passed = argv if argv is not None else sys.argv[1:]
    # A fixed mmap threshold turns off glibc's adaptive one, so freed buffers go back to the
    # kernel and each phase's RSS is its own, not what an earlier phase left cached.
    env = {"TRANSFORMERS_VERBOSITY": "error", "MALLOC_MMAP_THRESHOLD_": str(128 * 1024)}
    try:  # the last --folder wins
        return torchrun(__file__, args.ranks, [*passed, "--folder", os.path.join(folder, "saved")], env=env)
    finally:
        if temporary:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
