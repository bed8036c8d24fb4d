"""Pre-quantized bitsandbytes folders into a base declared quantized on the meta device.

A folder written by ``save_pretrained`` of a bitsandbytes model holds each quantized
weight's codes under the weight's name and its quantization state beside it (see
[Note: a pre-quantized folder] in flat/quantized.py). ``se.load_pretrained`` then reads
each rank's slice of the codes, as it reads any tensor, instead of quantizing the float
weight, and the whole (small) state; the state's names are claimed here so that strict
loading does not report them as unexpected.
"""

from __future__ import annotations

from torch import nn

from ...errors import CheckpointError
from ...flat.quantized import (attach_stored_state, required_state_parts, source_of as quantized_source,
                               stored_state_names)
from .weight_files import WeightFiles


def find_stored_codes(params: dict[int, nn.Parameter], source_of: dict[int, str],
                      files: WeightFiles) -> dict[int, dict[str, str]]:
    """``id(param) -> its stored state's names`` for quantized weights the checkpoint holds as
    codes (an integer tensor where a float one would be quantized while loading)."""
    return {pid: stored_state_names(params[pid], source, files.tensors) for pid, source in source_of.items()
            if quantized_source(params[pid]) is not None and not files.tensors[source].dtype.is_floating_point}


def dtype_problems(params: dict[int, nn.Parameter], source_of: dict[int, str], files: WeightFiles,
                   stored_codes: dict[int, dict[str, str]], name_of: dict[int, str]) -> list[str]:
    """Stored tensors that would be cast into a weight that cannot hold them: quantized codes into
    a float weight (a base not declared quantized), or codes of another storage dtype."""
    problems = []
    for pid, source in source_of.items():
        param, stored = params[pid], files.tensors[source].dtype
        if pid in stored_codes and stored != param.dtype:
            problems.append(f"{name_of[pid]} (checkpoint codes {stored}, model codes {param.dtype})")
        elif param.dtype.is_floating_point and not stored.is_floating_point:
            problems.append(f"{name_of[pid]} (checkpoint {stored}, model {param.dtype}: the checkpoint is "
                            "quantized; declare the base quantized as it was saved, e.g. with transformers' "
                            "replace_with_bnb_linear(..., quantization_config=...) under torch.device('meta'))")
    return problems


def claimed_names(stored_codes: dict[int, dict[str, str]]) -> set[str]:
    """Every stored name the quantization states are read from."""
    return {name for names in stored_codes.values() for name in names.values()}


def read_stored_state(files: WeightFiles, param: nn.Parameter, source: str, names: dict[str, str]) -> int:
    """Attach ``param``'s stored quantization state, read whole; bytes read."""
    # cloned: a tensor read from a safetensors file views its memory map, which would stay
    # mapped (with every page read from it resident) as long as the state lives
    state = {part: files.read(name, 0, files.tensors[name].numel).reshape(files.tensors[name].shape).clone()
             for part, name in names.items()}
    attach_stored_state(param, source, state)
    return sum(t.numel() * t.element_size() for t in state.values())


def check_state_found(stored_codes: dict[int, dict[str, str]], source_of: dict[int, str],
                      params: dict[int, nn.Parameter]) -> None:
    """Before anything is written: every pre-quantized weight's state is stored beside it."""
    bare = [f"{source_of[pid]} (no {', '.join(p for p in required_state_parts(params[pid]) if p not in names)})"
            for pid, names in stored_codes.items()
            if any(part not in names for part in required_state_parts(params[pid]))]
    if bare:
        raise CheckpointError(f"quantized codes stored without their quantization state: {', '.join(bare[:10])}"
                              + (f" and {len(bare) - 10} more" if len(bare) > 10 else ""))
