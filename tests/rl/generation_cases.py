"""Rank workers of the stage-3 generation tests (``test_generation_gather.py``): a tiny Llama's
``generate()`` gathering per unit per token, and with ``generate_gather_bytes`` once per call."""

from __future__ import annotations

from typing import Optional

import torch

import shardengine as se
from engine_cases import _single_thread
from hf_cases import build

NEW_TOKENS = 6


def generate_and_count(budget: Optional[str]) -> dict:
    """Greedy generation at stage 3: the tokens, the parameter bytes gathered, and the unit sizes."""
    _single_thread()
    net = build("llama", num_hidden_layers=3)
    options = {"generate_gather_bytes": budget} if budget is not None else {}
    model, _ = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=3, **options)
    prompt = torch.randint(3, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    model.reset_comm_stats()
    with torch.no_grad():
        tokens = model.generate(input_ids=prompt, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                                pad_token_id=0)
    stats = model.comm_stats()
    whole = sum(b.param_nbytes for b in model.engine.buckets)
    reference = build("llama", num_hidden_layers=3)
    with torch.no_grad():
        want = reference.generate(input_ids=prompt, max_new_tokens=NEW_TOKENS, do_sample=False,
                                  min_new_tokens=NEW_TOKENS, pad_token_id=0)
    return {"equal": torch.equal(tokens, want), "gathered": stats.bytes_total, "whole": whole,
            "live_after": model.memory_report().comm_buffers,
            "units": sorted(b.param_nbytes for b in model.engine.buckets)}
