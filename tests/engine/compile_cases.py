"""Rank workers for ``torch.compile`` on sharded models (tests/engine/test_compile.py).

Each worker compiles the wrapped model (or its blocks before ``shard()``, torchtitan's
order), trains a few steps next to an eager single-process reference on the global
batch (see engine_cases' [Note: the reference]) and reports the differences and
dynamo's graph-break count.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import shardengine as se
from engine_cases import _single_thread, base_spec_for, batch, build_model, compare_to_reference, rank_world


def _graphs() -> int:
    """Graphs dynamo compiled so far (a forward split by k graph breaks runs k + 1)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def train_compiled(spec: dict) -> dict:
    """spec: engine_cases' model spec plus stage, backend, order ("wrapped" | "blocks_first")."""
    _single_thread()
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    rank, world = rank_world()
    torch.manual_seed(spec["seed"])
    net = build_model(spec)
    ref = copy.deepcopy(net)
    backend = spec["backend"]
    if spec.get("order") == "blocks_first":
        for block in net.blocks:
            block.compile(backend=backend)
    model, optimizer = se.shard(net, torch.optim.Adam(net.parameters(), lr=1e-2), stage=spec["stage"],
                                **spec.get("options", {}))
    run = model if spec.get("order") == "blocks_first" else torch.compile(model, backend=backend)
    ref_optimizer = torch.optim.Adam(ref.parameters(), lr=1e-2)
    b = spec["per_rank_batch"]
    norms, ref_norms, graphs = [], [], []
    for step in range(spec["steps"]):
        ids, targets = batch(spec, step, 0, world)
        mine = slice(rank * b, (rank + 1) * b)
        F.cross_entropy(run(ids[mine]), targets[mine]).backward()
        F.cross_entropy(ref(ids), targets).backward()
        norms.append(float(model.clip_grad_norm_(1.0)))
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
        graphs.append(_graphs())
    result = compare_to_reference(model, ref, norms, ref_norms)
    result["graphs"] = graphs  # cumulative after each step: constant = no recompilation
    return result


def compile_spec(**overrides) -> dict:
    spec = base_spec_for(steps=3, hidden=[5, 3], backend="aot_eager")
    spec.update(overrides)
    return spec
