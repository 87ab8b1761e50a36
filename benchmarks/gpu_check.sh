#!/usr/bin/env bash
# The GPU check, in one command, on a machine with a CUDA GPU (see benchmarks/gpu_check.py):
#   1. the kernel and Triton-backend tests, run natively on the GPU;
#   2. the kernel benchmarks and the engine against transformers, one table in $OUT/gpu_check.md.
# Record the table, the date and the GPU in docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-check}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -c "import minserve.kernels" 2>/dev/null || python3 -m pip install -q --no-deps --no-build-isolation -e .
python3 -m pytest -q tests/test_kernels.py tests/test_triton_backend.py 2>&1 | tee "$OUT/tests.log"
python3 benchmarks/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/benchmark.log"
