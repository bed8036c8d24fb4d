"""Say what drove the number: the assumptions that moved each plan's total the most.

Each candidate is a counterfactual: the same plan re-estimated with one assumption
changed (a fused loss instead of the plain cross-entropy, fused norms, full
checkpointing, adapters instead of full training, ...). The difference is what that
assumption costs; the largest ones are listed with the flag that changes them, so a
user sees which description of the run to correct before trusting the verdict.

>>> from memory_estimator import estimate
>>> result = estimate(config="tests/configs/llama-2-7b.json", seq_len=4096, device="A100-80GB")
>>> [(d.term, d.flag) for d in result.drivers["ddp"][:2]]
[('model states', '--lora-rank 16'), ('optimizer_states', '--optimizer adam8bit')]
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Optional

from ..terms.adapters import Adapters
from ..byte_units import format_bytes

MAX_DRIVERS = 4
MIN_SHARE = 0.02  # below 2% of the total an assumption did not drive the number


@dataclass(frozen=True)
class Driver:
    """One assumption and what it costs in the plan's total (bytes, positive = it adds)."""

    term: str
    assumption: str
    bytes: int
    flag: str

    def text(self) -> str:
        return f"{self.term}: {self.assumption}, {format_bytes(self.bytes)} — pass {self.flag} if your recipe does"

    def to_json_dict(self) -> dict:
        return {"term": self.term, "assumption": self.assumption, "bytes": int(self.bytes), "flag": self.flag}


def _counterfactuals(setup, stats) -> list[tuple[str, str, str, object]]:
    """(term, assumption, flag, changed setup) for each assumption that applies."""
    arch = stats.architecture
    out = []
    if setup.loss == "plain" and arch is not None and arch.lm_head:
        out.append(("logits", "plain cross-entropy keeps full-vocabulary fp32 logits", "--loss fused",
                    replace(setup, loss="fused")))
    if arch is not None and arch.norm == "rmsnorm" and not (setup.fused_norm or setup.compile):
        out.append(("activations", "eager RMSNorm keeps fp32 copies of its input", "--fused-norm",
                    replace(setup, fused_norm=True)))
    if setup.checkpointing != "full":
        kept = ("no activation checkpointing" if setup.checkpointing == "none"
                else f"checkpointing {setup.checkpointing} keeps more than each layer's input")
        out.append(("activations", kept, "--checkpointing full", replace(setup, checkpointing="full")))
    if not setup.compile and arch is not None:
        out.append(("activations", "eager mode keeps element-wise outputs", "--compile",
                    replace(setup, compile=True)))
    if not setup.fused_attention:
        out.append(("activations", "unfused attention stores the s x s scores", "--fused-attention",
                    replace(setup, fused_attention=True)))
    if setup.adapters is None and arch is not None:
        out.append(("model states", "full fine-tuning: every weight has gradients and optimizer state",
                    "--lora-rank 16", replace(setup, adapters=Adapters(lora_rank=16))))
    elif setup.adapters is not None and not setup.adapters.quantized:
        out.append(("params", f"frozen base stored in {setup.adapters.base_dtype or 'the compute dtype'}",
                    "--base-dtype nf4", replace(setup, adapters=replace(setup.adapters, base_dtype="nf4"))))
    if setup.grad_accum > 1:
        out.append(("grads", f"gradients held across {setup.grad_accum} micro-steps", "--grad-accum 1",
                    replace(setup, grad_accum=1)))
    if setup.optimizer in ("adamw", "adam"):
        out.append(("optimizer_states", f"{setup.optimizer} state in {setup.policy.state_bytes * 8}-bit",
                    "--optimizer adam8bit", replace(setup, optimizer="adam8bit")))
    return out


def plan_drivers(base_total: int, estimate_with: Callable[[object], Optional[int]], setup, stats
                 ) -> tuple[Driver, ...]:
    """The assumptions that moved ``base_total`` most; ``estimate_with(setup)`` re-prices the plan."""
    drivers = []
    for term, assumption, flag, changed in _counterfactuals(setup, stats):
        total = estimate_with(changed)
        if total is None:
            continue
        delta = base_total - total
        if delta > MIN_SHARE * base_total:
            drivers.append(Driver(term, assumption, delta, flag))
    drivers.sort(key=lambda d: -d.bytes)
    return tuple(drivers[:MAX_DRIVERS])
