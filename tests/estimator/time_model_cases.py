"""Rank workers for the time-model tests (module level, so pool ranks can import them)."""
from __future__ import annotations

import contextlib

import torch

import shardengine as se
from shardengine.testing.models import build_gpt, example_inputs, lm_loss

VOCAB, SEQ = 96, 16


def tiny_gpt() -> torch.nn.Module:
    """Odd-sized buffers (vocab 96, 2 blocks of width 64) so padding shows up in the bytes."""
    return build_gpt("tiny", vocab_size=VOCAB, seq_len=SEQ)


def ring_bytes_of_a_step(stage: int, collectives: str, micro_steps: int, shard_group_size=None,
                         compression=None, reshard_after_forward: bool = True) -> dict:
    """One optimizer step of ``micro_steps`` micro-steps: what the engine says it should send
    (``ring_model_bytes``) and what its counters recorded (``comm_stats``), also per group."""
    torch.set_num_threads(1)
    net = tiny_gpt()
    model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters(), lr=1e-3), stage=stage,
                                collectives=collectives, shard_group_size=shard_group_size,
                                compression=compression, reshard_after_forward=reshard_after_forward)
    for step in range(2):  # the second is counted: the first also agrees on the batch weights
        model.reset_comm_stats()
        for micro in range(micro_steps):
            idx, targets = example_inputs(2, SEQ, VOCAB, seed=micro + 10 * step)
            with model.no_sync() if micro < micro_steps - 1 else contextlib.nullcontext():
                lm_loss(model(idx), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    stats = model.comm_stats()
    return {"ring_model_bytes": model.ring_model_bytes(micro_steps), "counted": stats.bytes_total,
            "by_group": {name: group.bytes_total for name, group in stats.by_group.items()}}


def calibrate_on_ranks(argv: list[str]) -> None:
    """``memory-estimator calibrate`` as its ranks run it (the pool's ranks are already launched)."""
    from memory_estimator.measure.calibrate import main

    assert main(argv) == 0
