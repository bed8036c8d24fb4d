"""What every rank must agree on before sharding, as one canonical fingerprint.

Ranks that wrap different models, or the same model with different options,
issue collectives that do not pair up: Gloo aborts the process ("Received
data size doesn't match expected size"), a rank waits out the timeout, or
training is silently wrong (a different learning rate per rank). So
``shard()`` compares, once and before any other process group is created,
a digest of:

* the stage and every option (``ShardConfig`` fields; with ``stage="auto"``
  also ``micro_batch``, ``seq_len``, ``memory_budget_bytes``, ``example_inputs``);
  ``offload_path`` only as given or not, since each rank may pass a directory of its own,
* the optimizer's class and each param group's hyperparameters and members,
* every parameter's and buffer's name, shape, dtype and ``requires_grad``,
* the stage-3 wrap units.

Only when the digests differ are the entries themselves exchanged, to name
what differs and on which ranks.

Entries are ``(what, value)`` pairs of strings. A value is a canonical text
that is equal in every process for equal settings: floats by ``repr``,
classes and functions by qualified name, never a ``repr`` that holds a memory
address.

>>> canonical({"lr": 1e-3, "betas": (0.9, 0.95)})
"{'betas': (0.9, 0.95), 'lr': 0.001}"
>>> canonical(torch.optim.AdamW)
'torch.optim.adamw.AdamW'
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import fields, is_dataclass
from typing import Any, Optional, Union

import torch
from torch import nn

from ..errors import ConfigError
from ..config import ShardConfig
from ..flat.units import find_units

Entries = list[tuple[str, str]]
_SMALL_TENSOR = 64  # hyperparameter tensors (a tensor lr) are compared by value up to this size


def _given(path: Any) -> str:
    return "None" if path is None else "a directory of each rank's own"


# Options whose value is each rank's own, compared by what must agree rather than by value.
# ``offload_path``: a rank's scratch directory is local (a node's NVMe drive; DeepSpeed's
# ``nvme_path`` is per node), and each rank's files are its own, made and unlinked by it alone
# (offload/file_tensors.py), so the directories may differ; what must agree is the tier, which
# ``offload_optimizer`` and ``offload_params`` already compare. ``measure_activations``: counting
# what a rank's forwards keep is that rank's own bookkeeping (no collective reads it), so a run
# may measure on rank 0 alone.
_RANK_LOCAL_OPTIONS = {"offload_path": _given, "measure_activations": lambda _value: "each rank's own"}


def canonical(value: Any) -> str:
    """A text for ``value`` that is the same in every process when the values are equal."""
    if value is None or isinstance(value, (bool, int, float, complex, str, bytes)):
        return repr(value)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, torch.Tensor):
        if value.numel() <= _SMALL_TENSOR and not value.is_meta:
            return f"tensor({value.tolist()}, {value.dtype})"
        return f"tensor(shape {tuple(value.shape)}, {value.dtype})"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(canonical(item) for item in value)
        return f"[{inner}]" if isinstance(value, list) else f"({inner}{',' if len(value) == 1 else ''})"
    if is_dataclass(value) and not isinstance(value, type):  # options like Compression: by field
        return f"{type(value).__qualname__}" + canonical({f.name: getattr(value, f.name) for f in fields(value)})
    if isinstance(value, dict):
        items = sorted((canonical(k), canonical(v)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, functools.partial):
        return (f"partial({canonical(value.func)}, {canonical(list(value.args))}, "
                f"{canonical(dict(value.keywords))})")
    if isinstance(value, type) or callable(value) and hasattr(value, "__qualname__"):
        return f"{getattr(value, '__module__', '?')}.{value.__qualname__}"
    kind = type(value)  # an object: its class is all that compares across processes
    return f"<{kind.__module__}.{kind.__qualname__} object>"


def fingerprint(model: nn.Module, optimizer: torch.optim.Optimizer, cfg: ShardConfig,
                stage: Union[int, str], auto_inputs: Optional[dict[str, Any]] = None,
                wrap_units: bool = False) -> Entries:
    """Everything about this rank's ``shard()`` call that must be the same on every rank;
    ``wrap_units``: the plan may cut the model into wrap units (stage 3, or ``"auto"``, which
    may pick it), so they must agree too."""
    entries = [("stage", canonical(stage))]
    entries += [(f"option {name}", _RANK_LOCAL_OPTIONS.get(name, canonical)(value))
                for name, value in cfg.options().items()]
    entries += [(f"option {name}", canonical(value)) for name, value in (auto_inputs or {}).items()]
    entries += _optimizer_entries(model, optimizer)
    entries += [(f"parameter {name}", f"shape {tuple(p.shape)}, {p.dtype}, requires_grad={p.requires_grad}")
                for name, p in model.named_parameters(remove_duplicate=False)]
    entries += [(f"buffer {name}", f"shape {tuple(b.shape)}, {b.dtype}") for name, b in model.named_buffers()]
    if wrap_units:
        units = find_units(model, cfg.wrap, cfg.wrap_min_params)
        entries.append(("stage-3 wrap units", ", ".join(name for _, name, _ in units)))
    return entries


def _optimizer_entries(model: nn.Module, optimizer: torch.optim.Optimizer) -> Entries:
    names: dict[int, str] = {}
    for name, param in model.named_parameters():
        names.setdefault(id(param), name)
    members = getattr(optimizer, "optimizers", None)  # an OptimizerList: its members' classes
    entries = [("optimizer class", canonical(type(optimizer)) if members is None
                else canonical([type(member) for member in members]))]
    for index, group in enumerate(optimizer.param_groups):
        where = f"optimizer param group {index}"
        entries += [(f"{where} {key}", canonical(value))
                    for key, value in sorted(group.items()) if key != "params"]
        entries.append((f"{where} params", ", ".join(names.get(id(p), "?") for p in group["params"])))
    return entries


def digest(entries: Entries) -> bytes:
    """32 bytes that differ when any entry does."""
    text = "\n".join(f"{what}\t{value}" for what, value in entries)
    return hashlib.sha256(text.encode()).digest()


def disagreement(per_rank: list[Union[Entries, str]], shown: int = 3) -> ConfigError:
    """A ConfigError naming what differs between ranks (an entry per rank, or its error text)."""
    failed = {rank: text for rank, text in enumerate(per_rank) if isinstance(text, str)}
    if failed:
        detail = "; ".join(f"rank {rank}: {text}" for rank, text in failed.items())
        return ConfigError(f"shard() failed on rank(s) {sorted(failed)}, so no rank can go on ({detail})")
    tables = [dict(entries) for entries in per_rank]
    keys = list(dict.fromkeys(what for table in tables for what in table))
    differing = [what for what in keys if len({table.get(what) for table in tables}) > 1]
    lines = [f"{what}: {_who_has(what, tables)}" for what in differing[:shown]]
    more = f"; and {len(differing) - shown} more" if len(differing) > shown else ""
    return ConfigError("ranks called shard() differently: " + "; ".join(lines) + more + ". Every rank "
                       "must wrap the same model with the same optimizer and options, else their "
                       "collectives do not pair up or they train different models.")


def _who_has(what: str, tables: list[dict[str, str]]) -> str:
    by_value: dict[str, list[int]] = {}
    for rank, table in enumerate(tables):
        by_value.setdefault(table.get(what, "(nothing)"), []).append(rank)
    return ", ".join(f"rank {ranks[0]} has {value}" if len(ranks) == 1 else f"ranks {ranks} have {value}"
                     for value, ranks in by_value.items())
