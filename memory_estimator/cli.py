"""``memory-estimator``: will this model train on these GPUs, term by term.

Exit codes: 0 a plan fits, 1 none fits, 2 bad input (one-line message, no traceback).
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Sequence

from .activations import CHECKPOINTING_MODES
from .api import Estimate, estimate
from .devices import CATALOG, THIS_MACHINE
from .errors import EstimatorInputError
from .model_states import OPTIMIZERS, PRECISIONS
from .plans import Overheads
from .timing_report import add_timing_arguments, format_timing, resolve_topology, time_estimate, timing_json
from .units import GB, MiB, format_bytes, parse_bytes

EXIT_FITS, EXIT_NO_FIT, EXIT_BAD_INPUT = 0, 1, 2
_TERMS = ("params", "grads", "optimizer_states", "activations", "working_set", "overhead", "total")


class _ArgumentParser(argparse.ArgumentParser):
    """argparse that reports bad flags as one line with exit code 2, like other bad input."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # argparse takes "-7e9" for an option (it only knows -7 and -7.5 as numbers);
        # widen the pattern so a negative count reaches validation and gets its message.
        self._negative_number_matcher = re.compile(r"^-\d*\.?\d+([eE][+-]?\d+)?$")

    def error(self, message: str) -> None:  # type: ignore[override]
        raise EstimatorInputError(message)


def _number(text: str) -> float:
    """Counts may be written 7e9 or 7_000_000_000."""
    try:
        return float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _bytes(text: str) -> int:
    try:
        return parse_bytes(text)
    except EstimatorInputError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        prog="memory-estimator",
        description="Per-rank memory of training a model under DDP and ZeRO stages 1-3 (+offload), "
                    "term by term, and the cheapest plan that fits.")
    model = parser.add_argument_group("model (give exactly one)")
    model.add_argument("--params", type=_number, help="parameter count, e.g. 7e9")
    model.add_argument("--config", help="Hugging Face-style config.json (read as plain JSON)")
    model.add_argument("--module", help="package.module:build_fn, built on the meta device; "
                                        "activations are traced if the module defines example_inputs(b, s)")
    model.add_argument("--largest-layer", type=_number, help="params of the largest stage-3 unit, e.g. 2e8")
    for flag, text in (("--hidden", "hidden size h"), ("--layers", "transformer layers L"),
                       ("--heads", "attention heads a"), ("--vocab", "vocabulary size V")):
        model.add_argument(flag, type=_number, help=f"{text} (with --params, for activations)")
    training = parser.add_argument_group("training")
    training.add_argument("--world-size", "--gpus", dest="world_size", type=_number, default=1, help="ranks N (default 1)")
    training.add_argument("--precision", choices=PRECISIONS, default="bf16", help="default bf16 (mixed, fp32 master)")
    training.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="default adamw")
    training.add_argument("--micro-batch", type=_number, default=1, help="sequences per rank per step (default 1)")
    training.add_argument("--seq-len", type=_number, default=2048, help="tokens per sequence (default 2048)")
    training.add_argument("--checkpointing", choices=CHECKPOINTING_MODES, default="none", help="default none")
    training.add_argument("--fused-attention", action=argparse.BooleanOptionalAction, default=True,
                          help="flash/fused attention: s×s scores not stored (default on)")
    training.add_argument("--prefetch", type=_number, default=1, help="stage-3 units gathered ahead (default 1)")
    training.add_argument("--bucket-size", type=_bytes, default=25 * MiB, help="reduce/gather bucket (default 25MiB)")
    target = parser.add_argument_group("device")
    target.add_argument("--device", default=None,
                        help=f"catalog name (see --list-devices) or {THIS_MACHINE!r}; default A100-80GB")
    target.add_argument("--gpu-memory", type=_bytes, help="memory per device, e.g. 24GiB or 80GB")
    target.add_argument("--list-devices", action="store_true", help="print the device catalog and exit")
    costs = parser.add_argument_group("overheads")
    costs.add_argument("--cuda-context", type=_bytes, default=None,
                       help="CUDA context and library workspaces (default 512MiB on GPUs, 0 on CPU)")
    costs.add_argument("--fragmentation", type=float, default=None,
                       help="allocator fragmentation, fraction of the rest (default 0.05 on GPUs, 0 on CPU)")
    costs.add_argument("--no-logits", action="store_true", help="leave out the fp32 logits/loss buffers")
    costs.add_argument("--safety-margin", type=float, default=0.10, help="fraction of device memory kept free (default 0.10)")
    add_timing_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the machine-readable schema only")
    return parser


def _whole(name: str, value: float | None) -> int | float | None:
    """Flags arrive as floats (7e9); hand whole numbers on as int so 7e9 means 7000000000."""
    if value is None:
        return None
    return int(value) if float(value).is_integer() else value


def run_estimate(args: argparse.Namespace) -> Estimate:
    device = args.device
    if device is None and args.gpu_memory is None:
        device = "A100-80GB"
    return estimate(
        params=_whole("params", args.params), config=args.config, module=args.module,
        largest_layer=_whole("largest layer", args.largest_layer),
        hidden=_whole("hidden", args.hidden), layers=_whole("layers", args.layers),
        heads=_whole("heads", args.heads), vocab=_whole("vocab", args.vocab),
        world_size=_whole("world size", args.world_size), precision=args.precision, optimizer=args.optimizer,
        micro_batch=_whole("micro-batch", args.micro_batch), seq_len=_whole("seq-len", args.seq_len),
        checkpointing=args.checkpointing, fused_attention=args.fused_attention,
        device=device, device_memory_bytes=args.gpu_memory,
        prefetch_depth=_whole("prefetch", args.prefetch), bucket_bytes=args.bucket_size,
        overheads=_overheads(args),
        safety_margin=args.safety_margin,
    )


def _overheads(args: argparse.Namespace) -> Overheads | None:
    """Explicit flags win; otherwise None lets estimate() pick the device's defaults
    (a CUDA context and fragmentation on GPUs, nothing on a CPU)."""
    if args.cuda_context is None and args.fragmentation is None and not args.no_logits:
        return None
    defaults = Overheads()
    return Overheads(
        cuda_context_bytes=defaults.cuda_context_bytes if args.cuda_context is None else args.cuda_context,
        fragmentation_fraction=(defaults.fragmentation_fraction if args.fragmentation is None
                                else args.fragmentation),
        logits_in_overhead=not args.no_logits)


def _table_unit(result: Estimate) -> tuple[str, int]:
    """GiB, unless every total is under one: then MiB, so small models don't print as 0.00."""
    largest = max(plan.total for plan in result.plans)
    return ("GiB", 2**30) if largest >= 2**30 else ("MiB", 2**20)


def _param_count(count: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.2f} {suffix}"
    return str(count)


def format_table(result: Estimate) -> str:
    """Plain-text report: one column per plan, one row per term, in GiB (MiB for small models)."""
    setup = result.setup
    unit, scale = _table_unit(result)
    amount = lambda num_bytes: f"{num_bytes / scale:.2f}"  # noqa: E731
    lines = [
        f"model: {result.params:,} params ({_param_count(result.params)}, {result.stats.source})   "
        f"device: {result.device.name}, {format_bytes(result.device.memory_bytes)} "
        f"(usable {format_bytes(result.device.memory_bytes * (1 - setup.safety_margin))} "
        f"after {setup.safety_margin:.0%} margin)",
        f"setup: {result.world_size} rank(s), {setup.precision}, {setup.optimizer}, micro-batch "
        f"{setup.micro_batch}, seq {setup.seq_len}, checkpointing {setup.checkpointing}, fused attention "
        f"{'on' if setup.fused_attention else 'off'}; activations: {result.activation_source}",
        "",
    ]
    header = [f"per rank ({unit})"] + [plan.name for plan in result.plans]
    rows = [[term] + [amount(plan.total if term == "total" else getattr(plan, term)) for plan in result.plans]
            for term in _TERMS]
    rows.append(["headroom"] + [amount(plan.headroom) for plan in result.plans])
    rows.append(["fits"] + ["yes" if plan.fits else "no" for plan in result.plans])
    offloaded = [p for p in result.plans if p.host_optimizer_states]
    widths = [max(len(row[i]) for row in [header] + rows) for i in range(len(header))]
    render = lambda row: "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
    rule = "  ".join("-" * w for w in widths)
    lines += [render(header), rule] + [render(r) for r in rows[:-3]] + [rule] + [render(r) for r in rows[-3:]]
    lines.append("")
    for plan in offloaded:
        lines.append(f"{plan.name}: optimizer states on host RAM: {format_bytes(plan.host_optimizer_states)} per rank")
    if result.recommended:
        lines.append(f"recommended: {result.recommended}   largest micro-batch that fits it: "
                     f"{result.max_micro_batch if result.max_micro_batch is not None else 'unknown'}")
    else:
        lines.append("recommended: none fits")
        lines += [f"  would fit: {advice}" for advice in result.suggestions]
    lines += [f"warning: {note}" if "not estimated" in note else f"note: {note}" for note in result.notes]
    return "\n".join(lines)


def format_devices() -> str:
    width = max(len(name) for name in CATALOG)
    lines = [f"{'device'.ljust(width)}  {'bytes':>16}  {'GiB':>7}  {'GB':>7}  source"]
    for device in CATALOG.values():
        source = "reported total capacity" if device.reported else "nominal minus reserve"
        lines.append(f"{device.name.ljust(width)}  {device.memory_bytes:>16,}  "
                     f"{device.memory_bytes / 2**30:>7.2f}  {device.memory_bytes / GB:>7.2f}  {source}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``memory-estimator`` console script; returns the exit code.

    Example (exit code 0 because a plan fits)::

        $ memory-estimator --config tests/configs/llama-2-7b.json --gpus 8 --device A100-80GB \\
              --micro-batch 1 --seq-len 4096 --json

    >>> main(["--params", "7.5e9", "--gpus", "64", "--gpu-memory", "80GB", "--json"])  # doctest: +ELLIPSIS
    {"params": 7500000000, "world_size": 64, ...
    0
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["calibrate"]:
        from .calibrate import main as calibrate_main
        return calibrate_main(argv[1:])
    try:
        args = build_parser().parse_args(argv)
        if args.list_devices:
            print(format_devices())
            return EXIT_FITS
        result = run_estimate(resolve_topology(args))
        timed = time_estimate(args, result)  # None unless a time-model flag was given
    except EstimatorInputError as error:
        print(f"memory-estimator: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(json.dumps(timing_json(result.to_json_dict(), timed)) if args.json
          else format_table(result) + format_timing(timed))
    return EXIT_FITS if result.recommended else EXIT_NO_FIT


if __name__ == "__main__":
    sys.exit(main())
