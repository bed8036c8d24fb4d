"""What the pieces outside the stages may use of a stage engine: the :class:`Engine` protocol.

Join, checkpoints, optimizer state dicts, full state dicts, pretrained I/O and
deepcopy (step/join.py, state/, optim/) take an ``engine: Engine`` and use only
the members below; ``ShardedModel.engine`` returns the same view for tests and
tools. tests/architecture/test_engine_interface.py fails if a module outside stages/ or a
test reads an engine's private attribute.

[Note: a typed engine interface]
The engine (stages/engine.py) keeps many lookups (the reducer, the parameter
slots, the stage's collaborators) that change whenever a stage changes how it
reduces or gathers. The code outside the stages needs far less: the buckets
(the flat layout of every parameter), the stage's facts, parameter names and
the trainable set, the communicator, the config, the counters, and the step
entry points -- grouped by the collaborator that owns them (``failure``,
``forward``, ``window``, ``stepping``, ``reports``), each seen through a small
protocol below. Nothing outside assigns an engine attribute: what join,
checkpoints and ``add_param_group`` must change goes through named methods
(``counters.catch_up``, ``syncing``, ``summoning``,
``stepping.add_param_group``). Naming exactly those here lets a stage be
rewritten without reading the state, optimizer or join code, and lets that
code be read without the stages: a ``Protocol`` (checked by shape, not
inheritance) costs nothing at run time.

>>> import torch, shardengine as se
>>> net = torch.nn.Linear(2, 2)
>>> model, optimizer = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=1)
>>> engine = model.engine
>>> isinstance(engine, se.engine_api.Engine), engine.spec.stage
(True, 1)
>>> engine.params.name(model.module.weight), len(engine.params.trainable)
('weight', 2)
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Optional, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:  # types only: importing them here would make a cycle with stages/
    from .config import ShardConfig
    from .distributed.compression.collectives import CompressedCollectives
    from .distributed.hybrid import GroupBytes, HybridCommunicator
    from .flat.bucket import FlatBucket
    from .memory import LiveBytes, MemoryReport
    from .stages.spec import StageSpec
    from .step.agreement import ProgressCounters
    from .step.batch_weights import BatchWeights, ForwardWeight
    from .step.call_agreement import CallAgreement
    from .step.join_state import JoinState
    from .step.mixed_precision import DynamicLossScaler


class ParamNames(Protocol):
    """What the engine knows about the wrapped module's parameters (stages/params.py)."""

    @property
    def trainable(self) -> list[nn.Parameter]: ...  # reduced and stepped (trainable at the plan), in bucket order

    def name(self, param: nn.Parameter) -> str:
        """The parameter's name in the wrapped module ("?" for one it does not know)."""

    def contains(self, param: object) -> bool:
        """Whether ``param`` is a parameter of the wrapped module."""


class Failures(Protocol):
    """Stopping for good (stages/failure.py)."""

    def check_usable(self) -> None: ...
    def fail(self, what: str) -> None: ...
    def forward_failed(self, error: BaseException) -> None: ...


class Forwards(Protocol):
    """The root forward's side (stages/forward.py): what model.join() replays."""

    def sync_device(self) -> torch.device: ...
    def hook_outputs(self, output, record: "Optional[ForwardWeight]" = None) -> None: ...
    def agree_first_reference(self, record: "Optional[ForwardWeight]" = None) -> None: ...
    def holding_gathered(self, budget: int) -> "contextlib.AbstractContextManager[None]":
        """Stage 3: forwards without grad inside keep their units gathered, within ``budget`` bytes."""


class Window(Protocol):
    """The gradient window (stages/window.py)."""

    def finish_gradient_sync(self) -> None: ...
    def zero_grad(self, set_to_none: bool = True, by_user: bool = True, everything: bool = True) -> None: ...
    def note_params_written(self) -> None: ...


class Stepping(Protocol):
    """The optimizer's side (stages/stepping.py)."""

    @property
    def rebuilds_optimizer(self) -> bool: ...  # the optimizer steps flat fragments (else the user's, param.grad)
    @property
    def pending_groups(self) -> list[list[nn.Parameter]]: ...  # add_param_group'd, planned at the next forward

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer: ...
    def add_param_group(self, params: list[nn.Parameter]) -> None: ...
    def before_step(self) -> None: ...
    def after_step(self) -> None: ...
    def close_pieces(self) -> None: ...  # a step raised: the pieces' gradients dropped and guarded
    def attach_tier_step(self, optimizer: torch.optim.Optimizer) -> None: ...
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor: ...
    def broadcast_replicas(self, src: int) -> None: ...


class Reports(Protocol):
    """Bytes and memory (stages/reports.py)."""

    def memory_report(self) -> "MemoryReport": ...
    def ring_model_bytes(self, micro_steps: int) -> "GroupBytes": ...


@runtime_checkable
class Engine(Protocol):
    """One rank's stage engine, as seen from outside stages/ (see the module's Note).

    Every member is read-only from outside: a change goes through a named method
    (tests/test_engine_interface.py refuses an assignment to an engine attribute).
    """

    @property
    def spec(self) -> "StageSpec": ...  # what the stage shards, and the facts that follow
    @property
    def module(self) -> "nn.Module": ...  # the user's module, wrapped in place
    @property
    def comm(self) -> "HybridCommunicator": ...  # every collective goes through it
    @property
    def config(self) -> "ShardConfig": ...
    @property
    def buckets(self) -> "list[FlatBucket]": ...  # every bucketed parameter, flat, in order
    @property
    def params(self) -> "ParamNames": ...  # names and the trainable set
    @property
    def optimizer(self) -> "Optional[torch.optim.Optimizer]": ...
    @property
    def original_groups(self) -> "list[list[nn.Parameter]]": ...  # the user's param groups, before rebuilding
    @property
    def counters(self) -> "ProgressCounters": ...  # forwards, backwards, steps taken
    @property
    def weights(self) -> "BatchWeights": ...  # per-micro-step batch weights (step/batch_weights.py)
    @property
    def join_state(self) -> "JoinState": ...  # model.join() bookkeeping (step/join.py)
    @property
    def scaler(self) -> "Optional[DynamicLossScaler]": ...  # fp16 loss scale; None otherwise
    @property
    def compression(self) -> "Optional[CompressedCollectives]": ...
    @property
    def live(self) -> "LiveBytes": ...  # transient bytes, for memory_report()
    @property
    def replans(self) -> "list": ...  # what each growth of the plan cost (stages/replan.py)
    @property
    def calls(self) -> "CallAgreement": ...  # entry-point agreement for model.state_dict() & co
    @property
    def failure(self) -> "Failures": ...
    @property
    def forward(self) -> "Forwards": ...
    @property
    def window(self) -> "Window": ...
    @property
    def stepping(self) -> "Stepping": ...
    @property
    def reports(self) -> "Reports": ...

    @property
    def hook_ids(self) -> set[int]:
        """Ids of the hooks the engine registered on the module (deepcopy drops them from copies)."""

    def remove_hooks(self) -> None:
        """Remove the engine's hooks (lets a benchmark free a model; the engine is unusable after)."""

    def syncing(self, enabled: bool) -> "contextlib.AbstractContextManager[None]":
        """Gradients reduced at each backward, or deferred as under ``no_sync()``, inside."""

    def summoning(self) -> "contextlib.AbstractContextManager[None]":
        """Marks ``summon_full_params()``: a forward inside it is refused."""

