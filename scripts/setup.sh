#!/usr/bin/env bash
# Installs shardengine with its test (pytest, hypothesis, deepspeed), Hugging Face and Lightning extras (the suite tests
# load_pretrained / save_pretrained on tiny transformers models, and the trainer integrations
# ShardTrainer (with TRL's SFTTrainer and DPOTrainer), QLoRA with bitsandbytes, and ShardStrategy) into the current Python.
# torch is pinned to the CPU build first when missing: an unpinned `torch`
# requirement can otherwise pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
# DS_BUILD_OPS=0: deepspeed (test extra) installs without compiling its C++/CUDA ops; the DeepSpeed
# checkpoint round trip runs it on CPU over Gloo.
DS_BUILD_OPS=0 "$PY" -m pip install -q -e ".[test,hf,lightning]" 2>&1 | grep -v -E "^WARNING: (Running pip as|Location)" || true
# bitsandbytes >= 0.50 imported on a CPU with AVX512-BF16 (by this check, or through peft / trl) looks for an
# optional kernel on the Hugging Face hub and logs "Failed to load CPU gemm_4bit_forward from kernels-community"
# without the `kernels` package; its own CPU kernels work without it, so the check silences that one message.
# (shardengine imports bitsandbytes only for a model that holds bitsandbytes layers: flat/quantized.py.)
"$PY" - <<'PY'
import logging
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: "from kernels-community" not in record.getMessage())
import shardengine, memory_estimator, hypothesis, pytest, transformers, safetensors, accelerate, peft, trl, bitsandbytes, lightning, deepspeed
PY
