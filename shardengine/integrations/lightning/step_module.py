"""The module ``shard()`` wraps under Lightning: one forward per Lightning step.

[Note: why not shard the LightningModule itself]
Lightning routes a step through the wrapper's forward by patching the
LightningModule's ``forward`` to run ``training_step`` (``_ForwardRedirection``),
so the wrapper's hooks run. Inside ``training_step`` the user usually calls
``self(x)``: with the LightningModule as the engine's root that is a second
forward of the root while the first is still open, which the engine rightly
treats as a forward that never finished. ``LightningStep`` is a thin root
above the LightningModule instead: its forward *is* the step
(``step("training_step", batch, batch_idx)``), so the engine sees exactly one
root forward per step (batch weight, stage-3 root gather, backward
bookkeeping on the returned loss), and ``self(x)`` inside it is an ordinary
submodule call. The price is a key prefix: the engine names the parameters
``lightning_module.<name>``; :func:`strip_prefix` / :func:`add_prefix` convert
at every boundary where Lightning sees keys.
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

PREFIX = "lightning_module."


class LightningStep(nn.Module):
    """Root module whose forward runs one named step method of the LightningModule."""

    def __init__(self, lightning_module: nn.Module):
        super().__init__()
        self.lightning_module = lightning_module

    def forward(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.lightning_module, method)(*args, **kwargs)


def strip_prefix(state: Mapping[str, Any]) -> dict[str, Any]:
    """Engine keys (``lightning_module.<name>``) -> the LightningModule's own keys."""
    return {key[len(PREFIX):] if key.startswith(PREFIX) else key: value for key, value in state.items()}


def add_prefix(state: Mapping[str, Any]) -> dict[str, Any]:
    """The LightningModule's keys -> the engine's keys."""
    return {PREFIX + key: value for key, value in state.items()}
