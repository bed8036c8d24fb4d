"""``shard()``: the public entry point, and the ``ShardedModel`` it returns.

Also published here (see [Note: the public face] in ``shardengine/public_face.py``): the two
calls around a model's life under ``shard()``, ``meta_parameters`` (build it with parameters on
the meta device, materialized unit by unit at stage 3) and ``register_forward_method`` (run the
engine's hooks around a method other than ``forward``).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import replace
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch import nn

from torch.nn.modules.module import _IncompatibleKeys

from .state import full_state
from .step import join
from .optim import state_dict as optim_state
from .auto import AutoChoice, choose_plan
from .distributed.traffic import CommStats
from .distributed.communicator import Communicator
from .distributed.launch import (all_gather_bytes_default_group, all_gather_object_default_group, local_world_size,
                                 world_size)
from .engine_api import Engine
from .errors import ConfigError
from .config import ShardConfig, check_shard_arguments, resolve_shard_group_size
from .policies import DISK, parse_bytes, parse_compression
from .state.fingerprint import digest, disagreement, fingerprint
from .state.copying import copy_module
from .distributed.hybrid import HybridCommunicator
from .model_reports import ModelReports
from .optim.rebuild import OptimizerArg, group_index_of, resolve_optimizer
from .optim.optimizer_list import OptimizerList
from .optim.whole_tensor import whole_tensor_groups
from .stages.engine import StageEngine
from .stages.forward_methods import register_forward_method
from .flat.meta_init import meta_parameters
from .flat.quantized import prepare_quantized
from .stages.in_backward import refuse
from .stages.recipes import STAGES
from .rl.stream import WeightStream
_WRAPPED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # modules shard() wrapped (not their copies)



class ShardedModel(ModelReports, nn.Module):
    """The user's module, data-parallel and sharded at ``stage``.

    Call it like the module; ``loss.backward()`` needs no engine call.
    Attributes it does not define come from the wrapped module (``model.config``,
    ``model.generate``, ``model.device``). ``state_dict()`` / ``load_state_dict()``
    use the unwrapped module's keys and full values. Between steps at stage 3 a
    parameter holds only this rank's slice: reading it raises an error naming
    :meth:`summon_full_params`; see docs/torch-compatibility.md.
    """

    def __init__(self, module: nn.Module, engine: StageEngine):
        super().__init__()
        self.module = module
        self._engine = engine
        # stage="auto"'s choice (shardengine.auto.AutoChoice): the options applied, and the micro-batch
        # and accumulation the training loop must run; None when the stage was given
        self.auto_plan: Optional[AutoChoice] = None
        self._stats_mark = CommStats()  # step_stats() reports traffic since this snapshot
        self._skipped_mark = 0          # ... and fp16 steps skipped since this count

    @property
    def engine(self) -> Engine:
        """This rank's stage engine, through its typed interface (see engine_api.py): the
        buckets, parameter names, communicator, counters and step entry points."""
        return self._engine

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.module(*args, **kwargs)
        except BaseException as error:
            self._engine.failure.forward_failed(error)
            raise

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "module" not in modules:
                raise
            return getattr(modules["module"], name)

    # ------------------------------------------------------------------ torch.nn.Module idioms

    def state_dict(self, *args: Any, destination=None, prefix: str = "", keep_vars: bool = False) -> dict:
        """Full values under the unwrapped module's keys (fp32 masters under mixed precision).

        Collective at stage 3 and with mixed precision at stages 1-2: every rank calls
        it. Loads into the unwrapped module; ``torch.save``/``torch.load`` round-trip it.
        """
        if args:
            raise TypeError("state_dict() takes keyword arguments only (destination=, prefix=, keep_vars=)")
        self._announce("model.state_dict()", full_state.gathers(self._engine))
        state = full_state.full_state_dict(self._engine)
        out = destination if destination is not None else {}
        out.update({prefix + key: value for key, value in state.items()})
        return out

    def load_state_dict(self, state_dict: dict, strict: bool = True, assign: bool = False):
        """Load full tensors keyed like the unwrapped module (as :meth:`state_dict` returns)."""
        if assign:
            raise ConfigError("load_state_dict(assign=True) would replace the parameters the engine "
                              "shards; load values with assign=False")
        missing, unexpected = full_state.load_full_state_dict(self._engine, state_dict, strict)
        return _IncompatibleKeys(missing, unexpected)

    def _apply(self, fn, recurse: bool = True):
        raise ConfigError("moving or casting a sharded model (.to(), .cuda(), .half(), .double(), "
                          "...) after shard() is not supported: the engine owns flat buffers of the "
                          "parameters in their current dtype and device. Move or cast the model "
                          "before shard(); for mixed precision pass param_dtype='bf16'.")

    def to(self, *args: Any, **kwargs: Any) -> "ShardedModel":
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        engine = self._engine
        current = next((b.full_param for b in engine.buckets), None)
        same_device = device is None or current is None or torch.device(device) == current.device or (
            torch.device(device).type == current.device.type and torch.device(device).index is None)
        if same_device and (dtype is None or current is None or dtype == current.dtype):
            return self
        return self._apply(None)

    # A move or cast to where the model already is changes nothing, as on a plain module (eval
    # code calls model.cpu() or model.float() on habit); any other goes through _apply: refused.
    def float(self) -> "ShardedModel":
        return self.to(torch.float32)

    def double(self) -> "ShardedModel":
        return self.to(torch.float64)

    def half(self) -> "ShardedModel":
        return self.to(torch.float16)

    def bfloat16(self) -> "ShardedModel":
        return self.to(torch.bfloat16)

    def cpu(self) -> "ShardedModel":
        return self.to("cpu")

    def cuda(self, device: Union[int, torch.device, None] = None) -> "ShardedModel":
        return self.to(torch.device("cuda", device) if isinstance(device, int) else (device or "cuda"))

    def __deepcopy__(self, memo: dict) -> nn.Module:
        """A plain (unwrapped, unsharded) copy of the module, e.g. for an EMA.

        At stage 3 this rank holds only slices: copy inside ``summon_full_params()``.
        """
        return copy_module(self._engine, self.module, memo)

    def __reduce_ex__(self, protocol):
        raise TypeError("a ShardedModel cannot be pickled (it holds process groups); save "
                        "model.state_dict(), or use se.save_checkpoint()")

    def save_pretrained(self, save_directory: str, **kwargs: Any) -> None:
        """Write the Hugging Face folder (as :func:`shardengine.save_pretrained`); collective.

        For a PEFT model: the adapter only, written by peft's own ``save_pretrained``
        (only the adapter parameters are gathered). ``max_shard_size=`` and ``dtype=``
        are honoured; arguments the engine cannot honour (``push_to_hub=True``,
        ``state_dict=``, ...) raise :class:`ConfigError`. See docs/finetuning.md.

        >>> model.save_pretrained("finetuned/")                       # doctest: +SKIP
        """
        from .state.hf.save_method import save_pretrained_method

        save_pretrained_method(self, self.module, save_directory, kwargs)

    def summon_full_params(self, writeback: bool = True, with_grads: bool = False):
        """Context manager: every parameter holds its full value inside it (collective).

        Values are the fp32 masters under mixed precision; with ``with_grads`` each
        ``p.grad`` is the full averaged gradient of the current window. With
        ``writeback`` changes are written back to this rank's shards on exit.
        Like FSDP's ``summon_full_params``: the whole model is materialized at once.
        """
        self._announce("model.summon_full_params()", full_state.gathers(self._engine) or with_grads)
        return full_state.summon_full_params(self._engine, writeback, with_grads)

    def full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer,
                                  rank0_only: bool = False) -> Union[dict, list[dict]]:
        """The optimizer state as a plain torch optimizer over ``model.module.parameters()``
        would hold it (keyed by position in the param groups given to ``shard()``); collective.
        For an :class:`OptimizerList`: a list, one such state dict per optimizer."""
        self._check_optimizer(optimizer)
        self._announce("model.full_optimizer_state_dict()", self._engine.stepping.rebuilds_optimizer)
        full = optim_state.full_optimizer_state_dict(self._engine, rank0_only)
        if isinstance(optimizer, OptimizerList):
            return optimizer.split_state_dict(full) if full else [{} for _ in optimizer.optimizers]
        return full

    def _announce(self, call: str, collective: bool) -> None:
        """A collective call outside the step: every rank must make it (see step/call_agreement.py)."""
        self._engine.failure.check_usable()
        if collective:
            self._engine.calls.announce(self._engine, call)

    def load_full_optimizer_state_dict(self, optimizer: torch.optim.Optimizer,
                                       state_dict: Union[dict, list[dict]]) -> None:
        """Load a plain torch optimizer's state dict (from any stage or world size); no collective.
        For an :class:`OptimizerList`: its list of state dicts (one per optimizer), or the joined one."""
        self._check_optimizer(optimizer)
        optim_state.load_full_optimizer_state_dict(self._engine, state_dict)

    def _check_optimizer(self, optimizer) -> None:
        if optimizer is not self._engine.optimizer:
            raise ConfigError("pass the optimizer returned by shard() together with this model")

    @property
    def stage(self) -> int:
        return self._engine.spec.stage

    @property
    def world_size(self) -> int:
        return self._engine.comm.world_size

    @property
    def shard_group_size(self) -> int:
        """k: the ranks each flat buffer is sharded over (the world size unless hybrid)."""
        return self._engine.comm.group_size

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip by the global gradient norm over the whole (unsharded) model; return that norm.

        Same contract as ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``
        on the unwrapped model, however the gradients are sharded.
        """
        return self._engine.stepping.clip_grad_norm_(float(max_norm), float(norm_type))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients without communicating (DDP convention).

        Stages 0-1 skip the reduction until the first backward outside the
        context. Stages 2-3 still reduce-scatter every micro-step: skipping it
        would hold a full unsharded gradient, the memory they exist to save.
        """
        with self._engine.syncing(False):
            yield

    @property
    def steps_taken(self) -> int:
        """Optimizer steps since ``shard()``, equal on every rank (also after ``join()``, where
        a rank that joined early counts the steps it served): advance an LR scheduler to it."""
        return self._engine.counters.steps

    def join(self) -> contextlib.AbstractContextManager:
        """Let ranks with fewer batches stop early (DDP's ``Join``, at every stage).

        Run the training loop inside it; a rank that leaves the loop keeps taking part in the
        other ranks' collectives with zero-weight micro-steps until every rank is done, so
        nothing hangs and the average is over the data actually seen. Inside it each forward,
        backward, clip and step costs one small extra all-reduce (see step/join.py).

        >>> import torch, shardengine as se
        >>> net = torch.nn.Linear(4, 1)
        >>> model, opt = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1))
        >>> batches = [torch.randn(2, 4) for _ in range(3)]   # a different count on each rank
        >>> with model.join():
        ...     for x in batches:
        ...         model(x).pow(2).mean().backward(); opt.step(); opt.zero_grad()
        """
        if self._engine.config.step_in_backward:
            raise refuse("model.join() (ranks out of data serve zero-weight micro-steps)",
                         "Give every rank the same number of batches (a DistributedSampler with "
                         "drop_last=True), or drop step_in_backward.")
        return join.joining(self._engine)

    def set_batch_weight(self, weight: Union[int, float, torch.Tensor], reduction: str = "mean") -> None:
        """How much data this rank's current micro-step holds (default: its inputs' batch size).

        Ranks' gradients are combined in proportion to their weights, so the step equals
        single-process training on the union of every rank's micro-batches: with a loss that
        is the mean over ``weight`` items (tokens that are not padding, say), the update is
        the mean over all items of all ranks and micro-steps. ``reduction="sum"``: the loss
        is a sum over its items instead. Call it before or after the forward, before backward:
        each backward counts with the weight of the forward it differentiates, so forwards and
        backwards may come in any order (after a forward that was itself given a weight before
        it ran, the call is for the next forward).

        >>> import torch, shardengine as se
        >>> net = torch.nn.Linear(4, 1)
        >>> model, opt = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1))
        >>> x, mask = torch.randn(3, 4), torch.tensor([1.0, 1.0, 0.0])   # the last row is padding
        >>> loss = (model(x).squeeze(1) * mask).sum() / mask.sum()
        >>> model.set_batch_weight(mask.sum()); loss.backward(); opt.step(); opt.zero_grad()
        """
        self._engine.weights.set(weight, reduction)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Ends the gradient window; ``set_to_none`` (the default) also frees the engine's
        gradient storage, which the next backward allocates again."""
        self._engine.window.zero_grad(set_to_none)

    def full_state_dict(self, rank0_only: bool = False, compute_dtype: bool = False) -> dict[str, torch.Tensor]:
        """Full tensors under the original module's keys, loadable into the unwrapped model.

        Collective: every rank must call it. With ``rank0_only`` other ranks get ``{}``.
        Under mixed precision the values are the fp32 masters (``compute_dtype=True``:
        the low-precision copy the model computes with).
        """
        self._announce("model.full_state_dict()", full_state.gathers(self._engine, not compute_dtype))
        return full_state.full_state_dict(self._engine, rank0_only, not compute_dtype)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's ``generate()`` (Hugging Face). At stage 3 with ``generate_gather_bytes``
        set, the units it gathers stay gathered for the whole call, within that budget, instead of
        being gathered once per new token (see :meth:`gathered_for_generation`). At stage 3 with
        several ranks every rank decodes until all are done (``synced_gpus=True``, as transformers
        sets for DeepSpeed ZeRO-3 and FSDP): each decoding step gathers, so a rank that stopped early
        must keep stepping."""
        if self._engine.spec.shards_params and self._engine.comm.world_size > 1:
            kwargs.setdefault("synced_gpus", True)
        budget = self._engine.config.generate_gather_bytes
        with self.gathered_for_generation(budget) if budget else contextlib.nullcontext():
            return self.module.generate(*args, **kwargs)

    def gathered_for_generation(self, max_bytes: Union[int, str]) -> contextlib.AbstractContextManager:
        """Context: at stage 3, forwards without grad keep the units they gather gathered (up to
        ``max_bytes`` of them, e.g. ``"4GiB"``; the others are gathered per use), so a decoding loop
        gathers the model once instead of once per token; all are freed on exit. Collective like
        any stage-3 forward; nothing changes at stages 0-2 (the parameters are whole there).

        >>> import torch, shardengine as se
        >>> net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        >>> model, _ = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=3)
        >>> with torch.no_grad(), model.gathered_for_generation("1MiB"):
        ...     tokens = [model(torch.randn(1, 4)) for _ in range(3)]   # one gather, three forwards
        """
        return self._engine.forward.holding_gathered(parse_bytes("max_bytes", max_bytes))

    def stream_weights(self, dtype: Union[str, torch.dtype, None] = None, bucket_bytes: int = 256 << 20, *,
                       receivers: Union[str, int, list[int]] = "all", overlap: bool = True,
                       merge_adapters: bool = True, buffers: bool = True, tied_once: bool = False) -> WeightStream:
        """The full weights by name, bucket by bucket, each rank holding at most ``bucket_bytes``
        for them (collective when sharded: every rank iterates it). See docs/rl.md.

        Names are the unwrapped module's ``state_dict`` keys; values are ``full_state_dict()``'s
        cast to ``dtype``; a PEFT model's LoRA weights come merged under the base model's names
        (``merge_adapters``); a bitsandbytes base comes dequantized. ``receivers``: the ranks that
        materialize the tensors (the others take part in the gathers only).

        >>> import torch, shardengine as se
        >>> net = torch.nn.Linear(4, 2)
        >>> model, _ = se.shard(net, torch.optim.SGD(net.parameters(), lr=0.1), stage=3)
        >>> rollout = torch.nn.Linear(4, 2).to(torch.bfloat16)
        >>> for bucket in model.stream_weights(dtype="bf16", bucket_bytes=1 << 20):
        ...     _ = rollout.load_state_dict(dict(bucket), strict=False)
        >>> bool(torch.equal(rollout.weight, model.full_state_dict()["weight"].bfloat16()))
        True
        """
        return WeightStream(self._engine, dtype=dtype, bucket_bytes=bucket_bytes, receivers=receivers,
                            overlap=overlap, merge_adapters=merge_adapters, buffers=buffers, tied_once=tied_once)

    def load_full_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load full tensors (as from :meth:`full_state_dict`) into this rank's shards."""
        full_state.load_full_state_dict(self._engine, state_dict)


def shard(model: nn.Module, optimizer: OptimizerArg, stage: Union[int, str, None] = None, *,
          config: Optional[ShardConfig] = None, micro_batch: Optional[int] = None,
          seq_len: Optional[int] = None, example_inputs: Optional[Callable] = None,
          memory_budget_bytes: Optional[int] = None, **options: Any
          ) -> tuple[ShardedModel, torch.optim.Optimizer]:
    """Make ``model`` and ``optimizer`` data parallel and sharded at ``stage`` (0-3).

    ``optimizer`` is an instance built on ``model.parameters()`` (param groups
    are kept) or a factory ``params -> optimizer``. Collective: every rank calls
    it with the same model. Returns the wrapped model and the optimizer to step.
    ``optimizer=None`` shards a frozen, forward-only model (a reference or a
    teacher; every parameter ``requires_grad=False``) and returns ``(model, None)``.

    ``stage="auto"`` asks the memory estimator for the fastest run it predicts fits
    this rank's free memory (``memory_budget_bytes`` caps it) and this node's RAM, at
    ``micro_batch`` x ``seq_len`` sequences per rank per step, over the stage, resharding,
    the parameters and optimizer on the host and (where the engine has them) activation
    checkpointing and offload. Activations are always counted, traced from
    ``example_inputs(micro_batch, seq_len)`` or the inputs the model implies (its own
    ``example_inputs``; a Hugging Face model's ``input_ids``/``labels``; token ids for a
    first ``nn.Embedding``), else a ``ConfigError`` asks for ``example_inputs``. It prints
    the plan, one line per lever and why; ``model.auto_plan`` holds it, including the
    micro-batch x accumulation the training loop must run when it splits the batch.

    ``shard_group_size=k`` (or ``"node"``) is hybrid sharding: stages 1-3 shard within
    groups of k consecutive ranks and replicate across the groups (see distributed/hybrid.py).

    >>> import torch, shardengine as se
    >>> se.init_distributed().world_size
    1
    >>> net = torch.nn.Linear(4, 2)
    >>> model, opt = se.shard(net, torch.optim.AdamW(net.parameters(), lr=1e-3), stage=2)
    >>> model(torch.randn(3, 4)).sum().backward(); opt.step(); opt.zero_grad()
    >>> sorted(model.full_state_dict())
    ['bias', 'weight']
    """
    auto = isinstance(stage, str) and stage == "auto"
    forward_only = optimizer is None
    auto_inputs = {"micro_batch": micro_batch, "seq_len": seq_len, "example_inputs": example_inputs,
                   "memory_budget_bytes": memory_budget_bytes} if auto else None
    try:  # a rank that fails here must not leave the others waiting in the check below
        check_shard_arguments(model, micro_batch, seq_len, example_inputs, memory_budget_bytes)
        prepare_quantized(model)  # a bitsandbytes base declared on meta: shard its codes (flat/quantized.py)
        if auto:  # validated at stage 1 until the plan is chosen: refuse stage-bound compression first
            compression = parse_compression(options.get("compression", getattr(config, "compression", None)))
            if compression is not None:
                compression.check_grouping("auto", world_size(), world_size())
            if options.get("offload_params", getattr(config, "offload_params", False)) or options.get(
                    "offload_device_budget", getattr(config, "offload_device_budget", None)) is not None:
                raise ConfigError("stage='auto' picks the parameters' tier itself (when nothing resident fits: "
                                  "as many units on the device as fit, the rest on the host); for them on "
                                  "the host always, pass stage=3 "
                                  "with offload_params=True (or a fraction, or offload_device_budget=)")
        cfg = ShardConfig.from_kwargs(config, 1 if auto else stage, options)
        # resolved here, so ranks of nodes of different sizes disagree in the check below
        cfg = replace(cfg, shard_group_size=resolve_shard_group_size(cfg.shard_group_size, world_size(),
                                                                     local_world_size()))
        _check_compression(cfg, "auto" if auto else cfg.stage)
        _refuse_rewrap(model)
        optimizer = resolve_optimizer(optimizer, model)
        entries: Union[list, str] = fingerprint(model, optimizer, cfg, "auto" if auto else cfg.stage, auto_inputs,
                                                wrap_units=auto or STAGES[cfg.stage].spec.shards_params)
        failure = None
    except Exception as error:  # noqa: BLE001 - re-raised below, after the other ranks hear of it
        entries, failure = f"{type(error).__name__}: {error}", error
    _check_ranks_agree(entries, failure)
    world = Communicator.create(cfg.timeout_s, cfg.collectives)
    if auto:
        choice = choose_plan(model, optimizer, world, cfg, micro_batch, seq_len,
                             example_inputs, memory_budget_bytes)
        # The user's offload (host or disk) stands where the pick shards; else the pick's own.
        shards = STAGES[choice.stage].spec.shards_optimizer
        offload = cfg.offload_optimizer if cfg.offload_optimizer and shards else choice.offload_optimizer
        cfg = replace(cfg, stage=choice.stage, offload_optimizer=offload,
                      offload_path=cfg.offload_path if offload == DISK else None,
                      offload_params=choice.offload_params, offload_device_budget=choice.device_budget,
                      reshard_after_forward=choice.reshard_after_forward, **choice.activation_options())
    recipe = STAGES[cfg.stage]
    # Stage 0 shards nothing: groups of k would replicate exactly what all ranks replicate.
    group_size = cfg.shard_group_size if recipe.spec.shards_optimizer else world.world_size
    comm = HybridCommunicator.create(world, group_size, cfg.collectives)
    engine = StageEngine(recipe, model, comm, cfg, group_index_of(optimizer),
                         whole_tensor_groups(optimizer, cfg.whole_tensor_optimizers), optimizer=optimizer)
    sharded_optimizer = engine.stepping.wrap_optimizer(optimizer)
    _WRAPPED.add(model)
    wrapped = ShardedModel(model, engine)
    wrapped.auto_plan = choice if auto else None
    return wrapped, (None if forward_only else sharded_optimizer)


def _check_compression(cfg: ShardConfig, stage: Union[int, str]) -> None:
    if cfg.compression is not None:
        cfg.compression.check_grouping(stage, cfg.shard_group_size or world_size(), world_size())


def _refuse_rewrap(model: nn.Module) -> None:
    if isinstance(model, ShardedModel) or any(m in _WRAPPED for m in model.modules()):
        raise ConfigError("this model (or a submodule) is already wrapped by shardengine.shard(); "
                          "wrap the original module once")


def _check_ranks_agree(entries: Union[list, str], failure: Optional[Exception]) -> None:
    """One small collective over the default group, before any other group exists: every rank
    wraps the same model with the same optimizer and options (see state/fingerprint.py), else a
    ConfigError on every rank. A rank whose call failed raises its own error; the others
    name it."""
    digests = all_gather_bytes_default_group(digest(entries) if failure is None else b"\0" * 32)
    if failure is not None:
        all_gather_object_default_group(entries)
        raise failure
    if len(set(digests)) > 1:
        raise disagreement(all_gather_object_default_group(entries))
