"""Default compute efficiency (achieved / peak FLOP/s) by GPU generation and model size.

The time model charges every FLOP a step computes — forward, backward and any
recomputation — so its efficiency is a *hardware* FLOPs utilization (HFU: MFU with the
recomputed forward counted). Small models run small matmuls and spend a larger share
of the step in memory-bound element-wise kernels, so the utilization rises with size
and saturates at a generation-dependent ceiling; and each micro-step pays fixed costs
(kernel launches, the first unit's gather, the per-unit collectives' latency) that the
tokens of one micro-step amortize:

    efficiency(Ψ, t) = ceiling(generation) · Ψ / (Ψ + Ψ0) · t / (t + t0),
    Ψ0 = 1e8 parameters, t0 = 1000 tokens per micro-step

Fitted by hand to the published MPT training benchmarks of MosaicML's llm-foundry
(``scripts/train/benchmarking/README.md``: FSDP FULL_SHARD, bf16, 8-128 GPUs, 125M-70B,
MFU and HFU per run; https://github.com/mosaicml/llm-foundry): on A100-80GB the HFU
is 0.43-0.50 at 125M, 0.51-0.54 at 350M, 0.56-0.63 at 1-3B, 0.64-0.77 at 7-30B; on
H100-80GB 0.37-0.46 up to 3B and 0.40-0.59 at 7-70B. Ceilings: Ampere 0.74, Hopper
0.52 (the H100's peak is 3.2x the A100's while its memory bandwidth is 1.6x, so the
same kernels reach a smaller share of it). Other generations have no published table
here and keep the former flat 0.5 (times the micro-step factor). The three numbers
(ceilings 0.74 and 0.52, t0) were chosen on a grid to minimize the median plus a third
of the worst |error| over the 16 runs of ``tests/field/throughput.json``, points of that
same table (``python -m memory_estimator.measure.field_time tests/field/throughput.json``).

>>> round(default_efficiency("ampere", 7e9, 12288), 3), round(default_efficiency("hopper", 1.3e9, 4096), 3)
(0.675, 0.388)
>>> default_efficiency("volta", 7e9)
0.5
"""
from __future__ import annotations

from typing import Optional

CEILINGS = {"ampere": 0.74, "hopper": 0.52}
HALF_SIZE = 1e8
HALF_TOKENS = 1000
FLAT = 0.5


def default_efficiency(generation: str, params: Optional[float], tokens: Optional[int] = None) -> float:
    """Achieved / peak FLOP/s for a model of ``params`` at ``tokens`` per micro-step."""
    per_step = 1.0 if not tokens else tokens / (tokens + HALF_TOKENS)
    ceiling = CEILINGS.get(generation)
    if ceiling is None or not params:
        return FLAT * per_step
    return ceiling * params / (params + HALF_SIZE) * per_step
