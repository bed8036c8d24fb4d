"""What the pieces outside the stages may use of a stage engine: the :class:`Engine` protocol.

Join, checkpoints, optimizer state dicts, full state dicts, pretrained I/O and
deepcopy (step/join.py, state/, optim/) take an ``engine: Engine`` and use only
the members below; ``ShardedModel.engine`` returns the same view for tests and
tools. tests/architecture/test_engine_interface.py fails if a module outside stages/ or a
test reads an engine's private attribute.

[Note: a typed engine interface]
The stage classes keep many private lookups (``_slot_of``, ``_flag_of``, the
reducer ...) that change whenever a stage changes how it reduces or gathers.
The code outside the stages needs far less: the buckets (the flat layout of
every parameter), parameter names, the trainable set, the communicator, the
config, the counters and a handful of step entry points. Naming exactly those
here lets a stage be rewritten without reading the state, optimizer or join
code, and lets that code be read without the stages: a ``Protocol`` (checked
by shape, not inheritance) costs nothing at run time.

>>> import torch, shardengine as se
>>> net = torch.nn.Linear(2, 2)
>>> model, optimizer = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=1)
>>> engine = model.engine
>>> isinstance(engine, se.engine_api.Engine), engine.stage
(True, 1)
>>> engine.param_name(model.module.weight), len(engine.trainable_params)
('weight', 2)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:  # types only: importing them here would make a cycle with stages/
    from .config import ShardConfig
    from .distributed.compression.collectives import CompressedCollectives
    from .distributed.hybrid import GroupBytes, HybridCommunicator
    from .flat.bucket import FlatBucket
    from .memory import LiveBytes, MemoryReport
    from .step.agreement import ProgressCounters
    from .step.batch_weights import BatchWeights, ForwardWeight
    from .step.call_agreement import CallAgreement
    from .step.join import JoinState
    from .step.mixed_precision import DynamicLossScaler
    from .step.phase import Phase


@runtime_checkable
class Engine(Protocol):
    """One rank's stage engine, as seen from outside stages/ (see the module's Note)."""

    stage: int                              # 0..3: what is sharded
    # What the stage does, as facts (see [Note: how a stage differs] in stages/base.py):
    steps_whole: bool                       # every rank steps whole buckets (stage 0)
    grads_replicated: bool                  # every rank holds the full reduced gradients (stage 0)
    forward_communicates: bool              # every forward gathers parameters (stage 3)
    world: int                              # ranks taking part
    module: nn.Module                       # the user's module, wrapped in place
    comm: "HybridCommunicator"              # every collective goes through it
    config: "ShardConfig"
    buckets: "list[FlatBucket]"             # every bucketed parameter, flat, in order
    optimizer: Optional[torch.optim.Optimizer]
    original_groups: list[list[nn.Parameter]]  # the user's param groups, before rebuilding
    counters: "ProgressCounters"            # forwards, backwards, steps taken
    weights: "BatchWeights"                 # per-micro-step batch weights (step/batch_weights.py)
    join_state: "JoinState"                 # model.join() bookkeeping (step/join.py)
    scaler: "Optional[DynamicLossScaler]"   # fp16 loss scale; None otherwise
    compression: "Optional[CompressedCollectives]"
    live: "LiveBytes"                       # transient bytes, for memory_report()
    sync_enabled: bool                      # False inside no_sync()
    summoned: bool                          # inside summon_full_params()
    whole_tensor_groups: frozenset[int]     # param groups stepped whole (optim/whole_tensor.py)
    pending_groups: list[list[nn.Parameter]]  # add_param_group'd, planned at the next forward
    replans: list                           # what each growth of the plan cost (stages/replan.py)
    calls: "CallAgreement"                  # entry-point agreement for model.state_dict() & co

    # ---- what the engine knows about parameters
    def param_name(self, param: nn.Parameter) -> str:
        """The parameter's name in the wrapped module ("?" for one it does not know)."""

    def is_param(self, param: object) -> bool:
        """Whether ``param`` is a parameter of the wrapped module."""

    @property
    def trainable_params(self) -> list[nn.Parameter]:
        """The parameters the engine reduces and steps (trainable at ``shard()``), in bucket order."""

    @property
    def hook_ids(self) -> set[int]:
        """Ids of the hooks the engine registered on the module (deepcopy drops them from copies)."""

    def remove_hooks(self) -> None:
        """Remove the engine's hooks (lets a benchmark free a model; the engine is unusable after)."""

    @property
    def phase(self) -> "Phase":
        """Where this rank's step is (step/phase.py)."""

    @property
    def rebuilds_optimizer(self) -> bool:
        """Whether the optimizer is rebuilt over flat shards (else the user's steps ``param.grad``)."""

    # ---- step entry points (model.py, step/join.py, optim/sharded_optimizer.py)
    def check_usable(self) -> None: ...
    def fail(self, what: str) -> None: ...
    def forward_failed(self, error: BaseException) -> None: ...
    def sync_device(self) -> torch.device: ...
    def hook_outputs(self, output, record: "Optional[ForwardWeight]" = None) -> None: ...
    def agree_first_reference(self, record: "Optional[ForwardWeight]" = None) -> None: ...
    def finish_gradient_sync(self) -> None: ...
    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer: ...
    def before_step(self) -> None: ...
    def after_step(self) -> None: ...
    def zero_grad(self) -> None: ...
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor: ...
    def broadcast_replicas(self, src: int) -> None: ...
    def note_params_written(self) -> None: ...

    # ---- reports
    def memory_report(self) -> "MemoryReport": ...
    def ring_model_bytes(self, micro_steps: int) -> "GroupBytes": ...
