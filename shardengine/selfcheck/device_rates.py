"""What the estimator's time and memory models assume of a device, measured on this one.

* matmul throughput in the compute dtype (the device's practical peak);
* forward+backward of a small GPT, FLOPs counted as the estimator counts them
  (its ratio to the matmul rate is the compute efficiency the time model uses);
* AdamW's step over a flat buffer, in bytes touched per second;
* the allocator's overheads. On CUDA: the context (what the driver holds for
  this process beyond the caching allocator's reserve: ``mem_get_info``'s used
  bytes minus ``memory_reserved()``, NCCL's buffers included when a group is
  up) and fragmentation (``max_memory_reserved() - max_memory_allocated()``
  over a training step, as a fraction of the allocated peak: how the
  estimator charges it). On a CPU neither exists: host tensors come from
  malloc, with no per-process context and no cache of freed blocks the
  process could see, so both are reported as not measurable and left out of
  the calibration file.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Optional

import torch

from shardengine.testing.models import build_gpt, example_inputs, lm_loss

from .links import synchronizer


@dataclasses.dataclass(frozen=True)
class DeviceRates:
    compute_dtype: str
    matmul_flops: float
    training_flops: float
    optimizer_bytes_per_s: float
    cuda_context_bytes: Optional[int]         # None off CUDA
    fragmentation_fraction: Optional[float]   # None off CUDA


def _repeat_for(fn: Callable[[], None], sync: Callable[[], None], seconds: float) -> tuple[int, float]:
    """Calls of ``fn`` that take about ``seconds``, and the time they took."""
    fn()
    sync()
    started = time.perf_counter()
    fn()
    sync()
    repeats = max(1, int(seconds / max(time.perf_counter() - started, 1e-6)))
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return repeats, time.perf_counter() - started


def matmul_flops(device: torch.device, dtype: torch.dtype, size: int, seconds: float) -> float:
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    repeats, elapsed = _repeat_for(lambda: a @ b, synchronizer(device), seconds)
    return 2 * size**3 * repeats / elapsed


def _gpt_step(device: torch.device, preset: str, seq_len: int):
    model = build_gpt(preset, vocab_size=256, seq_len=seq_len).to(device)
    idx, targets = example_inputs(2, seq_len, 256, device=device)

    def step() -> None:
        lm_loss(model(idx), targets).backward()
        model.zero_grad(set_to_none=True)
    return model, step, idx.numel()


def training_flops(device: torch.device, preset: str, seq_len: int, seconds: float) -> float:
    """Forward+backward FLOP/s, 3 x the estimator's forward count (2 per parameter per token + attention)."""
    from memory_estimator.measure import Workload, forward_flops

    model, step, tokens = _gpt_step(device, preset, seq_len)
    repeats, elapsed = _repeat_for(step, synchronizer(device), seconds)
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    workload = Workload(params, tokens, layers=config.n_layer, hidden=config.n_embd, seq_len=seq_len,
                        precision="fp32")
    return 3 * forward_flops(workload) * repeats / elapsed


def optimizer_bytes_per_s(device: torch.device, numel: int, seconds: float) -> float:
    from memory_estimator.measure import STEP_BYTES

    param = torch.nn.Parameter(torch.randn(numel, device=device))
    param.grad = torch.randn(numel, device=device)
    optimizer = torch.optim.AdamW([param], lr=1e-3)
    repeats, elapsed = _repeat_for(optimizer.step, synchronizer(device), seconds)
    return STEP_BYTES["adamw"] * numel * repeats / elapsed


def allocator_overheads(device: torch.device, preset: str, seq_len: int) -> tuple[Optional[int], Optional[float]]:
    """(CUDA context bytes, fragmentation fraction) around two AdamW training steps; (None, None) off CUDA."""
    if device.type != "cuda":
        return None, None
    model = build_gpt(preset, vocab_size=256, seq_len=seq_len).to(device)
    idx, targets = example_inputs(2, seq_len, 256, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()   # blocks cached by the earlier checks are not this step's fragmentation
    torch.cuda.reset_peak_memory_stats(device)
    for _ in range(2):    # the second step runs with Adam's state in place, as training does
        lm_loss(model(idx), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize(device)
    allocated, reserved = torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)
    free, total = torch.cuda.mem_get_info(device)
    context = max(0, total - free - torch.cuda.memory_reserved(device))
    return context, (reserved - allocated) / max(allocated, 1)


def measure_device(device: torch.device, compute_dtype: torch.dtype, fast: bool) -> DeviceRates:
    seconds = 0.1 if fast else 0.5
    size = 512 if fast or device.type == "cpu" else 4096
    # A GPU needs a model big enough to keep it busy for its rate to mean anything.
    preset, seq_len = ("tiny", 64) if fast else ("10m", 256) if device.type == "cuda" else ("1m", 128)
    context, fragmentation = allocator_overheads(device, preset, seq_len)
    return DeviceRates(str(compute_dtype).removeprefix("torch."),
                       matmul_flops(device, compute_dtype, size, seconds),
                       training_flops(device, preset, seq_len, seconds),
                       optimizer_bytes_per_s(device, 1 << (18 if fast else 22), seconds),
                       context, fragmentation)
