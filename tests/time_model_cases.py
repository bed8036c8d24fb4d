"""Rank workers for the time-model tests (module level, so pool ranks can import them)."""
from __future__ import annotations

import contextlib

import torch

import shardengine as se
from shardengine.models import build_gpt, example_inputs, lm_loss

VOCAB, SEQ = 96, 16


def tiny_gpt() -> torch.nn.Module:
    """Odd-sized buffers (vocab 96, 2 blocks of width 64) so padding shows up in the bytes."""
    return build_gpt("tiny", vocab_size=VOCAB, seq_len=SEQ)


def ring_bytes_of_a_step(stage: int, collectives: str, micro_steps: int) -> dict:
    """One optimizer step of ``micro_steps`` micro-steps: what the engine says it should send
    (``ring_model_bytes``) and what its counters recorded (``comm_stats``)."""
    torch.set_num_threads(1)
    net = tiny_gpt()
    model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters(), lr=1e-3), stage=stage,
                                collectives=collectives)
    model.reset_comm_stats()
    for micro in range(micro_steps):
        idx, targets = example_inputs(2, SEQ, VOCAB, seed=micro)
        with model.no_sync() if micro < micro_steps - 1 else contextlib.nullcontext():
            lm_loss(model(idx), targets).backward()
    optimizer.step()
    optimizer.zero_grad()
    return {"ring_model_bytes": model.ring_model_bytes(micro_steps),
            "counted": model.comm_stats().bytes_total}


def calibrate_on_ranks(argv: list[str]) -> None:
    """``memory-estimator calibrate`` as its ranks run it (the pool's ranks are already launched)."""
    from memory_estimator.calibrate import main

    assert main(argv) == 0
