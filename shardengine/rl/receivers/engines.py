"""vLLM and SGLang as receivers, through their public weight-update calls.

[Note: inference engines receive named tensors]
Both engines load weights from ``(name, tensor)`` pairs named as the Hugging Face
checkpoint names them, each tied weight once: exactly what a stream with
``tied_once=True, buffers=False`` yields, one bucket at a time, so the engine never
holds more than its own weights plus one bucket.

* vLLM in this process (``LLM``, TRL's colocate mode): each bucket goes to the model's
  ``load_weights`` (through ``LLM.collective_rpc`` on every worker, or the driver
  worker's model where the engine runs in this process, as TRL reaches it); the prefix
  cache is reset at the end. Each trainer rank feeds its own ``LLM``.
* SGLang in this process (``sglang.Engine``): ``update_weights_from_tensor`` per bucket,
  ``flush_cache`` at the end.
* SGLang in other processes: ``init_weights_update_group`` once (the trainer's sending
  rank is rank 0 of that group), then per bucket ``update_weights_from_distributed``
  with the bucket's names, dtypes and shapes while the sending rank broadcasts each
  tensor over the group, in that order.

These classes import their engine when built and refuse with a ``ConfigError`` naming
the package when it is not installed; they are tested where it is (tests/rl/
test_inference_engines.py skips elsewhere). Nothing here stands in for an engine.
"""

from __future__ import annotations

import importlib.util
import threading
from typing import Any, Optional

import torch

from ...distributed.side_group import SideGroup
from ...errors import ConfigError
from ..stream import WeightBucket, WeightStream


def require(package: str, what: str) -> None:
    """Refuse clearly when ``package`` is not installed."""
    if importlib.util.find_spec(package) is None:
        raise ConfigError(f"{what} needs the {package!r} package, which is not installed here "
                          f"(pip install {package}; it needs a GPU). Without it, stream into a module "
                          "(ModuleReceiver) or a rollout process (RemoteRollout)")


class EngineReceiver:
    """What the engines' receivers share: named tensors each tied weight once, no buffers, nothing
    to prepare before a sync (their weight-update calls take any subset of the weights)."""

    receivers: Any = "all"  # in this process: each trainer rank feeds its own engine
    tied_once, buffers = True, False

    def begin(self, stream: WeightStream) -> None:
        """Nothing to prepare."""


class VLLMReceiver(EngineReceiver):
    """A vLLM ``LLM`` in this process, loaded bucket by bucket (see the Note)."""

    def __init__(self, llm: Any) -> None:
        require("vllm", "VLLMReceiver")
        self.llm = llm

    def load(self, bucket: WeightBucket) -> None:
        weights = list(bucket)
        model = _in_process_model(self.llm)
        if model is not None:
            model.load_weights(weights)
        else:
            self.llm.collective_rpc(_load_weights, args=(weights,))

    def end(self) -> None:
        self.llm.reset_prefix_cache()

    def logprobs(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> torch.Tensor:
        """vLLM's prompt log-probs of each probe row (every position kept: pass a probe without padding)."""
        from vllm import SamplingParams

        if attention_mask is not None and not bool(attention_mask.all()):
            raise ConfigError("the vLLM numerics probe takes rows without padding (attention_mask all ones)")
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        outputs = self.llm.generate([{"prompt_token_ids": row.tolist()} for row in input_ids], params, use_tqdm=False)
        rows = [[next(iter(p.values())).logprob if p else 0.0 for p in out.prompt_logprobs[1:]] for out in outputs]
        return torch.tensor(rows, dtype=torch.float32)


def _in_process_model(llm: Any) -> Any:
    """The driver worker's model when the engine runs in this process (as TRL reaches it), else None."""
    try:
        return llm.llm_engine.model_executor.driver_worker.model_runner.model
    except AttributeError:
        return None


def _load_weights(worker: Any, weights: list) -> None:
    worker.model_runner.model.load_weights(weights)


class SGLangReceiver(EngineReceiver):
    """An ``sglang.Engine`` in this process: ``update_weights_from_tensor`` per bucket."""

    def __init__(self, engine: Any) -> None:
        require("sglang", "SGLangReceiver")
        self.engine = engine

    def load(self, bucket: WeightBucket) -> None:
        self.engine.update_weights_from_tensor(named_tensors=list(bucket), flush_cache=False)

    def end(self) -> None:
        self.engine.flush_cache()

    def logprobs(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None  # compare with SGLang's own return_logprob outputs in your rollout loop


class SGLangDistributedReceiver(EngineReceiver):
    """SGLang servers in other processes, fed over a weight group by the trainer's ``sender`` rank.

    ``engine``: an object with SGLang's ``init_weights_update_group`` and
    ``update_weights_from_distributed`` (``sglang.Engine``, or its HTTP client's equivalents);
    ``address``: where rank 0 (the sender) hosts the group's store; ``world_size``: 1 + the
    SGLang ranks joining.
    """

    def __init__(self, engine: Any, address: str, world_size: int, rank: int, *, sender: int = 0,
                 group_name: str = "shardengine-weights", device: Optional[torch.device] = None) -> None:
        require("sglang", "SGLangDistributedReceiver")
        self.engine, self.group_name = engine, group_name
        self.receivers, self.is_sender = [sender], rank == sender
        self.group: Optional[SideGroup] = None
        if self.is_sender:
            host, _, port = address.rpartition(":")
            joining = threading.Thread(target=engine.init_weights_update_group, kwargs=dict(
                master_address=host, master_port=int(port), rank_offset=1, world_size=world_size,
                group_name=group_name, backend="nccl"))
            joining.start()  # SGLang's ranks block in the rendezvous while the sender joins it
            self.group = SideGroup.join_custom(address, 0, world_size, group_name, device=device)
            joining.join()

    def load(self, bucket: WeightBucket) -> None:
        if self.group is None:
            return
        items = list(bucket)
        names = [name for name, _ in items]
        dtypes = [str(t.dtype).removeprefix("torch.") for _, t in items]
        shapes = [list(t.shape) for _, t in items]
        update = threading.Thread(target=self.engine.update_weights_from_distributed, kwargs=dict(
            names=names, dtypes=dtypes, shapes=shapes, group_name=self.group_name, flush_cache=False))
        update.start()  # the SGLang ranks receive while the sender broadcasts
        for _, tensor in items:
            self.group.broadcast(tensor.contiguous(), src=0)
        update.join()

    def end(self) -> None:
        if self.is_sender:
            self.engine.flush_cache()

    def logprobs(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None
