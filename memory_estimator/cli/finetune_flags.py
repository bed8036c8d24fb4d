"""The CLI's fine-tuning and kernel flags, and the ``--emit`` option of the planner.

Kept apart from ``command.py`` so the memory flags there stay as they are: ``command.py`` adds
:func:`add_finetuning_arguments` to its argument groups, takes :func:`fine_tuning_request` as
the request's fine-tuning part and :func:`kernel_choices` into its training part.
"""
from __future__ import annotations

import argparse
from typing import Any

from ..terms.adapters import BASE_DTYPES, QUANTIZERS
from ..terms.kernels import LOSSES
from ..request import FineTuningRequest


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


def add_finetuning_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("fine-tuning and kernels (docs/estimator-finetuning.md)")
    group.add_argument("--lora-rank", type=_float, default=None, metavar="R",
                       help="train LoRA adapters of rank R on a frozen base (needs the shapes: a config or "
                            "--hidden/--layers/--heads/--vocab)")
    group.add_argument("--lora-targets", default=None, metavar="NAMES",
                       help="comma-separated modules: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,"
                            "lm_head or the groups attention, mlp, all-linear (default attention and MLP projections)")
    group.add_argument("--lora-dropout", type=_float, default=0.0, metavar="P",
                       help="LoRA dropout; > 0 keeps a dropped copy of each adapter's input (default 0)")
    group.add_argument("--trainable-params", type=_float, default=None, metavar="N",
                       help="train N parameters on a frozen base (instead of --lora-rank)")
    group.add_argument("--base-dtype", choices=tuple(BASE_DTYPES), default=None,
                       help="storage of the frozen base: bf16/fp16, int8 (LLM.int8), nf4 (QLoRA, double "
                            "quantization, ~4.13 bits), nf4-nodq (4.5 bits); default the compute dtype")
    group.add_argument("--quantizer", choices=QUANTIZERS, default="bitsandbytes",
                       help="whose quantized linear runs the base: bitsandbytes (PEFT/HF QLoRA; keeps every "
                            "projection's input) or torchao (torchtune's LinearNF4; keeps only the weight)")
    group.add_argument("--loss", choices=LOSSES, default="plain",
                       help="cross-entropy: plain (full fp32 logits), chunked (torchtune/litgpt), fused "
                            "(Liger/Cut Cross-Entropy/Unsloth: no full logits); default plain")
    group.add_argument("--loss-upcast", action=argparse.BooleanOptionalAction, default=None,
                       help="a plain loss upcasts 16-bit logits to fp32 (Hugging Face's loss) or not "
                            "(--no-loss-upcast: cross-entropy on the logits themselves); unstated: a range")
    group.add_argument("--kernels", default=None, metavar="FAMILIES",
                       help="kernel families, comma-separated: liger, unsloth, flash-attn-fused, apex "
                            "(terms/kernel_families.py: what each keeps and moves)")
    group.add_argument("--fused-norm", action="store_true", help="fused RMSNorm kernels: no fp32 norm copies")
    group.add_argument("--compile", action="store_true",
                       help="torch.compile: element-wise ops recomputed in backward (norms, activations)")
    group.add_argument("--optimizer-in-backward", action="store_true",
                       help="each parameter steps in backward and frees its gradient (ddp/fsdp2 engines)")
    group.add_argument("--activation-offload", action="store_true",
                       help="saved activations offloaded to host RAM as forward saves them (torchtune)")
    group.add_argument("--emit", choices=("shardengine", "deepspeed", "fsdp2"), default=None,
                       help="with --objective fastest: print the chosen plan as se.shard(...) options, a "
                            "DeepSpeed JSON config or FSDP2 arguments")


def _whole(value: float | None) -> int | float | None:
    return None if value is None else (int(value) if float(value).is_integer() else value)


def fine_tuning_request(args: argparse.Namespace) -> FineTuningRequest:
    """Which weights these flags train, on what base."""
    return FineTuningRequest(lora_rank=_whole(args.lora_rank), lora_targets=args.lora_targets,
                             trainable_params=_whole(args.trainable_params), base_dtype=args.base_dtype,
                             lora_dropout=args.lora_dropout, quantizer=args.quantizer)


def kernel_choices(args: argparse.Namespace) -> dict[str, Any]:
    """The :class:`TrainingRequest` fields of these flags (and --grad-accum's memory effect)."""
    return dict(loss=args.loss, fused_norm=args.fused_norm, compile=args.compile, loss_upcast=args.loss_upcast,
                kernels=args.kernels,
                optimizer_in_backward=args.optimizer_in_backward, activation_offload=args.activation_offload,
                grad_accum=getattr(args, "grad_accum", None) or 1)
