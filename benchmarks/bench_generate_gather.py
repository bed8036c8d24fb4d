"""Stage-3 generation: units gathered per token (the default) against once per ``generate()`` call.

    python benchmarks/bench_generate_gather.py                # launches 2 CPU ranks itself
    python benchmarks/bench_generate_gather.py --layers 8 --hidden 512 --new-tokens 64

A Llama of ``--layers`` x ``--hidden`` (random, built here) is sharded at stage 3 and generates
``--new-tokens`` greedily for ``--batch`` prompts, once with the default (each decoding step
gathers every unit and frees it) and once with ``generate_gather_bytes`` large enough to hold the
model (each unit gathered once per call), round-robin, median of ``--rounds``. Reported: seconds
per call, the parameter bytes each rank sent (``comm_stats()``), and the most transient bytes
held at once (``memory_report().peak_comm_buffers``: the gathered units). Rank 0 prints a
markdown table (docs/rl.md quotes it). The tokens of both modes are checked equal.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist

import shardengine as se
from launch import relaunch, under_launcher  # benchmarks/launch.py

MiB = 2**20


def build(layers: int, hidden: int):
    import transformers

    config = transformers.LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=1024,
                                      bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def one_call(model, prompt: torch.Tensor, new_tokens: int) -> tuple[float, int, int, torch.Tensor]:
    model.reset_comm_stats()  # the byte counters and the transient-bytes peak
    dist.barrier()
    started = time.perf_counter()
    with torch.no_grad():
        tokens = model.generate(input_ids=prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                do_sample=False, pad_token_id=0)
    seconds = time.perf_counter() - started
    return seconds, model.comm_stats().bytes_total, model.memory_report().peak_comm_buffers, tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args(argv)
    if not under_launcher():
        return relaunch(__file__, args.nproc, argv)
    warnings.filterwarnings("ignore")
    se.init_distributed()
    torch.set_num_threads(1)
    modes = {"per unit per token": None, "once per call": "64GiB"}
    models = {}
    for name, budget in modes.items():
        net = build(args.layers, args.hidden)
        options = {"generate_gather_bytes": budget} if budget else {}
        models[name], _ = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=3, **options)
    prompt = torch.randint(3, 1024, (args.batch, 8), generator=torch.Generator().manual_seed(0))
    results: dict[str, list] = {name: [] for name in modes}
    for _ in range(args.rounds):
        for name in modes:
            results[name].append(one_call(models[name], prompt, args.new_tokens))
    same = torch.equal(results["per unit per token"][-1][3], results["once per call"][-1][3])
    if dist.get_rank() == 0:
        whole = sum(b.param_nbytes for b in models["once per call"].engine.buckets)
        print(f"\nLlama {args.layers} x {args.hidden} ({whole / MiB:.1f} MiB of parameters), stage 3, N = "
              f"{dist.get_world_size()}, {args.batch} prompts x {args.new_tokens} new tokens, median of "
              f"{args.rounds}; same tokens: {same}\n")
        print("| gathers | s per generate() | MiB sent per rank | peak gathered MiB |")
        print("|---|---:|---:|---:|")
        for name in modes:
            seconds = statistics.median(r[0] for r in results[name])
            sent, peak = results[name][-1][1], results[name][-1][2]
            print(f"| {name} | {seconds:.3f} | {sent / MiB:.1f} | {peak / MiB:.1f} |")
    dist.barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
