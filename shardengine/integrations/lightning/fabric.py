"""``ShardFabricStrategy``: ``lightning.fabric.Fabric(strategy=ShardFabricStrategy(stage=3))``.

Fabric's ``DDPStrategy`` in what Fabric asks of a data-parallel strategy
(launch, process group, ``all_reduce``/``broadcast``/``barrier``, samplers),
with ``se.shard`` in place of torch's DDP:

* ``fabric.setup(model, optimizer[, scheduler=])``: the model and its one
  optimizer go through ``se.shard`` together (a scheduler is moved to the
  returned optimizer); every forward weighs its rank 1/N, as DDP averages;
* ``fabric.backward(loss)``; ``fabric.no_backward_sync(model)``: the engine's
  ``no_sync`` (accumulation); ``fabric.clip_gradients(model, opt, max_norm=)``:
  the engine's global norm (returned, as Fabric does);
* ``precision="bf16-mixed"`` / ``"16-mixed"``: the engine's ``param_dtype``
  (compute copy in that dtype, fp32 masters; see precision.py's Note);
* ``fabric.save(path, state)`` / ``fabric.load(path, state)``: a sharded
  checkpoint directory (``se.save_checkpoint``; each rank its shard, loadable
  at another world size and stage); the state's other entries (step
  counters, scheduler state dicts, ...) travel in its ``extra``.
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Callable, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies.strategy import _BackwardSyncControl
from lightning.fabric.wrappers import _unwrap_objects

import shardengine as se
from shardengine.config import ShardConfig
from shardengine.model import ShardedModel
from shardengine.optim.optimizer_list import OptimizerList

from ..schedulers import retarget_schedulers

_SHARD_CALL_ONLY = ("micro_batch", "seq_len", "example_inputs", "memory_budget_bytes")
PARAM_DTYPE_OF_PRECISION = {"32-true": None, "bf16-mixed": "bf16", "16-mixed": "fp16"}


class ShardFabricStrategy(DDPStrategy):
    """Data-parallel training sharded at ``stage`` (0-3) by shardengine, under Lightning Fabric.

    ``shard_options`` are ``se.shard``'s options (``config=`` a ``se.config.ShardConfig``),
    checked when the strategy is built; the rest are ``DDPStrategy``'s launch settings.

    >>> import lightning as L                                                  # doctest: +SKIP
    >>> from shardengine.integrations.lightning import ShardFabricStrategy    # doctest: +SKIP
    >>> fabric = L.Fabric(devices=2, strategy=ShardFabricStrategy(stage=3))    # doctest: +SKIP
    >>> model, optimizer = fabric.setup(model, optimizer)                      # doctest: +SKIP
    """

    strategy_name = "shardengine"

    def __init__(self, stage: Union[int, str] = 0, *, config: Optional[ShardConfig] = None, accelerator: Any = None,
                 parallel_devices: Optional[list[torch.device]] = None, cluster_environment: Any = None,
                 checkpoint_io: Any = None, precision: Any = None, process_group_backend: Optional[str] = None,
                 timeout: Optional[timedelta] = default_pg_timeout, start_method: str = "popen",
                 **shard_options: Any) -> None:
        self._stage = stage
        self._config = config
        self._shard_options = dict(shard_options)
        options = {k: v for k, v in self._shard_options.items() if k not in _SHARD_CALL_ONLY}
        ShardConfig.from_kwargs(config, 1 if stage == "auto" else stage, options)
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io, precision=precision,
                         process_group_backend=process_group_backend, timeout=timeout, start_method=start_method)
        self._backward_sync_control = _ShardBackwardSyncControl()
        self._sharded: Optional[ShardedModel] = None

    @property
    def sharded_model(self) -> Optional[ShardedModel]:
        """The ``se.model.ShardedModel`` behind the Fabric module ``fabric.setup`` returned last
        (``summon_full_params()``, ``memory_report()``, ``full_state_dict()``), or None."""
        return self._sharded

    # ------------------------------------------------------------------ precision

    @property
    def precision(self) -> Precision:  # type: ignore[override]
        return self._precision if self._precision is not None else Precision()

    @precision.setter
    def precision(self, plugin: Optional[Precision]) -> None:
        if plugin is None or type(plugin) is _EnginePrecision:
            self._precision = plugin
            return
        name = str(getattr(plugin, "precision", "32-true"))
        if name not in PARAM_DTYPE_OF_PRECISION or type(plugin).__name__ not in ("Precision", "MixedPrecision"):
            raise ValueError(f"ShardFabricStrategy does not support precision={name!r} ({type(plugin).__name__}); "
                             "use '32-true', 'bf16-mixed' or '16-mixed' (the engine's param_dtype, fp32 masters)")
        implied = PARAM_DTYPE_OF_PRECISION[name]
        given = self._shard_options.get("param_dtype", getattr(self._config, "param_dtype", None))
        if implied is not None and given is not None and str(given).replace("torch.", "") not in (
                implied, {"bf16": "bfloat16", "fp16": "float16"}[implied]):
            raise ValueError(f"Fabric(precision={name!r}) asks for {implied} compute but ShardFabricStrategy was "
                             f"given param_dtype={given!r}; set one of them")
        if implied is not None:
            self._shard_options["param_dtype"] = implied
        self._precision = _EnginePrecision(name)

    # ------------------------------------------------------------------ setup

    def setup_module_and_optimizers(self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                                    scheduler: Any = None) -> tuple[ShardedModel, list[Any], Any]:
        if len(optimizers) != 1:
            raise ValueError(f"ShardFabricStrategy shards a model with one optimizer; fabric.setup got "
                             f"{len(optimizers)}. Use one optimizer with several param groups, or "
                             "se.optim.OptimizerList([...]) as the one optimizer")
        model, optimizer = se.shard(module, optimizers[0], self._stage, config=self._config, **self._shard_options)
        retarget_schedulers([scheduler], optimizers[0], optimizer)
        # [Note: DDP's average] Fabric's loops divide the loss themselves and expect ranks averaged 1/N
        model.register_forward_pre_hook(_equal_batch_weight)
        self._sharded = model
        return model, [optimizer], scheduler

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """A module set up without its optimizer (inference): every rank runs its own full copy."""
        return module

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        raise ValueError("ShardFabricStrategy shards the model and its optimizer together: call "
                         "fabric.setup(model, optimizer), not fabric.setup_module(...) then setup_optimizers(...)")

    # ------------------------------------------------------------------ the step

    def clip_gradients_norm(self, module: torch.nn.Module, optimizer: Any, max_norm: Union[float, int],
                            norm_type: Union[float, int] = 2.0, error_if_nonfinite: bool = True) -> torch.Tensor:
        model = _sharded(module, "fabric.clip_gradients")
        if float(norm_type) != 2.0:
            raise ValueError(f"ShardFabricStrategy clips by the global 2-norm; norm_type={norm_type} is not supported")
        norm = model.clip_grad_norm_(float(max_norm))
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(f"the total norm of the gradients is {norm.item()}: non-finite "
                               "(pass error_if_nonfinite=False to clip anyway)")
        return norm

    def clip_gradients_value(self, module: torch.nn.Module, optimizer: Any, clip_val: Union[float, int]) -> None:
        raise ValueError("fabric.clip_gradients(clip_val=...) is not supported by ShardFabricStrategy: the reduced "
                         "gradients are sharded across ranks (stage >= 1) and are not param.grad tensors; use "
                         "max_norm= (the global norm over the whole model)")

    # ------------------------------------------------------------------ checkpoints

    def get_module_state_dict(self, module: torch.nn.Module) -> dict[str, Any]:
        """The full state dict on rank 0, ``{}`` elsewhere, for a sharded model; collective (as
        ``FSDPStrategy`` with full state dicts)."""
        module = _unwrap_objects(module)
        if isinstance(module, ShardedModel):
            return module.full_state_dict(rank0_only=True)
        return super().get_module_state_dict(module)

    def get_optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        raise ValueError("ShardFabricStrategy: a sharded optimizer's state in torch's format needs its model: "
                         "use model.full_optimizer_state_dict(optimizer) (collective), or fabric.save")

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[dict[str, Callable[[str, Any], bool]]] = None) -> None:
        if storage_options is not None or filter:
            raise ValueError("ShardFabricStrategy writes sharded checkpoints itself: storage_options= and "
                             "filter= are not supported")
        model, optimizer, rest = _split_state(state)
        se.save_checkpoint(self.broadcast(str(path)), model, optimizer, extra=rest)

    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        if not isinstance(state, dict) or not state:
            raise ValueError("ShardFabricStrategy loads into the objects it set up: fabric.load(path, "
                             "{'model': model, 'optimizer': optimizer, ...}); for the weights alone without a "
                             "process group use se.interop.consolidated_state_dict(path)")
        model, optimizer, rest = _split_state(state)
        extra = se.load_checkpoint(self.broadcast(str(path)), model, optimizer) or {}
        missing = [key for key in rest if key not in extra]
        if strict and missing:
            raise KeyError(f"{path} holds no {missing} (it has {sorted(extra)})")
        for key, value in extra.items():
            if key in state and hasattr(state[key], "load_state_dict"):
                state[key].load_state_dict(value)
            elif key in state:
                state[key] = value
        return {key: value for key, value in extra.items() if key not in state}


class _EnginePrecision(Precision):
    """No autocast, no GradScaler: the engine computes in ``param_dtype`` and scales fp16 losses itself."""

    def __init__(self, precision: str) -> None:
        super().__init__()
        self.precision = precision  # type: ignore[assignment]  # Fabric reads it


class _ShardBackwardSyncControl(_BackwardSyncControl):
    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        if not enabled:
            return contextlib.nullcontext()
        return _sharded(module, "fabric.no_backward_sync").no_sync()


def _equal_batch_weight(model: ShardedModel, args: Any) -> None:
    if torch.is_grad_enabled():
        model.set_batch_weight(1.0)


def _sharded(module: Any, call: str) -> ShardedModel:
    if not isinstance(module, ShardedModel):
        raise ValueError(f"{call} needs the model returned by fabric.setup(model, optimizer) under "
                         f"ShardFabricStrategy; got a {type(module).__name__}")
    return module


def _split_state(state: dict[str, Any]) -> tuple[ShardedModel, Any, dict[str, Any]]:
    """The one sharded model, its optimizer, and the plain entries (state dicts of the stateful rest)."""
    models = [key for key, value in state.items() if isinstance(value, ShardedModel)]
    if len(models) != 1:
        raise ValueError(f"ShardFabricStrategy saves and loads one sharded model per checkpoint; the state has "
                         f"{len(models)} ({models}). Put the model returned by fabric.setup in the state")
    optimizers = [key for key, value in state.items() if isinstance(value, (torch.optim.Optimizer, OptimizerList))]
    if len(optimizers) > 1:
        raise ValueError(f"ShardFabricStrategy saves one optimizer per checkpoint; the state has {optimizers}")
    rest = {key: value.state_dict() if hasattr(value, "state_dict") else value
            for key, value in state.items() if key not in models and key not in optimizers}
    return state[models[0]], state[optimizers[0]] if optimizers else None, rest
