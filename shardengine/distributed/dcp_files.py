"""torch.distributed.checkpoint (DCP) folders read and written whole by one process.

DCP is torch.distributed's checkpoint format (``.metadata`` + ``__<rank>_0.distcp``
files); only this package calls torch.distributed, so its file I/O lives here.

[Note: one process reads or writes the whole DCP folder]
shardengine's ranks hold flat shards that do not line up with DCP's per-parameter
chunks, so a load reads every full tensor (``no_dist=True``: no collective, each rank
independently; the sharded model then keeps its slices) and an export writes full
tensors from rank 0. DCP's own planners reshard on FSDP2's side: an FSDP2 model at any
world size loads the folder. The cost is the full state in one process's memory, as a
full state dict has.

[Note: DCP imported on use]
``torch.distributed.checkpoint`` pulls in DTensor and its op tables: 1.6 s of every
``import shardengine`` (torch itself is 2 s), paid by every rank of every launch. Only a
DCP export or import needs it, so it is imported there.
"""

from __future__ import annotations

import os
import warnings

from ..errors import CheckpointError

METADATA_FILE = ".metadata"


def is_dcp_folder(path: str) -> bool:
    return os.path.isfile(os.path.join(path, METADATA_FILE))


def read_dcp(path: str) -> dict:
    """Every entry of the DCP folder ``path``, as the nested dict that was saved (full tensors)."""
    if not is_dcp_folder(path):
        raise CheckpointError(f"{path}: not a torch.distributed.checkpoint folder (no {METADATA_FILE} file)")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    try:
        # The planner that builds the state dict from the metadata, called as torch's dcp_to_torch_save
        # does: dcp.load() would hand back only the keys its argument already had (none).
        _load_state_dict(state, storage_reader=dcp.FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)
    except Exception as error:  # noqa: BLE001 - reported with the folder
        raise CheckpointError(f"{path}: could not read the DCP checkpoint ({type(error).__name__}: {error})") from error
    return state


def write_dcp(state: dict, path: str) -> None:
    """Write ``state`` (nested dicts of tensors and plain values) as the DCP folder ``path``."""
    import torch.distributed.checkpoint as dcp

    os.makedirs(path, exist_ok=True)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*single process")
            dcp.save(state, checkpoint_id=path, no_dist=True)
    except Exception as error:  # noqa: BLE001 - reported with the folder
        raise CheckpointError(f"{path}: could not write the DCP checkpoint ({type(error).__name__}: {error})") from error
