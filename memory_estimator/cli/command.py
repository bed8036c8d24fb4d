"""``memory-estimator``: will this model train on these GPUs, term by term.

Exit codes: 0 a plan fits, 1 none fits, 2 bad input (one-line message, no traceback).

The parser is built from small argument-group functions (``ARGUMENT_GROUPS``) and the
command line may start with a subcommand (``SUBCOMMANDS``), so other concerns (a
step-time model, a calibration command) slot in without touching the memory flags.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from typing import Callable, Sequence

from ..api import estimate
from ..basis import at_seq_len, format_typical, typical_json, typical_length
from ..terms.checkpointing import CHECKPOINTING_MODES
from .finetune_flags import add_finetuning_arguments
from .rollout_flags import add_rollout_arguments, colocated_answer, format_colocated
from .emit import emit_config, emit_note, format_planned, planner_json
from ..plan.fastest import apply_objective
from ..plan.timed import tf32_note
from ..hardware.devices import THIS_MACHINE
from ..engines import ENGINES
from ..errors import EstimatorInputError
from ..terms.optimizers import IMPLEMENTATIONS, OPTIMIZERS
from ..terms.overheads import MODULE_LOADING
from ..terms.precision import AMP_DTYPES, PRECISIONS
from .report import format_breakdown, format_devices, format_table
from .command_request import command_request
from .timing_flags import add_timing_arguments, format_timing, timed_answer, timing_json, untimed_note
from ..byte_units import MiB, parse_bytes

__all__ = ["main", "build_parser", "command_request", "format_table", "ARGUMENT_GROUPS", "SUBCOMMANDS"]

EXIT_FITS, EXIT_NO_FIT, EXIT_BAD_INPUT = 0, 1, 2


class _ArgumentParser(argparse.ArgumentParser):
    """argparse that reports bad flags as one line with exit code 2, like other bad input."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # argparse takes "-7e9" or "-24GiB" for an option (it only knows -7 and -7.5 as
        # numbers); widen the pattern so a negative count or size reaches validation and
        # gets its message instead of "expected one argument".
        self._negative_number_matcher = re.compile(r"^-\d*\.?\d+([eE][+-]?\d+)?[a-zA-Z]*$")

    def error(self, message: str) -> None:  # type: ignore[override]
        raise EstimatorInputError(message)


def _number(text: str) -> float:
    """Counts may be written 7e9 or 7_000_000_000."""
    try:
        return float(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def _bytes(text: str) -> int:
    """A size with its unit: a bare "24" would be 24 bytes, so it is refused."""
    try:
        return parse_bytes(text, require_unit=True)
    except EstimatorInputError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _bytes_or_zero(text: str) -> int:
    try:
        return parse_bytes(text, allow_zero=True, require_unit=True)
    except EstimatorInputError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _fraction(text: str) -> float:
    """A share in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"a fraction must be a number > 0 and <= 1, got {text!r}")
    return value


def _checkpointing(text: str) -> str:
    from ..terms.checkpointing import parse_policy

    try:
        parse_policy(text)
    except EstimatorInputError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def _proportions(text: str) -> list[float]:
    from ..terms.proportions import parse_proportions

    try:
        return parse_proportions(text)
    except EstimatorInputError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model (give exactly one)")
    model.add_argument("--params", type=_number, help="parameter count, e.g. 7e9")
    model.add_argument("--config", help="Hugging Face config.json; any model_type transformers knows when it is "
                                        "installed, else the hand-written families")
    model.add_argument("--module", help="package.module:build_fn or path/file.py:build_fn, built on the meta "
                                        "device; activations are traced if it defines example_inputs(b, s)")
    model.add_argument("--largest-layer", type=_number, help="params of the largest stage-3 unit, e.g. 2e8")
    for flag, text in (("--hidden", "hidden size h"), ("--layers", "transformer layers L"),
                       ("--heads", "attention heads a"), ("--vocab", "vocabulary size V")):
        model.add_argument(flag, type=_number, help=f"{text} (with --params, for activations)")


def add_training_arguments(parser: argparse.ArgumentParser) -> None:
    training = parser.add_argument_group("training")
    training.add_argument("--world-size", "--gpus", dest="world_size", type=_number, default=1, help="ranks N (default 1)")
    training.add_argument("--precision", choices=PRECISIONS, default=None,
                          help="bf16/fp16: 16-bit weights with fp32 masters (default bf16); pure-bf16/pure-fp16: "
                               "no master, optimizer state in 16 bits; fp32")
    training.add_argument("--amp", choices=AMP_DTYPES, default=None,
                          help="torch autocast over fp32 weights (implies --precision fp32)")
    training.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw", help="default adamw")
    training.add_argument("--optimizer-impl", choices=IMPLEMENTATIONS, default=None,
                          help="step implementation: foreach (torch's CUDA default), fused, plain (for-loop)")
    training.add_argument("--micro-batch", type=_number, default=None, help="sequences per rank per step (default 1)")
    training.add_argument("--seq-len", type=_number, default=2048, help="tokens per sequence (default 2048)")
    training.add_argument("--proportions", type=_proportions, default=None, metavar="P0,P1,...",
                          help="uneven data: each rank's share of the global micro-batch (--micro-batch x ranks), "
                               "e.g. .25,.25,.1,.4; the table is for the rank with the largest share")
    training.add_argument("--checkpointing", type=_checkpointing, default="none", metavar="POLICY",
                          help=f"{', '.join(CHECKPOINTING_MODES)} (default none)")
    training.add_argument("--keep-grads", action="store_true",
                          help="zero_grad() zeroes gradients instead of freeing them (torch < 2.0's default)")
    training.add_argument("--fused-attention", action=argparse.BooleanOptionalAction, default=True,
                          help="flash/fused attention: s×s scores not stored (default on)")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    engine = parser.add_argument_group("engine")
    engine.add_argument("--engine", choices=ENGINES, default="shardengine",
                        help="whose memory to model (default shardengine)")
    engine.add_argument("--prefetch", type=_number, default=1, help="stage-3 units gathered ahead (default 1)")
    engine.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                        help="shardengine stage 3: free each unit after its forward (default); "
                             "--no-reshard-after-forward keeps every unit gathered until its backward "
                             "(shard(reshard_after_forward=False)): one gather per unit instead of two, "
                             "every unit's parameters beside the activations")
    engine.add_argument("--bucket-size", type=_bytes, default=25 * MiB, help="reduce/gather bucket (default 25MiB)")
    engine.add_argument("--offload-params", type=_fraction, default=None, metavar="FRACTION",
                        help="shardengine: also plan stage 3 with this fraction (0-1] of the parameters on the "
                             "host, the units nearest the forward/backward turn resident (zero3-offload-params-F)")
    engine.add_argument("--offload-device-budget", type=_bytes_or_zero, default=None, metavar="SIZE",
                        help="shardengine: also plan stage 3 with the units that do not fit SIZE of device "
                             "model states per rank on the host (zero3-offload-params-budget-<bytes>B)")
    engine.add_argument("--deepspeed-config", help="ds_config.json: bucket sizes, prefetch, sub-groups, precision")
    engine.add_argument("--reduce-dtype", choices=("fp32", "bf16", "fp16"), default=None,
                        help="FSDP2 MixedPrecisionPolicy.reduce_dtype (default: the compute dtype)")
    engine.add_argument("--gradient-as-bucket-view", action="store_true",
                        help="DDP: gradients are views of its buckets (no second gradient copy)")
    engine.add_argument("--offload", choices=("host", "disk"), default="host",
                        help="where the offload plans keep what they move: host memory (default), "
                             "or with 'disk' also the disk tier's plans zero3-offload-disk and "
                             "zero3-offload-params-disk (files on a node's drive: shardengine's disk tier, "
                             "DeepSpeed's NVMe offload)")


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    target = parser.add_argument_group("device")
    target.add_argument("--device", default=None,
                        help=f"catalog name (see --list-devices) or {THIS_MACHINE!r}; default A100-80GB")
    target.add_argument("--gpu-memory", type=_bytes, help="memory per device, e.g. 24GiB or 80GB")
    target.add_argument("--list-devices", action="store_true", help="print the device catalog and exit")
    target.add_argument("--host-memory", type=_bytes_or_zero, default=None, metavar="SIZE",
                        help="host RAM per node, e.g. 128GiB: offload plans fit only if what they keep there "
                             "does (default: this machine's available RAM with --device this-machine, else "
                             "not stated: such plans then say 'fits if the host has >= X')")
    target.add_argument("--disk-space", type=_bytes_or_zero, default=None, metavar="SIZE",
                        help="free disk per node for the disk tier's files, e.g. 1TiB (default: free space at "
                             "--offload-path with --device this-machine, else not stated)")
    target.add_argument("--offload-path", default=None, metavar="DIR",
                        help="where the disk tier writes (this-machine: its free space is --disk-space's default)")


def add_overhead_arguments(parser: argparse.ArgumentParser) -> None:
    costs = parser.add_argument_group("overheads")
    costs.add_argument("--cuda-context", type=_bytes_or_zero, default=None,
                       help="CUDA context and kernels (default by GPU generation, 0 on CPU)")
    costs.add_argument("--cuda-module-loading", choices=MODULE_LOADING, default="lazy",
                       help="eager: every kernel loaded at start-up, as before CUDA 11.7 (default lazy)")
    costs.add_argument("--nccl-buffers", type=_bytes_or_zero, default=None,
                       help="NCCL buffers per rank (default: by world size and link, 0 on CPU)")
    costs.add_argument("--fragmentation", type=float, default=None,
                       help="allocator fragmentation, fraction of the rest (default 0.05 on GPUs, 0 on CPU)")
    costs.add_argument("--calibration", default=None, metavar="FILE",
                       help="this machine's measured numbers (python -m shardengine.selfcheck --calibration-out "
                            "FILE): its CUDA context and fragmentation on a GPU, and what this-machine means")
    costs.add_argument("--no-logits", action="store_true", help="leave out the logits/loss buffers")
    costs.add_argument("--safety-margin", type=float, default=0.10, help="fraction of device memory kept free (default 0.10)")


def add_basis_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("variable sequence lengths (what the caching allocator then holds)")
    group.add_argument("--mean-seq-len", type=float, default=None, metavar="TOKENS",
                       help="batches vary and --seq-len is their cap: their mean padded length (the mean sequence "
                            "with micro-batch 1); the distribution's shape is assumed; also estimates a typical step")
    group.add_argument("--length-histogram", default=None, metavar="FILE",
                       help="the sequences' lengths: JSON {\"length\": count} or lines 'length count'; batches "
                            "are padded to their longest")
    group.add_argument("--over-cap", choices=("truncate", "drop"), default="truncate",
                       help="sequences longer than --seq-len are truncated (default) or dropped")
    group.add_argument("--steps", type=int, default=None,
                       help="micro-steps the run takes (default 1000): lengths that never reach the cap keep "
                            "growing the cache with them")
    group.add_argument("--expandable-segments", action="store_true",
                       help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: one growing segment, little cached")


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the machine-readable schema only")
    parser.add_argument("--breakdown", action="store_true", help="also list the named buffers of each plan")


ARGUMENT_GROUPS: tuple[Callable[[argparse.ArgumentParser], None], ...] = (
    add_model_arguments, add_training_arguments, add_engine_arguments, add_device_arguments,
    add_overhead_arguments, add_timing_arguments, add_output_arguments, add_finetuning_arguments,
    add_basis_arguments, add_rollout_arguments)

# name -> handler(argv) returning an exit code; the default command estimates memory.
SUBCOMMANDS: dict[str, Callable[[Sequence[str]], int]] = {}


def _calibrate(argv: Sequence[str]) -> int:
    from ..measure.calibrate import main as calibrate_main
    return calibrate_main(list(argv))


SUBCOMMANDS["calibrate"] = _calibrate


EPILOG = """\
subcommand:
  memory-estimator calibrate [--nproc N]   measure this machine's links, compute and optimizer
                                           step once, for --device/--interconnect this-machine
                                           (memory-estimator calibrate --help)

defaults: device A100-80GB, 1 rank, sequence 2048, micro-batch 1, bf16 weights with fp32
  masters, adamw, no activation checkpointing, 10% of device memory kept free, engine shardengine

exit codes: 0 a plan fits, 1 no plan fits (the table says what would), 2 bad input (one line
  on stderr)
"""


def build_parser(groups: Sequence[Callable[[argparse.ArgumentParser], None]] = ARGUMENT_GROUPS
                 ) -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        prog="memory-estimator",
        description="Per-rank memory of training a model under DDP, ZeRO/FSDP stages and offload, "
                    "term by term, for shardengine, PyTorch DDP, FSDP2 or DeepSpeed, and the cheapest plan "
                    "that fits.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    for add_group in groups:
        add_group(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``memory-estimator`` console script; returns the exit code.

    Example (exit code 0 because a plan fits)::

        $ memory-estimator --config tests/configs/llama-2-7b.json --gpus 8 --device A100-80GB \\
              --micro-batch 1 --seq-len 4096 --json

    >>> main(["--params", "7.5e9", "--gpus", "64", "--gpu-memory", "80GB", "--json"])  # doctest: +ELLIPSIS
    {"params": 7500000000, "world_size": 64, ...
    0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUBCOMMANDS:
        return SUBCOMMANDS[argv[0]](argv[1:])
    try:
        args = build_parser().parse_args(argv)
        if args.list_devices:
            print(format_devices())
            return EXIT_FITS
        request = command_request(args)  # read once; each step below works on the previous one's output
        result = estimate(request.estimate)
        timed = timed_answer(request.timing, request.timing_flags, result)  # None unless a time-model flag was given
        tf32 = tf32_note(timed, request.timing) if timed else None
        result = untimed_note(request.timing, request.timing_flags, result)
        result, planned = apply_objective(result, timed, request.timing if timed else None)
        emitted = emit_config(request.output.emit, planned, result) if request.output.emit else None
        note = emit_note(request.output.emit, planned, result.engine)
        training = request.estimate.training
        typical = typical_length(training.mean_seq_len, training.seq_len, at_seq_len(request.estimate, estimate))
        colocated = colocated_answer(request.rollout, result)  # None without --rollout-kv-tokens
    except EstimatorInputError as error:
        print(f"memory-estimator: error: {error}", file=sys.stderr)
        return EXIT_BAD_INPUT
    output = request.output
    if output.json:
        answer = typical_json(planner_json(timing_json(result.to_json_dict(), timed, tf32), planned, output.emit,
                                           emitted, note), typical, result)
        print(json.dumps({**answer, "colocated_rl": colocated.to_json_dict()} if colocated else answer))
    else:
        print(format_table(result) + format_typical(typical, result) + format_timing(timed, tf32)
              + format_planned(planned, output.emit, emitted, note) + format_colocated(colocated))
        if output.breakdown:
            print(format_breakdown(result))
    fits = colocated.recommended if colocated else result.recommended
    return EXIT_FITS if fits else EXIT_NO_FIT


if __name__ == "__main__":
    sys.exit(main())
