"""The CLI's colocated-RL flags: a rollout engine beside the trainer on every device (docs/rl.md).

Kept apart from ``command.py``: ``command.py`` adds :func:`add_rollout_arguments` to its argument
groups and, after the estimate, prints :func:`format_colocated` of :func:`colocated_answer` (or its
JSON under the ``colocated_rl`` key). Without ``--rollout-kv-tokens`` nothing changes.
"""
from __future__ import annotations

import argparse

from ..api import Estimate
from ..plan.colocated import ColocatedRL, colocated_rl
from ..terms.rollout import DTYPE_BYTES, SLEEP_MODES, RolloutRequest
from ..byte_units import MiB, parse_bytes
from ..errors import EstimatorInputError


def _count(text: str) -> int:
    try:
        value = float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value.is_integer() or value < 0:
        raise argparse.ArgumentTypeError(f"a whole number >= 0 is needed, got {text!r}")
    return int(value)


def _size(text: str) -> int:
    try:
        return parse_bytes(text, require_unit=True)
    except EstimatorInputError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_rollout_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("colocated RL: a rollout engine on every trainer device (docs/rl.md)")
    group.add_argument("--rollout-kv-tokens", type=_count, default=None, metavar="TOKENS",
                       help="plan a rollout engine beside the trainer keeping this many tokens of KV cache "
                            "(vLLM's 'GPU KV cache size'; prompts x generations x length for one batch at once)")
    group.add_argument("--rollout-dtype", choices=sorted(DTYPE_BYTES), default="bf16",
                       help="the rollout's weights (default bf16)")
    group.add_argument("--rollout-kv-dtype", choices=sorted(DTYPE_BYTES), default=None,
                       help="the KV cache's dtype (default the rollout dtype; fp8 as vLLM's kv_cache_dtype)")
    group.add_argument("--rollout-tp", type=_count, default=1, metavar="N",
                       help="the rollout engine's tensor-parallel size (weights and KV split over N devices)")
    group.add_argument("--rollout-batch", type=_count, default=256, metavar="SEQS",
                       help="sequences decoded at once (vLLM max_num_seqs, default 256): the sampler's logits")
    group.add_argument("--rollout-prefill-tokens", type=_count, default=8192, metavar="TOKENS",
                       help="tokens per prefill chunk (vLLM max_num_batched_tokens, default 8192)")
    group.add_argument("--sync-bucket", type=_size, default=256 * MiB, metavar="SIZE",
                       help="the weight sync's cap per rank (model.stream_weights bucket_bytes, default 256MiB)")
    group.add_argument("--rollout-sleep", choices=SLEEP_MODES, default="none",
                       help="during the training step: none (rollout resident), weights (vLLM sleep level 1: "
                            "weights to host, KV discarded), all (level 2: both discarded)")


def rollout_request(args: argparse.Namespace) -> RolloutRequest | None:
    if args.rollout_kv_tokens is None:
        return None
    return RolloutRequest(kv_tokens=args.rollout_kv_tokens, dtype=args.rollout_dtype, kv_dtype=args.rollout_kv_dtype,
                          tensor_parallel=args.rollout_tp, decode_batch=args.rollout_batch,
                          prefill_tokens=args.rollout_prefill_tokens, sync_bucket_bytes=args.sync_bucket,
                          sleep=args.rollout_sleep)


def colocated_answer(request: RolloutRequest | None, result: Estimate) -> ColocatedRL | None:
    """The colocated plans the rollout flags ask for (None without ``--rollout-kv-tokens``)."""
    return None if request is None else colocated_rl(result, request)


def format_colocated(answer: ColocatedRL | None) -> str:
    """The colocated table: each plan's three moments, its peak and verdict, in GiB."""
    if answer is None:
        return ""
    gib = lambda n: f"{n / 2**30:.2f}"  # noqa: E731
    terms = answer.rollout
    lines = ["", f"colocated RL (rollout in {answer.request.dtype}, tp {answer.request.tensor_parallel}, "
                 f"sleep {answer.request.sleep}): weights {gib(terms.weights)}, KV cache {gib(terms.kv_cache)} "
                 f"({answer.request.kv_tokens} tokens), activations {gib(terms.activations)}, sync bucket "
                 f"{gib(terms.sync_bucket)} GiB per device",
             f"{'plan':<28}{'train':>9}{'generate':>10}{'sync':>9}{'peak':>9}  at        verdict"]
    for plan in answer.plans:
        verdict = "fits" if plan.fits else "does not fit"
        lines.append(f"{plan.name:<28}{gib(plan.train):>9}{gib(plan.generate):>10}{gib(plan.sync):>9}"
                     f"{gib(plan.peak):>9}  {plan.moment:<9} {verdict}")
    best = answer.recommended
    lines.append(f"colocated: {'use ' + best if best else 'no plan fits with the rollout beside it'} "
                 f"(usable {gib(answer.plans[0].usable)} GiB per device)" if answer.plans else "")
    return "\n".join(lines)
