#!/usr/bin/env bash
# The GPU check (issue 11): gpu tests, the three benches and a 200-step paper-shape training
# run of dense and fib-linear on one CUDA machine, in under 8 minutes; one JSON summary.
# Usage: scripts/gpu_check.sh [--out DIR] [--budget SECONDS] [--quick]   (see scripts/gpu_check.py)
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" scripts/gpu_check.py "$@"
