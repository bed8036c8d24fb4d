"""What each simulated rank sends to the store, read from recorded runs (control_plane_record.py).

A recording at N ranks is a list of requests per rank and phase. Keys name ranks
(``.../rank1``, a Gloo group's ``.../cpu//0/1``): a request whose key names a rank
is written as a template over that rank, and a run of requests that repeats for
ranks 0..N-1 (Gloo's rendezvous: ``wait`` and ``get`` of every member's address) as
a loop over the world. :func:`scripts` turns the recordings at N = 2 and N = 3 into
one script per phase and checks that both give the same one (so the pattern
generalises to any N, and nothing in it is guessed); :func:`rank_script` expands a
script for rank r of N.

Announced calls are not fixed sequences (who arrives last, how often a rank polls),
so they are replayed by the two protocols' own logic (:func:`announce_before`,
:func:`announce_after`), each checked here against the recorded requests.

>>> parse_key("0//shardengine/4/calls/position/rank1", rank=1)
('0//shardengine/4/calls/position/rank{me}', 1)
>>> parse_key("0//4//cpu//0/2", rank=0)
('0//4//cpu//0/{j}', 2)
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Optional

_RANK_IN_KEY = re.compile(r"^(.*(?:/rank|//cpu//0/))(\d+)$")
ANNOUNCED = ("state_dict", "full_state_dict", "summon_full_params", "full_optimizer_state_dict",
             "save_checkpoint", "load_checkpoint")


@dataclass(frozen=True)
class Request:
    """One request of a script: ``key`` may hold ``{me}`` (the rank) or ``{j}`` (a loop's rank)."""

    op: str
    key: str
    amount: int  # add: the amount; set/compare_set: the value's bytes


@dataclass(frozen=True)
class Loop:
    """``body`` once for each rank 0..N-1 (``{j}`` in its keys)."""

    body: tuple[Request, ...]


def parse_key(key: str, rank: int) -> tuple[str, Optional[int]]:
    """The key with the rank it names replaced by ``{me}`` (this rank) or ``{j}`` (another), and that rank."""
    found = _RANK_IN_KEY.match(key)
    if found is None:
        return key, None
    named = int(found.group(2))
    return found.group(1) + ("{me}" if named == rank and "cpu//0/" not in key else "{j}"), named


def load_traces(folder: str) -> dict[int, list[dict]]:
    """``world -> [trace of rank 0, rank 1, ...]`` for every ``trace_N<world>_rank<r>.json`` in ``folder``."""
    found: dict[int, dict[int, dict]] = {}
    for name in os.listdir(folder):
        match = re.match(r"trace_N(\d+)_rank(\d+)\.json$", name)
        if match:
            with open(os.path.join(folder, name)) as f:
                found.setdefault(int(match.group(1)), {})[int(match.group(2))] = json.load(f)
    return {world: [ranks[r] for r in sorted(ranks)] for world, ranks in found.items()}


def phase_requests(trace: dict, phase: str) -> list[list]:
    return [r for r in trace["requests"] if r[0] == phase]


def template(requests: list[list], rank: int, world: int) -> list:
    """The script of one rank's requests of one phase (loops over the world folded)."""
    items = []
    for _, op, key, nbytes, *_ in requests:
        fmt, named = parse_key(key, rank)
        items.append((Request(op, fmt, nbytes if op in ("add", "set", "compare_set") else 0), named))
    script, i = [], 0
    while i < len(items):
        loop = _loop_at(items, i, world)
        if loop is not None:
            script.append(loop)
            i += len(loop.body) * world
        else:
            request, named = items[i]
            if named == rank:  # a loop's key, outside a loop: this rank's own (its address)
                request = Request(request.op, request.key.replace("{j}", "{me}"), request.amount)
            script.append(request)
            i += 1
    return script


def _loop_at(items: list, i: int, world: int) -> Optional[Loop]:
    """A body repeated for ranks 0..world-1 starting at ``i``, if there is one."""
    if items[i][1] != 0 or "{j}" not in items[i][0].key:
        return None
    length = 1
    while i + length < len(items) and items[i + length][1] == 0:
        length += 1
    body = [request for request, _ in items[i:i + length]]
    for member in range(world):
        chunk = items[i + member * length:i + (member + 1) * length]
        if [request for request, _ in chunk] != body or any(named != member for _, named in chunk):
            return None
    return Loop(tuple(body))


def scripts(traces: dict[int, list[dict]], phase: str, rank: int = 0) -> list:
    """Rank ``rank``'s script of ``phase``, the same at N = 2 and N = 3 (else ValueError)."""
    found = {world: template(phase_requests(traces[world][rank], phase), rank, world) for world in (2, 3)}
    if _shape(found[2]) != _shape(found[3]):
        raise ValueError(f"{phase}: the recordings at N=2 and N=3 differ beyond the world size:\n"
                         f"{found[2]}\n{found[3]}")
    return found[3]  # values as at N=3 (a Gloo address is a few bytes longer there)


def _shape(script: list) -> list:
    """A script without its values' sizes."""
    return [Loop(tuple(Request(r.op, r.key, 0) for r in item.body)) if isinstance(item, Loop)
            else Request(item.op, item.key, item.amount if item.op == "add" else 0) for item in script]


def per_step(script: list, steps: int) -> list:
    """One step's script out of a phase of ``steps`` equal steps (else ValueError)."""
    size, remainder = divmod(len(script), steps)
    parts = [script[k * size:(k + 1) * size] for k in range(steps)]
    if remainder or any(part != parts[0] for part in parts):
        raise ValueError(f"the recorded steps differ: {script}")
    return parts[0]


def rank_script(script: list, rank: int, world: int, namespace: str) -> list[Request]:
    """``script`` for rank ``rank`` of ``world``, its keys under ``namespace``."""
    expanded = []
    for item in script:
        body, members = (item.body, range(world)) if isinstance(item, Loop) else ((item,), (None,))
        for member in members:
            for request in body:
                key = request.key.replace("{me}", str(rank)).replace("{j}", str(member))
                expanded.append(Request(request.op, f"{namespace}/{key}", request.amount))
    return expanded


def poll_request(traces: dict[int, list[dict]], stage: int) -> Request:
    """What a stalled Gloo wait sends per 0.5 s slice: the stalled step's requests that a step
    does not make (rank 0, which waits for the late rank 1)."""
    trace = traces[2][0]
    in_a_step = {(r[1], r[2]) for r in phase_requests(trace, f"s{stage}/step")}
    polls = [r for r in phase_requests(trace, f"s{stage}/stalled_step") if (r[1], r[2]) not in in_a_step]
    kinds = {(op, parse_key(key, 0)[0], amount) for _, op, key, amount, *_ in polls}
    if len(kinds) != 1 or len(polls) < 2:
        raise ValueError(f"s{stage}: expected one kind of poll in the stalled step, found {kinds}")
    op, key, amount = kinds.pop()
    return Request(op, key, amount)


def announced_ops(traces: dict[int, list[dict]], world: int) -> list[list[str]]:
    """Every rank's recorded ops, per announced call at stage 3 (calls that sent nothing left out:
    before issue 43 checkpoints were not announced)."""
    found = [[r[1] for r in phase_requests(trace, f"s3/{call}")] for trace in traces[world] for call in ANNOUNCED]
    return [ops for ops in found if ops]


def checkpoint_announced(traces: dict[int, list[dict]]) -> bool:
    """Whether a checkpoint save is announced (sends anything to the store) in these recordings."""
    return bool(phase_requests(traces[2][0], "s3/save_checkpoint"))


def announce_after(rank: int, world: int, number: int, last: bool) -> list[str]:
    """The ops of ``CallAgreement.announce`` (step/call_agreement.py) for one rank."""
    return ["set", "compare_set", "add"] + (["set"] if last else []) + ["wait", "multi_get"]


def announce_before(world: int) -> list[str]:
    """The ops of the protocol before issue 43 when every rank has arrived: name, position, then
    one round over the others (position, whether named, the name)."""
    return ["set", "add"] + ["add", "check", "get"] * (world - 1)


def check_announce_models(before: dict[int, list[dict]], after: dict[int, list[dict]]) -> list[str]:
    """The replayed protocols against the recordings; returns what differs (nothing: [])."""
    problems = []
    for world in (2, 3):
        for ops in announced_ops(after, world):
            if ops not in (announce_after(0, world, 1, False), announce_after(0, world, 1, True)):
                problems.append(f"after, N={world}: recorded {ops}")
        for ops in announced_ops(before, world):
            # the last to arrive polls once; earlier ones repeat rounds (and skip the get of ranks
            # not yet named): each recorded sequence is one round or more of the same requests
            least = announce_before(world)
            if ops[:2] != least[:2] or set(ops[2:]) - {"add", "check", "get"} or len(ops) < len(least) - (world - 1):
                problems.append(f"before, N={world}: recorded {ops}")
    return problems
