"""Which device a wrapped module lives on (the engine's buffers and control collectives go there)."""

from __future__ import annotations

import torch
from torch import nn

from ..distributed.launch import current_backend
from ..errors import ConfigError
from ..flat import guard


def device_of(module: nn.Module, allow_meta: bool = False) -> torch.device:
    with guard.engine_access():
        devices = {p.device for p in module.parameters() if not p.is_meta}
        meta = any(p.is_meta for p in module.parameters())
    if len(devices) > 1:
        raise ConfigError(f"the model's parameters are on several devices {sorted(map(str, devices))}; "
                          "move the model to one device first")
    if devices:
        return devices.pop()
    if meta and not allow_meta:
        raise ConfigError("the model is on the meta device; only stage 3 materializes a meta "
                          "model (shard by shard). Build it on a real device or use stage=3")
    return torch.device("cuda", torch.cuda.current_device()) if current_backend() == "nccl" \
        else torch.device("cpu")
