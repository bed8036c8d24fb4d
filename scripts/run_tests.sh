#!/usr/bin/env bash
# Sets everything up, then runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The docstring examples of the public entry points run too (--doctest-modules).
exec "${PYTHON:-python3}" -m pytest tests --doctest-modules shardengine memory_estimator "$@"
