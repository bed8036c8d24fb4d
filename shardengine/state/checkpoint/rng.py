"""Random number generator states, saved per rank so a resumed run draws the same numbers.

Everything is stored as tensors, lists and ints, so rank files load with
``weights_only=True``.
"""

from __future__ import annotations

import random
import sys

import torch


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": None, "cuda": None}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # lists and ints, so the file loads with weights_only=True
        kind, keys, pos, has_gauss, gauss = numpy.random.get_state()
        state["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuples(state["python"]))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if state.get("numpy") is not None:
        import numpy
        kind, keys, pos, has_gauss, gauss = state["numpy"]
        numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, gauss))


def _as_tuples(value):
    # random.setstate wants tuples; a file round trip may have turned them into lists.
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value

