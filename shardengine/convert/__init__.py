"""The ``python -m shardengine.convert`` command (see ``__main__``); the code is in ``state/interop/convert.py``."""

from ..state.interop.convert import convert_deepspeed_checkpoint, main

__all__ = ["convert_deepspeed_checkpoint", "main"]
