"""Convert a DeepSpeed ZeRO-1/2/3 checkpoint, with no process group and without DeepSpeed.

    python -m shardengine.convert DS_CHECKPOINT OUT            # OUT: a torch DCP folder
    python -m shardengine.convert DS_CHECKPOINT OUT.pt         # OUT.pt: one torch.save file
    python -m shardengine.convert DS_CHECKPOINT OUT --tag global_step200

``DS_CHECKPOINT`` is the folder DeepSpeed's ``engine.save_checkpoint`` wrote (its
``latest`` is followed) or one ``global_step*`` folder. ``OUT`` holds
``{"model", "optimizer", "lr_scheduler" (when saved), "step"}``: the fp32 master
weights, the optimizer state per parameter name (Adam's ``exp_avg``,
``exp_avg_sq``, ``step``) and its param groups, torchtitan's layout. A
shardengine run at any world size and stage resumes from it with
``se.interop.load_dcp_checkpoint(OUT, model, optimizer)`` (or
``se.interop.load_training_state(model, optimizer, torch.load(OUT.pt))``); an FSDP2
run with ``dcp.load`` (see docs/checkpoints.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Optional

import torch

from ...distributed.dcp_files import write_dcp
from ...errors import CheckpointError
from .deepspeed_zero import deepspeed_training_state


def convert_deepspeed_checkpoint(checkpoint: str, out: str, tag: Optional[str] = None) -> dict:
    """Write the DeepSpeed checkpoint's training state to ``out`` (``*.pt``: torch.save; else a DCP
    folder) and return it (see :func:`shardengine.interop.deepspeed_training_state`)."""
    state = deepspeed_training_state(checkpoint, tag)
    if out.endswith(".pt"):
        torch.save(state, out)
    else:
        write_dcp(state, out)
    return state


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardengine.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="DeepSpeed checkpoint folder (with 'latest') or a global_step* folder")
    parser.add_argument("out", help="output: a DCP folder, or a file ending in .pt (torch.save)")
    parser.add_argument("--tag", help="the global_step* folder to read instead of the one 'latest' names")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        state = convert_deepspeed_checkpoint(args.checkpoint, args.out, args.tag)
    except CheckpointError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    moments = sorted({key for entry in state["optimizer"]["state"].values() for key in entry})
    print(f"wrote {args.out}: {len(state['model'])} model entries, optimizer state {moments} for "
          f"{len(state['optimizer']['state'])} parameters in {len(state['optimizer']['param_groups'])} "
          f"group(s), step {state['step']}, lr_scheduler {'yes' if 'lr_scheduler' in state else 'none saved'}, "
          f"{time.perf_counter() - started:.2f} s")
    return 0
