"""What the engine knows about the wrapped module's parameters: names, slots, the trainable set.

:class:`ParamIndex` is rebuilt whenever the plan changes (at wrap and when the
trainable set grows, stages/replan.py); the gradient hook reads its lookups on
every gradient.
"""

from __future__ import annotations

from torch import nn

from ..flat.bucket import FlatBucket


class ParamIndex:
    """Names and lookups of the wrapped module's parameters (see the module docstring).

    >>> import torch
    >>> net = torch.nn.Linear(2, 2)
    >>> index = ParamIndex(net)
    >>> index.name(net.weight), index.contains(net.bias), index.contains(torch.zeros(1))
    ('weight', True, False)
    """

    def __init__(self, module: nn.Module):
        self.module = module
        self.name_of = {id(p): name for name, p in module.named_parameters()}
        self.trainable: list[nn.Parameter] = []       # reduced and stepped, in bucket order
        self.slot_of: dict[int, tuple[FlatBucket, int]] = {}  # id(param) -> (bucket, index in it)
        self.flag_of: dict[int, int] = {}             # id(param) -> its place in ``used_flags``
        self.used_flags = bytearray()                 # which trainable params got a gradient here
        self.held_flags = bytearray()                 # which hold a (zeroed) gradient, see window.py
        self.frozen_at_wrap: list[nn.Parameter] = []  # outside every gradient bucket at the plan
        self.bucket_firsts: list[tuple[FlatBucket, nn.Parameter]] = []  # to notice a cast model

    def name(self, param: nn.Parameter) -> str:
        """The parameter's name in the wrapped module ("?" for one it does not know)."""
        return self.name_of.get(id(param), "?")

    def contains(self, param: object) -> bool:
        """Whether ``param`` is a parameter of the wrapped module."""
        return id(param) in self.name_of

    def index(self, buckets: list[FlatBucket]) -> None:
        """Lookups used on every gradient, and the set trained under this plan."""
        held = {id(p) for p, flag in zip(self.trainable, self.held_flags) if flag}
        self.trainable = [p for b in buckets if b.requires_grad for p in b.params]
        self.slot_of = {id(param): (bucket, index) for bucket in buckets
                        for index, param in enumerate(bucket.params)}
        self.flag_of = {id(p): index for index, p in enumerate(self.trainable)}
        self.held_flags = bytearray(int(id(p) in held) for p in self.trainable)
        self.used_flags = bytearray(self.held_flags)  # planned between windows: see window.end()
        self.frozen_at_wrap = [p for p in self.module.parameters()
                               if id(p) not in self.flag_of and p.numel() > 0]
        self.bucket_firsts = [(b, b.params[0]) for b in buckets]
