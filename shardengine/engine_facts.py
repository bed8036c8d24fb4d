"""The engine's facts the memory estimator reads: the one module it imports from the engine.

[Note: one seam each way] The estimator predicts this engine's bytes and time from the same
pure code the engine runs — how parameters fall into flat buckets (``flat/plan.py``), where a
unit lives (``flat/residency.py``), what a collective sends (``distributed/traffic.py``, the
codecs), how the optimizer steps in groups, which activations a rule keeps — so a change to
the engine's layout changes the prediction with it. It imports those facts from here only
(tests/architecture/test_package_boundaries.py holds it), which keeps the seam to one small
module a reader can take in at once; nothing here calls ``torch.distributed`` or allocates.
The other way, the engine reaches the estimator only through the estimator's public API, in
``auto.py`` (``stage="auto"``) and the ``selfcheck`` tool.

>>> import torch
>>> from shardengine.engine_facts import BucketShape, count_elements
>>> net = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 1))
>>> count_elements(net, world_size=4, shape=BucketShape(per_unit=True)).shard
7
"""
from .activation_rules import (CHECKPOINT_MODES, CheckpointRule, copied_to_host, is_parameter, offloaded_blocks,
                               parse_checkpoint)
from .activations.ledger import ActivationLedger
from .data.proportions import check_proportions, proportional_counts
from .distributed.compression.codecs import payload_bytes
from .distributed.compression.powersgd import plan_powersgd
from .distributed.traffic import bytes_sent, group_by_dtype, uses_in_place_primitives
from .errors import ConfigError
from .flat.layout import FlatLayout
from .flat.plan import BucketShape, UnitCuts, count_elements, find_units, plan_replicated_buckets, plan_unit_buckets
from .flat.residency import (BucketShare, UnitSize, bucket_shares, offloaded_units, resident_bytes_per_element,
                             unit_size)
from .optim.step_groups import STEP_GROUP_BYTES, step_runs
from .policies import Compression, parse_compression
from .step.agreement import vector_bytes

__all__ = [
    # activations: which a checkpointing or offload rule keeps, and their ledger
    "CHECKPOINT_MODES", "CheckpointRule", "parse_checkpoint", "copied_to_host", "is_parameter", "offloaded_blocks",
    "ActivationLedger",
    # the bucket plan and where each unit lives
    "BucketShape", "UnitCuts", "count_elements", "find_units", "plan_replicated_buckets", "plan_unit_buckets",
    "FlatLayout", "BucketShare", "UnitSize", "bucket_shares", "offloaded_units", "resident_bytes_per_element",
    "unit_size",
    # what the collectives send
    "bytes_sent", "group_by_dtype", "uses_in_place_primitives", "payload_bytes", "plan_powersgd", "vector_bytes",
    # the optimizer's step groups
    "STEP_GROUP_BYTES", "step_runs",
    # options and data the estimator validates as the engine does
    "Compression", "parse_compression", "ConfigError", "check_proportions", "proportional_counts",
]
