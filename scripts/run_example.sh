#!/usr/bin/env bash
# Sets everything up, then trains the example GPT with ZeRO stage 2 on 2 CPU
# ranks (Gloo). The example itself first prints the memory estimator's verdict
# for this configuration. Takes about 1-2 minutes on a 2-core machine.
# Extra arguments go to the example, e.g.: scripts/run_example.sh --stage 3 --steps 50
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/setup.sh
# One thread per rank: two ranks already occupy both cores; more threads oversubscribe.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$PY" -m torch.distributed.run --standalone --nproc_per_node="${NPROC:-2}" \
  examples/train_gpt.py --stage 2 --preset 1m --steps 200 --micro-batch 16 --seq-len 128 \
  --log-every 20 "$@"
