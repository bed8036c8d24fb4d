"""A module in this process (a colocated rollout model) loaded in place, bucket by bucket.

Each tensor of a bucket is copied into the target's tensor of the same name (cast to its
dtype, moved to its device) and the bucket is let go: the target never holds a second full
copy of the weights, and the stream holds at most its cap (stream.py). Names are the
target's ``state_dict`` keys; a tensor of the stream that the target lacks, or of another
shape, is an error before anything of that bucket is written.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn

from ...errors import StateDictMismatch
from ..numerics import token_logprobs


class ModuleReceiver:
    """Loads streamed buckets into ``module`` in place (see the module's docstring).

    >>> import torch
    >>> target = torch.nn.Linear(2, 2)
    >>> receiver = ModuleReceiver(target)
    >>> receiver.load([("weight", torch.ones(2, 2)), ("bias", torch.zeros(2))])
    >>> receiver.finish(), target.weight.sum().item()
    ([], 4.0)
    """

    receivers, tied_once, buffers = "all", False, True  # each rank loads its own module, every tensor

    def __init__(self, module: nn.Module, strict: bool = True) -> None:
        self.module, self.strict = module, strict
        self.targets = {name: tensor for name, tensor in module.state_dict(keep_vars=True).items()
                        if torch.is_tensor(tensor)}
        self.loaded: set[str] = set()

    def begin(self, stream: object = None) -> None:
        """A new sync starts: every tensor is to be loaded again."""
        self.loaded = set()

    def load(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy one bucket's tensors into the module's (checked first, then written)."""
        items = list(bucket)
        unknown = [name for name, _ in items if name not in self.targets]
        wrong = [f"{name}: {list(t.shape)} streamed, {list(self.targets[name].shape)} in the module"
                 for name, t in items if name in self.targets and t.shape != self.targets[name].shape]
        if (unknown and self.strict) or wrong:
            raise StateDictMismatch("the streamed weights do not match the receiving module (this bucket was not "
                                    f"loaded): unexpected {unknown}; shape mismatch {wrong}")
        with torch.no_grad():
            for name, tensor in items:
                if name in self.targets:
                    self.targets[name].copy_(tensor)
                    self.loaded.add(name)

    def end(self) -> None:
        self.finish()

    def logprobs(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """The module's log-probs of the probe (for the numerics check)."""
        return token_logprobs(self.module, input_ids.to(_device_of(self.module)),
                              None if attention_mask is None else attention_mask.to(_device_of(self.module)))

    def finish(self) -> list[str]:
        """The module's tensors this sync did not write (an error when strict)."""
        missing = sorted(set(self.targets) - self.loaded)
        if missing and self.strict:
            raise StateDictMismatch(f"the stream ended without the module's tensors {missing}")
        return missing


def _device_of(module: nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    return torch.device("cpu")
