#!/usr/bin/env bash
# The pending H200 measurements, grouped so that each group fits one 10-minute device command:
#
#   bash bench/h200.sh models    # core tests on the GPU (few hypothesis examples) + full prefill, 35B-A3B shape
#   bash bench/h200.sh pic       # TTFT of every PIC mode, 64 x 512 + 64 tokens, warm cache
#   bash bench/h200.sh kernels   # fla side by side (needs its wheels in .whl/) + every Pallas variant
#
# Output goes to $OUT (the device tool's result folder) or ./bench-out. Peaks are the ones measured on the H200
# on 2026-11-29 (bf16 8192^3 matmul 793 TFLOP/s, 4.19 TB/s copy bandwidth); re-measure them if the machine differs.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"

case "${1:-}" in
  models)
    HYPIC_EXAMPLES=2 timeout 150 python3 -m pytest -q -x -p no:cacheprovider \
      tests/test_linear_attn.py tests/test_conv_rope.py 2>&1 | tail -5 | tee "$OUT/core_tests.txt"
    timeout 400 python3 bench/prefill.py --lengths 8192 32768 --peak-tflops 793 2>&1 | tee "$OUT/prefill.txt"
    ;;
  pic)
    timeout 570 python3 bench/pic_ttft.py --bandwidth-tbs 4.19 --peak-tflops 793 2>&1 | tee "$OUT/pic_ttft.txt"
    ;;
  kernels)
    if ls .whl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=.:/tmp/site
      timeout 120 python3 bench/kernels.py --fla-only --out "$OUT" --lengths 32768
    fi
    timeout 450 python3 bench/kernels.py --all --out "$OUT" --check-length 32768 --budget-s 420
    ;;
  *)
    echo "usage: bash bench/h200.sh models|pic|kernels" >&2
    exit 2
    ;;
esac
