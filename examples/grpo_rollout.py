#!/usr/bin/env python3
"""GRPO-style RL with a rollout process outside the training group: sync, generate, train.

    python3 examples/grpo_rollout.py                      # 2 trainer ranks + 1 rollout process
    python3 examples/grpo_rollout.py --iterations 20 --stage 3 --dtype bf16

Starts the trainer under torchrun (``--trainers`` ranks, the policy sharded at ``--stage``) and
one rollout process holding its own copy of the policy in ``--dtype``. Each iteration:

1. **sync**: ``WeightSync(model, RemoteRollout(...))`` streams the trainer's weights in buckets of
   at most ``--bucket-mb``: the trainer ranks send their slices to rank 0, which broadcasts each
   bucket over a weight group of its own (Gloo here; NCCL on GPUs) to the rollout process, which
   loads it in place (``ModuleReceiver``). Then the numerics check: both sides' log-probs on a
   probe batch, the report printed each sync;
2. **generate**: rank 0 sends the prompts; the rollout samples a group of completions per prompt;
3. **train**: the reward counts the target token in each completion; each completion's
   advantage is its reward against its group's (GRPO); every rank takes its share of the
   groups, the loss is -advantage x log-prob of the completion, one optimizer step.

The model is the tests' small GPT (``shardengine.testing.models``); nothing is downloaded.
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

import torch

import shardengine as se
from shardengine.rl import ModuleReceiver, RemoteRollout, RolloutEndpoint, WeightSync, token_logprobs
from shardengine.testing.models import build_gpt

VOCAB, TARGET = 32, 7  # the reward: how often the completion says token 7
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=6)
    p.add_argument("--trainers", type=int, default=2, help="trainer ranks")
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="the rollout model's dtype")
    p.add_argument("--bucket-mb", type=float, default=0.05, help="the sync's memory cap per rank, MiB")
    p.add_argument("--prompts", type=int, default=4, help="prompts per iteration")
    p.add_argument("--group", type=int, default=4, help="completions per prompt (GRPO's group)")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--role", choices=["launch", "trainer", "rollout"], default="launch", help=argparse.SUPPRESS)
    p.add_argument("--address", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def policy() -> torch.nn.Module:
    return build_gpt("tiny", vocab_size=VOCAB, n_embd=32, seq_len=32, seed=0)


def rewards(completions: torch.Tensor) -> torch.Tensor:
    return (completions == TARGET).float().sum(dim=1)


# --------------------------------------------------------------------------- the rollout process


def sample(model: torch.nn.Module, prompts: torch.Tensor, group: int, new_tokens: int, seed: int) -> torch.Tensor:
    """``group`` sampled continuations of each prompt: ``(prompts * group, new_tokens)``."""
    generator = torch.Generator().manual_seed(seed)
    ids = prompts.repeat_interleave(group, dim=0)
    with torch.no_grad():
        for _ in range(new_tokens):
            probs = torch.softmax(model(ids)[:, -1].float(), dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=generator)], dim=1)
    return ids[:, prompts.shape[1]:]


def rollout(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    model = policy().to(DTYPES[args.dtype]).eval()
    receiver = ModuleReceiver(model)
    endpoint = RolloutEndpoint.join(args.address)  # rank 1 of the weight group
    while (message := endpoint.receive()).kind != "stop":
        if message.kind == "weights":
            receiver.begin()
            for bucket in message.buckets():
                receiver.load(bucket)
            receiver.finish()
        elif message.kind == "probe":
            message.reply(token_logprobs(model, message.input_ids, message.attention_mask))
        else:  # the prompts of an iteration
            prompts, seed = message.payload
            message.reply(sample(model, prompts, args.group, args.new_tokens, seed))
    endpoint.close()


# --------------------------------------------------------------------------- the trainer


def train(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    info = se.init_distributed()
    net = policy()
    model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters(), lr=args.lr), stage=args.stage)
    link = RemoteRollout(args.address, info.rank)
    probe = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    sync = WeightSync(model, link, dtype=args.dtype, bucket_bytes=int(args.bucket_mb * 2**20), check_every=1,
                      probe=probe)
    for iteration in range(args.iterations):
        report = sync.sync()
        prompts = torch.randint(0, VOCAB, (args.prompts, 4), generator=torch.Generator().manual_seed(100 + iteration))
        shared = [link.request((prompts, iteration)) if link.is_sender else None]
        dist.broadcast_object_list(shared, src=0)  # the completions, to every trainer rank
        completions = shared[0]
        reward = rewards(completions).view(args.prompts, args.group)
        advantage = ((reward - reward.mean(1, keepdim=True)) / (reward.std(1, keepdim=True) + 1e-4)).view(-1)
        mine = torch.arange(info.rank, args.prompts * args.group, info.world_size)  # this rank's share
        sequences = torch.cat([prompts.repeat_interleave(args.group, 0), completions], dim=1)[mine]
        logits = model(sequences[:, :-1])
        logp = torch.log_softmax(logits.float(), -1).gather(-1, sequences[:, 1:, None]).squeeze(-1)
        completion_logp = logp[:, prompts.shape[1] - 1:].sum(1)
        loss = -(advantage[mine] * completion_logp).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if info.rank == 0:
            print(f"iteration {iteration}: {report}", flush=True)
            print(f"iteration {iteration}: mean reward {reward.mean().item():.3f}, loss {loss.item():.4f}", flush=True)
    link.close()
    if info.rank == 0:
        print(f"done: {args.iterations} iterations; each sync held at most {report.bound_bytes} bytes per rank "
              f"(cap {report.cap})", flush=True)


# --------------------------------------------------------------------------- launching both


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    address = f"127.0.0.1:{free_port()}"
    script = os.path.abspath(__file__)
    env = {"OMP_NUM_THREADS": "1", **os.environ}
    rollout_process = subprocess.Popen([sys.executable, script, *argv, "--role", "rollout", "--address", address],
                                       env=env)
    trainers = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                               f"--nproc_per_node={args.trainers}", "--", script, *argv, "--role", "trainer",
                               "--address", address], env=env)
    if trainers.returncode != 0:
        rollout_process.kill()
    return trainers.returncode or rollout_process.wait(timeout=120)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.role == "rollout":
        rollout(args)
    elif args.role == "trainer":
        train(args)
    else:
        return launch(args, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
