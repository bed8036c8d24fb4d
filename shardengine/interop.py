"""Weights and checkpoints of other frameworks, in and out (see [Note: the public face] in
``shardengine/public_face.py``).

- DeepSpeed ZeRO checkpoint folders in: ``deepspeed_training_state`` (name-keyed training state)
  then ``load_training_state``; ``python -m shardengine.convert`` turns one into torch DCP.
- torch DCP (the FSDP2 / torchtitan layout) in and out: ``load_dcp_checkpoint``,
  ``save_dcp_checkpoint``.
- A sharded checkpoint as one plain file, with no process group: ``consolidated_state_dict``,
  ``consolidated_optimizer_state_dict`` (``python -m shardengine.consolidate`` on the command line).
- Hugging Face / safetensors weights: ``load_pretrained`` (its ``LoadReport``) and
  ``save_pretrained``, also at ``shardengine``'s top.

The code lives in ``state/interop/``, ``state/consolidate.py`` and ``state/hf/``; this module
is where users import it from. See docs/checkpoints.md and docs/pretrained.md.

>>> from shardengine.interop import consolidated_state_dict, load_dcp_checkpoint
"""

from .state.consolidate import consolidated_optimizer_state_dict, consolidated_state_dict
from .state.hf.pretrained import LoadReport, load_pretrained, save_pretrained
from .state.interop import deepspeed_training_state, load_dcp_checkpoint, load_training_state, save_dcp_checkpoint

__all__ = ["LoadReport", "consolidated_optimizer_state_dict", "consolidated_state_dict", "deepspeed_training_state",
           "load_dcp_checkpoint", "load_pretrained", "load_training_state", "save_dcp_checkpoint", "save_pretrained"]
