"""A rollout process outside the training group: the weights travel over a group of their own.

[Note: the weight group's messages]
The trainer rank that sends (``sender``, rank 0 by default) and the rollout processes form a
:class:`~shardengine.distributed.side_group.SideGroup` (its rank 0 is the sender, the
rollout processes ranks 1..). The trainer streams with ``receivers=[sender]``: the other
trainer ranks only send their own slices to the sender, which holds at most the cap, and
broadcasts each bucket, one message per dtype, as it arrives. Everything the sender says
starts with a small header (a pickled dict, broadcast): ``weights`` (then the buckets, whose
layout the header lists, so a rollout allocates each before it arrives), ``probe`` (token ids
whose log-probs the rollout sends back, for the numerics check), ``object`` (anything small:
prompts, completions, rewards) and ``stop``. The rollout side is the loop of
:class:`RolloutEndpoint`; ``docs/rl.md`` and ``examples/grpo_rollout.py`` show it whole.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Optional

import torch

from ...distributed.side_group import SideGroup
from ...errors import ConfigError
from ..stream import WeightBucket, WeightStream, bucket_layout

WEIGHTS, PROBE, OBJECT, STOP = "weights", "probe", "object", "stop"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class RemoteRollout:
    """The trainer's end of the weight group: a receiver for :class:`~shardengine.rl.sync.WeightSync`.

    Every trainer rank builds it (only ``sender`` joins the group, at ``address``, as its rank 0;
    ``rollouts`` processes join as ranks 1..). ``device``: where the buckets travel (CPU: Gloo).
    """

    tied_once, buffers = False, True

    def __init__(self, address: str, rank: int, rollouts: int = 1, *, sender: int = 0,
                 device: Optional[torch.device] = None, timeout_s: float = 600.0) -> None:
        if not isinstance(rollouts, int) or rollouts < 1:
            raise ConfigError(f"rollouts must be an int >= 1 (rollout processes in the weight group), got {rollouts!r}")
        self.sender, self.is_sender = sender, rank == sender
        self.receivers = [sender]
        self.group = SideGroup.join(address, 0, 1 + rollouts, device=device, timeout_s=timeout_s) \
            if self.is_sender else None

    # -- weights

    def begin(self, stream: WeightStream) -> None:
        if self.group is None:
            return
        layout = [{"names": [(n, _dtype_name(d), o, list(s)) for n, d, o, s in bucket_layout(plan)],
                   "sizes": {_dtype_name(d): numel for (kind, d), numel in plan.sizes.items() if kind == "out"}}
                  for plan in stream.plans]
        self.group.broadcast_object({"kind": WEIGHTS, "buckets": layout})

    def load(self, bucket: WeightBucket) -> None:
        if self.group is None:
            return
        for dtype in sorted(bucket.flat, key=_dtype_name):
            self.group.broadcast(bucket.flat[dtype], src=0)

    def end(self) -> None:
        """Nothing to finish: the rollout loads each bucket as it arrives."""

    # -- numerics and small objects

    def logprobs(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The rollout's log-probs of the probe (on the sender; None elsewhere)."""
        if self.group is None:
            return None
        self.group.broadcast_object({"kind": PROBE, "input_ids": input_ids.cpu(),
                                     "attention_mask": None if attention_mask is None else attention_mask.cpu()})
        answer = torch.empty(input_ids.shape[0], input_ids.shape[1] - 1, dtype=torch.float32, device=self.group.device)
        self.group.broadcast(answer, src=1)
        return answer

    def request(self, payload: Any) -> Any:
        """Send ``payload`` to the rollout processes and return rank 1's reply (on the sender)."""
        if self.group is None:
            raise ConfigError("only the sending trainer rank talks to the rollout; broadcast the reply to the others")
        self.group.broadcast_object({"kind": OBJECT, "payload": payload})
        return self.group.broadcast_object(None, src=1)

    def close(self) -> None:
        """Tell the rollout processes to stop, and leave the group."""
        if self.group is not None:
            self.group.broadcast_object({"kind": STOP})
            self.group.close()


class Message:
    """One message from the trainer, as :meth:`RolloutEndpoint.receive` returns it."""

    def __init__(self, endpoint: "RolloutEndpoint", header: dict) -> None:
        self.endpoint, self.kind = endpoint, header["kind"]
        self.header = header

    @property
    def payload(self) -> Any:
        return self.header.get("payload")

    @property
    def input_ids(self) -> torch.Tensor:
        return self.header["input_ids"]

    @property
    def attention_mask(self) -> Optional[torch.Tensor]:
        return self.header.get("attention_mask")

    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """A ``weights`` message's buckets, each a list of ``(name, tensor)``, received one at a time
        (load each before asking for the next: the next one reuses nothing, but memory is freed)."""
        group = self.endpoint.group
        for bucket in self.header["buckets"]:
            flat = {name: torch.empty(numel, dtype=getattr(torch, name), device=group.device)
                    for name, numel in bucket["sizes"].items()}
            for name in sorted(flat):
                group.broadcast(flat[name], src=0)
            yield [(name, flat[dtype][offset:offset + math.prod(shape)].view(shape))
                   for name, dtype, offset, shape in bucket["names"]]
            del flat

    def reply(self, value: Any) -> None:
        """Answer a ``probe`` (its log-probs, ``(B, T-1)``) or an ``object`` (anything picklable); rank 1 answers."""
        group = self.endpoint.group
        if group.rank != 1:
            return
        if self.kind == PROBE:
            group.broadcast(value.to(device=group.device, dtype=torch.float32).contiguous(), src=1)
        elif self.kind == OBJECT:
            group.broadcast_object(value, src=1)
        else:
            raise ConfigError(f"a {self.kind!r} message takes no reply")


class RolloutEndpoint:
    """The rollout process's end of the weight group (see the module's Note).

    >>> endpoint = RolloutEndpoint.join("127.0.0.1:29555")        # doctest: +SKIP
    >>> while (message := endpoint.receive()).kind != "stop":        # doctest: +SKIP
    ...     if message.kind == "weights":
    ...         for bucket in message.buckets(): receiver.load(bucket)
    ...     elif message.kind == "probe":
    ...         message.reply(token_logprobs(model, message.input_ids, message.attention_mask))
    ...     else:
    ...         message.reply(generate(model, message.payload))
    """

    def __init__(self, group: SideGroup) -> None:
        self.group = group

    @classmethod
    def join(cls, address: str, rank: int = 1, rollouts: int = 1, *, device: Optional[torch.device] = None,
             timeout_s: float = 600.0) -> "RolloutEndpoint":
        return cls(SideGroup.join(address, rank, 1 + rollouts, device=device, timeout_s=timeout_s))

    def receive(self) -> Message:
        """Block for the trainer's next message."""
        return Message(self, self.group.broadcast_object(None, src=0))

    def close(self) -> None:
        self.group.close()
