"""What fine-tuning a base costs each rank's host memory before and during the first step.

    python benchmarks/bench_finetune_load.py --ranks 2 4 --layers 16 --hidden 512
    python benchmarks/bench_finetune_load.py --ranks 2 --modes lora --glibc-default
    python benchmarks/bench_finetune_load.py --ranks 2 --modes lora --layers 4 --no-checkpointing --steps 5

Writes a seeded Llama-shaped base (``save_pretrained``, fp32) once, then for each
rank count and mode launches that many CPU ranks (torchrun). Each rank reads
its resident size after the imports (the baseline), then its high-water mark
(``VmHWM``; it never goes down) after each phase, so each figure is the peak
up to the end of that phase, minus the baseline:

* ``full``: the base on the meta device, ``se.shard(stage=3)`` (every parameter
  trains, AdamW), ``se.load_pretrained``, one step;
* ``lora``: the same base on meta, ``peft.get_peft_model`` (r=8 on q and v),
  ``se.shard(stage=3)``, ``se.load_pretrained``, one step;
* ``lora-loaded``: the flow before streaming: ``from_pretrained`` on every
  rank, ``get_peft_model``, ``se.shard(stage=3)`` (load counts as building);
* ``qlora``: the base declared NF4 with double quantization on meta
  (``replace_with_bnb_linear``, the head kept fp32), LoRA as above, ``se.shard(stage=3)``,
  ``se.load_pretrained`` (which quantizes it tensor by tensor), one step;
* ``qlora-loaded``: ``from_pretrained(quantization_config=...)`` on every rank, then as
  ``lora-loaded``;
* ``qlora-int8``, ``qlora-int8-loaded``: the same two with an int8 base
  (``BitsAndBytesConfig(load_in_8bit=True)``: bitsandbytes' row-wise int8 and its default
  outlier threshold);
* ``qlora-int8-stored``: as ``qlora-int8``, but ``se.load_pretrained`` reads a folder that
  bitsandbytes saved pre-quantized (``from_pretrained(..., load_in_8bit)`` then
  ``save_pretrained``, written once by the launcher): each rank reads its slice of the codes.

``--steps K`` (K > 1) then trains K - 1 more steps with the high-water mark reset first
(Linux), so ``steps 2-K`` is the training steps' own peak above the baseline, and
``gathered`` the most bytes of gathered units the engine held at once in them
(``memory_report().peak_comm_buffers``: the units computed and prefetched, and the
gradients in flight), and ``tensors in a step`` the most bytes of tensors one more step,
under the allocator tracker, allocated and held at once (activations included; the shard
and the libraries' code pages, which the high-water mark counts, are not).
``--no-checkpointing`` trains without activation checkpointing.

By default the ranks run with ``MALLOC_MMAP_THRESHOLD_=131072``: glibc otherwise
raises its mmap threshold to the size of each freed large block, and freed
unit-sized buffers then stay resident in the heap. ``--glibc-default`` measures
without it. Timings on a shared machine are noisy. Results: a table on stdout
and ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

MiB = 2**20
MODES = ("full", "lora", "lora-loaded", "qlora", "qlora-loaded", "qlora-int8", "qlora-int8-loaded",
         "qlora-int8-stored")
STORED = "int8-saved"  # the pre-quantized folder, beside the base


def llama_config(args: argparse.Namespace):
    import transformers
    return transformers.LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                                    num_hidden_layers=args.layers, num_attention_heads=max(1, args.hidden // 64),
                                    num_key_value_heads=max(1, args.hidden // 64), head_dim=64,
                                    vocab_size=args.vocab)


def write_base(args: argparse.Namespace, folder: str) -> int:
    import torch
    import transformers
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(llama_config(args))
    model.save_pretrained(folder)
    return sum(p.numel() * p.element_size() for p in model.parameters())


# --------------------------------------------------------------------------- one rank


def rank_main(args: argparse.Namespace) -> None:
    import warnings
    warnings.filterwarnings("ignore")
    import peft
    import torch
    import transformers
    import shardengine as se
    from shardengine.testing.host_memory import peak_rss_bytes, peak_rss_resets, rss_bytes

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(1)
    se.init_distributed()
    baseline = rss_bytes()
    marks = {}
    started = time.perf_counter()
    if args.mode == "lora-loaded":
        net = transformers.LlamaForCausalLM.from_pretrained(args.folder)
    elif args.mode.startswith("qlora") and args.mode.endswith("-loaded"):
        net = transformers.LlamaForCausalLM.from_pretrained(args.folder, quantization_config=quantization(args.mode),
                                                            device_map="cpu", dtype=torch.float32)
    else:
        with torch.device("meta"):
            net = transformers.LlamaForCausalLM(llama_config(args))
            if args.mode.startswith("qlora"):
                from transformers.integrations.bitsandbytes import replace_with_bnb_linear
                net = replace_with_bnb_linear(net, modules_to_not_convert=["lm_head"],
                                              quantization_config=quantization(args.mode))
    if not args.no_checkpointing:
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.mode != "full":
        net = peft.get_peft_model(net, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    model, optimizer = se.shard(net, torch.optim.AdamW([p for p in net.parameters() if p.requires_grad]), stage=3)
    marks["built"] = (peak_rss_bytes(), time.perf_counter() - started)
    started = time.perf_counter()
    if not args.mode.endswith("-loaded"):
        se.load_pretrained(model, os.path.join(args.folder, STORED) if args.mode.endswith("-stored") else args.folder)
    marks["loaded"] = (peak_rss_bytes(), time.perf_counter() - started)
    started = time.perf_counter()
    ids = torch.randint(0, args.vocab, (args.micro_batch, args.seq_len), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    marks["stepped"] = (peak_rss_bytes(), time.perf_counter() - started)
    if args.steps > 1:  # the later steps' own peak: the high-water mark restarts at their start
        started, _ = time.perf_counter(), model.step_stats()  # (which restarts the engine's peak too)
        if not peak_rss_resets():
            raise RuntimeError("--steps > 1 needs a kernel that lets a process reset its high-water mark")
        for _ in range(args.steps - 1):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        marks["later"] = (peak_rss_bytes(), time.perf_counter() - started)
        marks["gathered"] = (baseline + model.memory_report().peak_comm_buffers, 0.0)
        marks["tensors"] = (baseline + tracked_step_peak(model, optimizer, ids), 0.0)
    result = {"rank": se.distributed.rank(), "baseline": baseline,
              **{f"{k}_peak": v[0] - baseline for k, v in marks.items()},
              **{f"{k}_s": v[1] for k, v in marks.items()}}
    with open(os.path.join(args.results, f"{args.mode}.{se.distributed.rank()}.json"), "w") as f:
        json.dump(result, f)


def tracked_step_peak(model, optimizer, ids) -> int:
    """One more step under the allocator tracker (after the high-water marks are read: the
    profiler's own memory would count there): the most bytes of tensors it allocated that were
    alive at once (activations, gathered units, gradients, the step's temporaries)."""
    from shardengine.testing.allocator_tracker import AllocatorTracker
    with AllocatorTracker() as tracker:
        with tracker.phase("step"):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return tracker.peak_in("step", since="step")


# --------------------------------------------------------------------------- launcher


def launch(args: argparse.Namespace, ranks: int, mode: str, folder: str) -> list[dict]:
    results_dir = tempfile.mkdtemp(dir=folder)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               os.path.abspath(__file__), "--rank-main", "--mode", mode, "--folder", folder, "--results", results_dir,
               "--layers", str(args.layers), "--hidden", str(args.hidden), "--vocab", str(args.vocab),
               "--micro-batch", str(args.micro_batch), "--seq-len", str(args.seq_len), "--steps", str(args.steps)]
    if args.no_checkpointing:
        command.append("--no-checkpointing")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not args.glibc_default:
        env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    results = []
    for name in os.listdir(results_dir):
        with open(os.path.join(results_dir, name)) as f:
            results.append(json.load(f))
    if done.returncode != 0 or len(results) != ranks:
        raise RuntimeError(f"{mode} at {ranks} ranks failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return sorted(results, key=lambda r: r["rank"])


def write_stored(folder: str) -> None:
    """bitsandbytes' own pre-quantized int8 folder of the base, in ``folder/STORED``."""
    import torch
    import transformers
    transformers.LlamaForCausalLM.from_pretrained(folder, quantization_config=quantization("qlora-int8"),
                                                  device_map="cpu", dtype=torch.float32).save_pretrained(
        os.path.join(folder, STORED))


def quantization(mode: str):
    """The bitsandbytes config of a ``qlora*`` mode: NF4 with double quantization, or int8."""
    import torch
    import transformers
    if mode.startswith("qlora-int8"):
        return transformers.BitsAndBytesConfig(load_in_8bit=True)
    return transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                           bnb_4bit_compute_dtype=torch.float32)


def estimated_load_peak(args: argparse.Namespace, ranks: int, mode: str) -> int:
    """The memory estimator's stage-3 load-time host peak for this run (no fixed overhead)."""
    from memory_estimator import estimate
    result = estimate(config=llama_config(args).to_dict(), lora_rank=8, lora_targets="q_proj,v_proj",
                      world_size=ranks, precision="fp32", device_memory_bytes=1 << 50, engine="shardengine",
                      base_dtype={"qlora": "nf4", "qlora-int8": "int8"}.get(mode))
    return result.plan("zero3").load_host_peak


def report(args: argparse.Namespace, base_bytes: int, unit_bytes: int, rows: list[dict]) -> None:
    print(f"\nbase {base_bytes / MiB:.1f} MiB fp32 ({args.layers} layers of {unit_bytes / MiB:.1f} MiB); "
          f"peak host memory per rank above its post-import baseline, max over ranks, MiB\n")
    later = args.steps > 1
    print("| N | mode | shard of the base | built | loaded | first step |"
          + (f" steps 2-{args.steps} | gathered in them | tensors in a step |" if later else "") + " load time (s) | estimator, load |")
    print("|---|---|---|---|---|---|" + ("---|---|---|" if later else "") + "---|---|")
    for row in rows:
        ranks = row["results"]
        phases = ("built", "loaded", "stepped") + (("later", "gathered", "tensors") if later else ())
        peak = {k: max(r[f"{k}_peak"] for r in ranks) / MiB for k in phases}
        load_s = max(r["built_s" if row["mode"].endswith("-loaded") else "loaded_s"] for r in ranks)
        estimated = row["mode"] in ("lora", "qlora", "qlora-int8")
        predicted = estimated_load_peak(args, row["ranks"], row["mode"]) if estimated else None
        print(f"| {row['ranks']} | {row['mode']} | {base_bytes / row['ranks'] / MiB:.1f} | {peak['built']:.1f} | "
              f"{peak['loaded']:.1f} | {peak['stepped']:.1f} | "
              + (f"{peak['later']:.1f} | {peak['gathered']:.1f} | {peak['tensors']:.1f} | " if later else "") + f"{load_s:.2f} | "
              f"{'-' if predicted is None else f'{predicted / MiB:.1f}'} |")
    baseline = max(r["baseline"] for row in rows for r in row["results"]) / MiB
    print(f"\nbaseline (interpreter, torch, transformers, peft, process group): up to {baseline:.0f} MiB per rank")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=1, help="training steps (the later ones measured apart)")
    parser.add_argument("--no-checkpointing", action="store_true", help="train without activation checkpointing")
    parser.add_argument("--glibc-default", action="store_true", help="leave glibc's dynamic mmap threshold on")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--results", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_main:
        rank_main(args)
        return 0
    with tempfile.TemporaryDirectory() as folder:
        base_bytes = write_base(args, folder)
        if any(mode.endswith("-stored") for mode in args.modes):
            write_stored(folder)
        hidden, inter = args.hidden, args.hidden * 11 // 4
        heads = max(1, hidden // 64)
        unit_bytes = 4 * (2 * hidden * heads * 64 + 2 * hidden * heads * 64 + 3 * hidden * inter + 2 * hidden)
        rows = [{"ranks": n, "mode": mode, "results": launch(args, n, mode, folder)}
                for n in args.ranks for mode in args.modes]
    report(args, base_bytes, unit_bytes, rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"base_bytes": base_bytes, "unit_bytes": unit_bytes, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
