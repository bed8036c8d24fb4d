"""``ShardStrategy``: ``lightning.pytorch.Trainer(strategy=ShardStrategy(stage=3))``.

A ``DDPStrategy`` in everything Lightning asks of a data-parallel strategy
(launchers for torchrun / SLURM / its own subprocesses, the process group,
``reduce`` for ``self.log(sync_dist=True)``, ``barrier``, ``broadcast``,
samplers), with ``se.shard`` in place of torch's DDP:

* ``setup``: after ``configure_optimizers``, the LightningModule (under a
  one-forward-per-step root, see step_module.py) and its optimizer go through
  ``se.shard``; schedulers are moved to the returned optimizer (schedulers.py);
* each ``*_step`` is one forward of the sharded model, with the batch weight
  set so ranks average as DDP does (the loss is already divided by
  ``accumulate_grad_batches``);
* ``accumulate_grad_batches``: Lightning's ``block_backward_sync`` is the
  engine's ``no_sync``; ``gradient_clip_val``: the engine's global norm;
* ``precision``: mapped to the engine's ``param_dtype`` (precision.py);
* checkpoints: sharded directories through ``se.save_checkpoint`` (checkpoint.py).
"""

from __future__ import annotations

import contextlib
from datetime import timedelta
from typing import Any, Iterator, Mapping, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import shardengine as se
from shardengine.config import ShardConfig
from shardengine.model import ShardedModel

from ..schedulers import retarget_schedulers
from . import checkpoint as ckpt
from .precision import ShardPrecision, param_dtype_for
from .step_module import LightningStep, add_prefix, strip_prefix

_SHARD_CALL_ONLY = ("micro_batch", "seq_len", "example_inputs", "memory_budget_bytes")


class ShardStrategy(DDPStrategy):
    """Data-parallel training sharded at ``stage`` (0-3) by shardengine.

    ``shard_options`` are ``se.shard``'s options (``bucket_mb``, ``prefetch``,
    ``offload_optimizer``, ``compression``, ``param_dtype``, ...; ``config=`` a
    ``se.config.ShardConfig``), checked here, when the Trainer is built. The remaining
    arguments are ``DDPStrategy``'s launch settings.

    >>> import lightning.pytorch as pl                                    # doctest: +SKIP
    >>> from shardengine.integrations.lightning import ShardStrategy      # doctest: +SKIP
    >>> trainer = pl.Trainer(strategy=ShardStrategy(stage=3), precision="bf16-mixed",
    ...                      gradient_clip_val=1.0, accumulate_grad_batches=4)  # doctest: +SKIP
    """

    strategy_name = "shardengine"

    def __init__(self, stage: Union[int, str] = 0, *, config: Optional[ShardConfig] = None,
                 accelerator: Any = None, parallel_devices: Optional[list[torch.device]] = None,
                 cluster_environment: Any = None, checkpoint_io: Any = None, precision_plugin: Any = None,
                 process_group_backend: Optional[str] = None, timeout: Optional[timedelta] = default_pg_timeout,
                 start_method: str = "popen", **shard_options: Any) -> None:
        self._stage = stage
        self._config = config
        self._shard_options = dict(shard_options)
        self._check_options()
        self._sharded: Optional[ShardedModel] = None
        self._user_optimizer: Optional[torch.optim.Optimizer] = None
        self._restored_by_engine = False
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, process_group_backend=process_group_backend,
                         timeout=timeout, start_method=start_method)

    def _check_options(self) -> None:
        """Bad options fail when the Trainer is built, not after the processes launched."""
        options = {k: v for k, v in self._shard_options.items() if k not in _SHARD_CALL_ONLY}
        ShardConfig.from_kwargs(self._config, 1 if self._stage == "auto" else self._stage, options)

    # ------------------------------------------------------------------ what the engine wraps

    @property
    def sharded_model(self) -> Optional[ShardedModel]:
        """The ``se.model.ShardedModel`` (``summon_full_params()``, ``memory_report()``, ...), once fitting began."""
        return self._sharded

    @property
    def sharded_optimizer(self) -> Optional[torch.optim.Optimizer]:
        """The optimizer ``se.shard`` returned (the one Lightning steps)."""
        return self.optimizers[0] if self._sharded is not None and self.optimizers else None

    # ------------------------------------------------------------------ precision

    @property
    def precision_plugin(self):  # type: ignore[override]
        return super().precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Any) -> None:
        if plugin is None or isinstance(plugin, ShardPrecision):
            self._precision_plugin = plugin
            return
        dtype = param_dtype_for(plugin, self._shard_options.get("param_dtype", getattr(self._config, "param_dtype", None)))
        if dtype is not None:
            self._shard_options["param_dtype"] = dtype
        self._precision_plugin = ShardPrecision(str(plugin.precision), self)

    # ------------------------------------------------------------------ setup

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.lightning_module is not None
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if self._sharded is not None and self._sharded.module.lightning_module is self.lightning_module:
            if fitting:
                raise MisconfigurationException(
                    "ShardStrategy: this LightningModule was already trained by ShardStrategy (its parameters "
                    "are the engine's shards); fit a new module, and resume with trainer.fit(..., ckpt_path=...)")
            self.model = self._sharded
        elif fitting:
            self.model_to_device()
            self.setup_optimizers(trainer)
            self._shard()
        else:
            self.model_to_device()  # evaluation only: every rank runs its own full copy, as DDP does
        self.setup_precision_plugin()
        if self._sharded is not None:
            # [Note: no inference_mode around a sharded model] the engine's flat buffers are written in
            # place by evaluation forwards; torch.inference_mode would make tensors created there unusable
            # in later training. Lightning picks no_grad itself on Gloo; do the same everywhere.
            for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
                loop.inference_mode = False

    def _shard(self) -> None:
        optimizers = list(self.optimizers)
        if len(optimizers) != 1:
            raise MisconfigurationException(
                f"ShardStrategy shards one optimizer; configure_optimizers returned {len(optimizers)}. Use one "
                "optimizer with several param groups (per-group learning rates and weight decay are kept)")
        user_optimizer = optimizers[0]
        if not any(group["params"] for group in user_optimizer.param_groups):
            raise MisconfigurationException("ShardStrategy needs an optimizer from configure_optimizers "
                                            "(it returned none, or one with no parameters)")
        step_module = LightningStep(self.lightning_module)
        model, optimizer = se.shard(step_module, user_optimizer, self._stage, config=self._config,
                                    **self._shard_options)
        retarget_schedulers([c.scheduler for c in self.lr_scheduler_configs], user_optimizer, optimizer)
        self._user_optimizer = user_optimizer
        self.optimizers = [optimizer]
        self.model = self._sharded = model

    def _setup_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model  # wrapping happens in setup(), together with the optimizer

    # ------------------------------------------------------------------ steps

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._step("training_step", args, kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._step("validation_step", args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._step("test_step", args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._step("predict_step", args, kwargs)

    def _step(self, method: str, args: tuple, kwargs: dict) -> Any:
        model = self.model
        if not isinstance(model, ShardedModel):
            return getattr(self.lightning_module, method)(*args, **kwargs)
        if torch.is_grad_enabled():
            # [Note: DDP's average] Lightning divides each micro-batch's loss by accumulate_grad_batches
            # and expects ranks to be averaged 1/N (DDP); equal weights make the engine do exactly that
            # even when a rank's last batch is smaller.
            model.set_batch_weight(1.0)
        return model(method, *args, **kwargs)

    @contextlib.contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Lightning's accumulation context: the engine's ``no_sync``."""
        if isinstance(self.model, ShardedModel):
            with self.model.no_sync():
                yield
        else:
            yield

    # ------------------------------------------------------------------ checkpoints

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine loads into the sharded model and optimizer

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The LightningModule's full state dict on rank 0, ``{}`` on the others; collective.

        [Note: full state dicts, as FSDPStrategy(state_dict_type="full")]
        Lightning calls this (and :meth:`optimizer_state`) on every rank when it builds a
        checkpoint dict, and callbacks' ``on_save_checkpoint`` and the LightningModule's read
        the weights there; a script may ``torch.save`` it. So it gathers the full values
        (fp32 masters under mixed precision) to rank 0, as FSDPStrategy does with full state
        dicts. The checkpoint *directory* is still written from the shards
        (:meth:`save_checkpoint` leaves these two out), so each save costs one gather to
        rank 0 on top of the sharded write.
        """
        if self._sharded is None:
            return super().lightning_module_state_dict()
        return strip_prefix(self._sharded.full_state_dict(rank0_only=True))

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        """The optimizer state in torch's format (as a plain optimizer over the LightningModule's
        parameters holds it) on rank 0, ``{}`` on the others; collective (see the Note above)."""
        if self._sharded is None:
            return super().optimizer_state(optimizer)
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer.optimizer
        return self._sharded.full_optimizer_state_dict(optimizer, rank0_only=True)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Optional[Any] = None) -> None:
        if self._sharded is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise TypeError("ShardStrategy writes sharded checkpoints itself: storage_options is not supported")
        path = self.broadcast(str(filepath))
        # keep=1: each path Lightning names holds one checkpoint (ModelCheckpoint keeps its own top-k)
        se.save_checkpoint(path, self._sharded, self.optimizers[0], extra=ckpt.pack(checkpoint), keep=1)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = self.broadcast(str(checkpoint_path))
        self._restored_by_engine = False
        if not ckpt.is_engine_checkpoint(path):
            return super().load_checkpoint(path, weights_only)  # a one-file .ckpt (an export, or from DDP)
        if self._sharded is None:
            return ckpt.read_offline(path, weights_only)  # evaluation: every rank loads the full weights
        extra = se.load_checkpoint(path, self._sharded, self.optimizers[0])
        self._restored_by_engine = True
        return ckpt.unpack(extra, path, weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._sharded is None:
            return super().load_model_state_dict(checkpoint, strict)
        if not self._restored_by_engine:
            self._sharded.load_state_dict(add_prefix(checkpoint["state_dict"]), strict=strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        if self._sharded is None:
            return super().load_optimizer_state_dict(checkpoint)
        if not self._restored_by_engine:
            states = checkpoint.get("optimizer_states") or []
            if states:  # a plain torch optimizer's state: the engine re-partitions it
                self.optimizers[0].load_state_dict(states[0])

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The LightningModule's full state dict on rank 0 (``{}`` elsewhere); collective."""
        if self._sharded is None:
            return self.lightning_module.state_dict() if self.is_global_zero else {}
        return self.lightning_module_state_dict()

    # ------------------------------------------------------------------ teardown

    def teardown(self) -> None:
        if self._sharded is None:
            return super().teardown()
        # Strategy.teardown moves the LightningModule to the CPU: its parameters are the engine's
        # (slices at stage 3), so it stays as it is; the rest is Lightning's own cleanup.
        self.model = self.lightning_module
        self.precision_plugin.teardown()
        if self.cluster_environment is not None:
            self.cluster_environment.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        pass  # constructed explicitly: strategy=ShardStrategy(stage=...)
