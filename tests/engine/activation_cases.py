"""Workers for test_activations.py: the same sharded run with and without an activation policy.

The reference of an activation policy is the engine's own run without it, at the same stage and
options: checkpointing recomputes the same kernels on the same inputs and offload copies bytes,
so the two must agree exactly (tolerance 1e-6 for reduction order in bf16 casts).
"""

from __future__ import annotations

import contextlib

import torch

import shardengine as se
from engine_cases import _single_thread, rank_world, rel_err
from shardengine.testing.models import build_gpt, lm_loss

VOCAB, SEQ = 64, 32


def _batch(step: int, micro: int, world: int, per_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1_000 + 31 * step + micro)
    tokens = torch.randint(VOCAB, (per_rank * world, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _train(spec: dict, policy: dict) -> dict:
    rank, world = rank_world()
    net = build_gpt("tiny", vocab_size=VOCAB, seq_len=SEQ, seed=0, n_layer=spec.get("layers", 4))
    if spec.get("lora"):
        for name, param in net.named_parameters():
            param.requires_grad_("mlp" in name or "lm_head" in name)
    options = dict(spec.get("options", {}))
    model, optimizer = se.shard(net, torch.optim.AdamW((p for p in net.parameters() if p.requires_grad), lr=1e-2),
                                stage=spec["stage"], **options, **policy)
    run = model
    if spec.get("compile"):
        torch._dynamo.reset()
        run = torch.compile(model, backend=spec["compile"])
    micro_steps, per_rank = spec.get("micro_steps", 1), 2
    losses, peaks = [], []
    for step in range(spec.get("steps", 2)):
        for micro in range(micro_steps):
            ids, targets = _batch(step, micro, world, per_rank)
            mine = slice(rank * per_rank, (rank + 1) * per_rank)
            last = micro == micro_steps - 1
            with (contextlib.nullcontext() if last else model.no_sync()):
                loss = lm_loss(run(ids[mine]), targets[mine]) / micro_steps
                loss.backward()
            losses.append(float(loss.detach()))
        report = model.memory_report()
        peaks.append({k: getattr(report, k) for k in ("activations", "peak_activations", "host_activations",
                                                       "peak_host_activations")})
        optimizer.step()  # with step_in_backward the step already ran: this completes it
        optimizer.zero_grad()
    state = {k: v.float() for k, v in model.full_state_dict().items()}
    return {"state": state, "losses": losses, "reports": peaks}


def train_with_and_without(spec: dict) -> dict:
    """The run without a policy (measured: ``measure_activations=True``), then with
    ``spec['policy']``: their differences and byte reports."""
    _single_thread()
    plain = _train(spec, {"measure_activations": True})
    policed = _train(spec, spec["policy"])
    errors = {key: rel_err(policed["state"][key], plain["state"][key]) for key in plain["state"]}
    return {"errors": errors, "losses": (plain["losses"], policed["losses"]),
            "reports": (plain["reports"], policed["reports"])}


def misuse(spec: dict) -> str:
    """The error text of ``spec['case']``, or '' when nothing was raised."""
    _single_thread()
    net = build_gpt("tiny", vocab_size=VOCAB, seq_len=SEQ, seed=0)
    try:
        if spec["case"] == "hf_self_checkpointing":
            net.blocks[0].gradient_checkpointing = True
            se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=spec["stage"],
                     activation_checkpointing="full")
        elif spec["case"] == "user_checkpoint_around_a_block":
            from torch.utils.checkpoint import checkpoint
            model, _ = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=spec["stage"],
                                activation_checkpointing="full")
            ids, targets = _batch(0, 0, 1, 2)
            checkpoint(lambda x: lm_loss(model(x), targets), ids, use_reentrant=False).backward()
        elif spec["case"] == "no_blocks":
            mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
            se.shard(mlp, torch.optim.SGD(mlp.parameters(), lr=0.1), stage=spec["stage"],
                     activation_checkpointing="full")
    except se.ConfigError as error:
        return str(error)
    return ""


ESTIMATE_POLICIES = [(policy, offload) for policy in ("none", "full", "every-k:2", "selective:mm", "selective:mm/2")
                     for offload in (False, True)]


def estimated_and_measured(spec: dict) -> list[dict]:
    """Per (policy, offload): the estimator's traced activation peak and host bytes (one trace of
    the meta model, priced per policy) beside what the engine's ledger measured in one step."""
    from memory_estimator.model.module import traced_activations
    from shardengine.flat.plan import find_units
    from shardengine.testing.models import example_inputs

    _single_thread()
    batch, seq = 2, 128
    with torch.device("meta"):
        meta = build_gpt("tiny", vocab_size=VOCAB, seq_len=seq, n_layer=4)
    traced = traced_activations(meta, lambda b, s: example_inputs(b, s, vocab_size=VOCAB), batch, seq,
                                torch.float32, find_units=lambda m: [u for u, _, _ in find_units(m, None, None)[:-1]],
                                device="cpu")
    rows = []
    for policy, offload in ESTIMATE_POLICIES:
        profile = traced.profile(policy, offload, batch)
        net = build_gpt("tiny", vocab_size=VOCAB, seq_len=seq, n_layer=4)
        model, _ = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=spec["stage"],
                            activation_checkpointing=policy, activation_offload=offload, measure_activations=True)
        ids, targets = example_inputs(batch, seq, vocab_size=VOCAB)
        lm_loss(model(ids), targets).backward()
        report = model.memory_report()
        rows.append({"policy": policy, "offload": offload, "estimated": profile.peak, "estimated_host": profile.host,
                     "measured": report.peak_activations, "measured_host": report.peak_host_activations})
    return rows


def raised_forward_then_another_model(spec: dict) -> dict:
    """A forward that raises (an out-of-vocabulary id), then another model's training step: its
    activations are measured by its own ledger, and the first model's ledger took nothing of it."""
    _single_thread()
    first = build_gpt("tiny", vocab_size=VOCAB, seq_len=SEQ, seed=0)
    model, _ = se.shard(first, torch.optim.SGD(first.parameters(), lr=0.1), stage=spec["stage"], **spec["policy"])
    try:
        model(torch.full((2, SEQ), VOCAB + 1))
        raised = False
    except Exception:  # noqa: BLE001 - the embedding's IndexError (or a collective's error wrapping it)
        raised = True
    second = build_gpt("tiny", vocab_size=VOCAB, seq_len=SEQ, seed=1)
    other, _ = se.shard(second, torch.optim.SGD(second.parameters(), lr=0.1), stage=spec["stage"], **spec["policy"])
    ids, targets = _batch(0, 0, 1, 2)
    lm_loss(other(ids), targets).backward()
    return {"raised": raised, "other": other.memory_report().peak_activations,
            "first": model.memory_report().activations}


def measured_and_unmeasured(spec: dict) -> dict:
    """The same two steps without a policy, unmeasured (the default) and with
    ``measure_activations=True``: the saved-tensor hooks a block's forward runs under, the
    reports, and the trained parameters' differences (counting must change no number)."""
    _single_thread()
    runs = {}
    for name, options in (("unmeasured", {}), ("measured", {"measure_activations": True})):
        rank, world = rank_world()
        net = build_gpt("tiny", vocab_size=VOCAB, seq_len=SEQ, seed=0)
        hooks_seen = []
        net.blocks[1].register_forward_pre_hook(
            lambda module, args: hooks_seen.append(torch._C._autograd._top_saved_tensors_default_hooks(False)
                                                   is not None))
        model, optimizer = se.shard(net, torch.optim.AdamW(net.parameters(), lr=1e-2), stage=spec["stage"],
                                    **options)
        reports = []
        for step in range(2):
            ids, targets = _batch(step, 0, world, 2)
            mine = slice(rank * 2, (rank + 1) * 2)
            lm_loss(model(ids[mine]), targets[mine]).backward()
            optimizer.step()
            optimizer.zero_grad()
            reports.append(model.memory_report())
        runs[name] = {"hooks_seen": hooks_seen, "report": reports[-1].as_dict(), "text": str(reports[-1]),
                      "state": {k: v.float() for k, v in model.full_state_dict().items()}}
    plain, measured = runs["unmeasured"], runs["measured"]
    return {"errors": {k: rel_err(measured["state"][k], plain["state"][k]) for k in plain["state"]},
            **{name: {k: v for k, v in run.items() if k != "state"} for name, run in runs.items()}}
