"""Forward-only sharded models (``se.shard(model, None, stage=s)``): rank workers.

A frozen tiny Llama as the reference of a DPO-style loop: the policy (a second
Llama, every parameter training) and the reference both sharded at stage 3 in
one process; the reference only runs forwards under ``torch.no_grad()``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import shardengine as se
from engine_cases import _single_thread, rel_err
from hf_cases import build, my_rows

PAIRS, SEQ, VOCAB, BETA, LR, STEPS = 6, 8, 64, 0.5, 0.05, 3


def frozen_llama(seed: int):
    net = build("llama", seed=seed)
    net.requires_grad_(False)
    return net.eval()


def pairs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s chosen and rejected sequences (the global batch)."""
    generator = torch.Generator().manual_seed(500 + step)
    return (torch.randint(3, VOCAB, (PAIRS, SEQ), generator=generator),
            torch.randint(3, VOCAB, (PAIRS, SEQ), generator=generator))


def sequence_logp(model, ids: torch.Tensor) -> torch.Tensor:
    """Sum of the log-probabilities of each sequence's next tokens."""
    logits = model(input_ids=ids).logits[:, :-1]
    return torch.gather(F.log_softmax(logits.float(), -1), 2, ids[:, 1:, None]).squeeze(2).sum(1)


def dpo_loss(policy, reference, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        ref_margin = sequence_logp(reference, chosen) - sequence_logp(reference, rejected)
    margin = sequence_logp(policy, chosen) - sequence_logp(policy, rejected)
    return -F.logsigmoid(BETA * (margin - ref_margin)).mean()


def reference_logits(stage: int) -> dict:
    """A frozen model sharded forward-only: its logits, with and without grad mode, and
    what a rank holds between forwards."""
    _single_thread()
    net = frozen_llama(3)
    plain = copy.deepcopy(net)
    model, optimizer = se.shard(net, None, stage=stage)
    ids = pairs(0)[0]
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, plain(input_ids=ids).logits
    graded = model(input_ids=ids).logits  # grad mode on: nothing requires grad, nothing kept
    return {"optimizer": optimizer, "error": rel_err(got, want), "graded_error": rel_err(graded.detach(), want),
            "graded_requires_grad": graded.requires_grad, "held": model.memory_report().params,
            "full": sum(p.numel() * p.element_size() for p in plain.parameters())}


def dpo_loop(stage: int) -> dict:
    """Policy and reference at ``stage`` in one process; the policy after STEPS against one
    process training a copy on the global batch with the unsharded reference."""
    _single_thread()
    policy_net, reference_net = build("llama", seed=3), frozen_llama(3)
    ref_policy, ref_reference = copy.deepcopy(policy_net), copy.deepcopy(reference_net)
    policy, optimizer = se.shard(policy_net, torch.optim.SGD(policy_net.parameters(), lr=LR), stage=stage)
    reference, _ = se.shard(reference_net, None, stage=stage)
    ref_optimizer = torch.optim.SGD(ref_policy.parameters(), lr=LR)
    losses, ref_losses = [], []
    for step in range(STEPS):
        chosen, rejected = pairs(step)
        rows = my_rows()
        loss = dpo_loss(policy, reference, chosen[rows], rejected[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        ref_loss = dpo_loss(ref_policy, ref_reference, chosen, rejected)
        ref_loss.backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        losses.append(loss.item())
        ref_losses.append(ref_loss.item())
    trained, want = policy.full_state_dict(), ref_policy.state_dict()
    start = build("llama", seed=3).state_dict()
    return {"errors": {k: rel_err(trained[k], v) for k, v in want.items()}, "losses": losses,
            "ref_losses": ref_losses, "moved": sum(not torch.equal(want[k], start[k]) for k in want),
            "reference_unchanged": all(torch.equal(v, frozen_llama(3).state_dict()[k])
                                       for k, v in reference.full_state_dict().items())}


def refused_trainable() -> str:
    try:
        se.shard(build("llama"), None, stage=3)
    except se.ConfigError as error:
        return str(error)
    return ""
