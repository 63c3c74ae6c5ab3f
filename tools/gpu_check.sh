#!/usr/bin/env bash
# The GPU check (issue 11): gpu tests, the three benches and a 200-step paper-shape training
# run of dense and fib-linear on one CUDA machine, in under 8 minutes; one JSON summary.
# Usage: tools/gpu_check.sh [--out DIR] [--budget SECONDS] [--quick]   (see tools/gpu_check.py)
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python3}" tools/gpu_check.py "$@"
