#!/usr/bin/env bash
# The GPU benchmarks of bench/RESULTS.md, as recipes for one NVIDIA H200 (run from the repository root):
#
#   bash bench/h200.sh models    # full prefill of the Qwen3.5-35B-A3B shape (+ per-layer pieces), then the same
#                                # prefill through transformers (with fla's kernels when their wheels are in .whl/)
#   bash bench/h200.sh pic       # GPU kernel check, then the TTFT of every PIC mode (64 x 512 + 64 tokens, warm
#                                # cache), one traced request per mode, summarised
#   bash bench/h200.sh kernels   # fla's kernels (wheels in .whl/), then ours: GDN and KDA forward with and without
#                                # (T, S) at 8k/32k/128k, packed segments, the composition of 64 segments
#   bash bench/h200.sh all       # the three in turn
#
# Output goes to $OUT (default ./bench-out); scratch files (traces, HLO dumps, the fla install) to $SCRATCH (default:
# a new temporary folder). Each step runs under `timeout` with the limit of its *_TIMEOUT variable in seconds
# (default 0: no limit); every script prints its rows as it measures them, so a step cut short still reports.
# The peaks are the ones measured on the H200 (PEAK_TFLOPS, bf16 matmul: 793; BANDWIDTH_TBS, copy: 4.19); set
# others if the machine differs.
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=. XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
export XLA_FLAGS="${XLA_FLAGS:-}"
OUT=${OUT:-bench-out}
SCRATCH=${SCRATCH:-$(mktemp -d)}
PEAK_TFLOPS=${PEAK_TFLOPS:-793} BANDWIDTH_TBS=${BANDWIDTH_TBS:-4.19}
PEAKS="--bandwidth-tbs $BANDWIDTH_TBS --peak-tflops $PEAK_TFLOPS"
mkdir -p "$OUT" "$SCRATCH"

machine() {
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"
}

fla_wheels() {  # install the carried fla wheels into $SCRATCH/site (offline); false when there are none
  ls .whl/*.whl >/dev/null 2>&1 || return 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SCRATCH/site" \
    .whl/*.whl
}

models() {
  timeout "${PREFILL_TIMEOUT:-0}" python3 bench/prefill.py --lengths 8192 32768 --peak-tflops "$PEAK_TFLOPS" \
    --breakdown 2>&1 | tee "$OUT/prefill.txt"
  # the same shape through transformers, in its own process after ours (each needs most of the GPU's memory)
  if fla_wheels; then
    PYTHONPATH=.:$SCRATCH/site timeout "${HF_TIMEOUT:-0}" python3 bench/transformers_prefill.py --lengths 8192 32768 \
      2>&1 | tee "$OUT/transformers_prefill.txt"
  else
    echo "no fla wheels in .whl/: transformers would run its slow GDN fallback; skipped" \
      | tee "$OUT/transformers_prefill.txt"
  fi
}

pic() {
  timeout "${SMOKE_TIMEOUT:-0}" python3 bench/gpu_smoke.py 2>&1 | tee "$OUT/gpu_smoke.txt" || return 1
  # each row is printed as soon as it is measured; the optimized HLO of the span programs is dumped so that the
  # trace summary can group GPU time by the model's named scopes
  local dump="--xla_dump_to=$SCRATCH/pic-hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*span_program.*"
  XLA_FLAGS="$XLA_FLAGS $dump" \
    timeout "${PIC_TIMEOUT:-0}" python3 bench/pic_ttft.py $PEAKS --modes transition_rope_recompute prefix_cache \
    full_recompute transition_rope transition addition --profile-dir "$SCRATCH/pic-trace" 2>&1 \
    | tee "$OUT/pic_ttft.txt"
  python3 bench/trace_summary.py "$SCRATCH/pic-trace" --top 40 --hlo "$SCRATCH/pic-hlo" \
    > "$OUT/pic_trace_summary.txt" 2>&1
  python3 bench/trace_summary.py "$SCRATCH/pic-trace/transition_rope_recompute" \
    --periods piece_fold chunk_fold positioned_attention > "$OUT/pic_trace_periods.txt" 2>&1
}

kernels() {
  if fla_wheels; then
    PYTHONPATH=.:$SCRATCH/site timeout "${FLA_TIMEOUT:-0}" python3 bench/linear_kernels.py --fla-only --out "$OUT" \
      --lengths 8192,32768,131072
  fi
  # the library's launches (GDNConfig() on Hopper, KDA's default_config(per_key=True)) at 32k, T and S on slow
  # gates, then GDNConfig() at 8k and 128k
  local gdn_ts="tile c64 lw4 mosaic both +TS group64"
  local defaults="tile c64 lw4 mosaic both,$gdn_ts,KDA doubling c16,KDA doubling c16 +TS group16"
  timeout "${KERNEL_TIMEOUT:-0}" python3 bench/linear_kernels.py --all --out "$OUT" --check-length 32768 --sections steps \
    --only "$defaults" --step-lengths 8192,131072 --length-variants "tile c64 lw4 mosaic both,$gdn_ts"
  timeout "${KERNEL_TIMEOUT:-0}" python3 bench/linear_kernels.py --all --out "$OUT" --check-length 32768 \
    --sections varlen
  # the composition of 64 segments x 30 layers x 32 heads: the composed state, the pair, every prefix state
  timeout "${BAR_TIMEOUT:-0}" python3 bench/pic_kernels.py --out "$OUT" --sections bar \
    --bar-kinds final pairs prefix
}

case "${1:-}" in
  models|pic|kernels) machine; "$1" ;;
  all) machine; models; pic; kernels ;;
  *)
    echo "usage: bash bench/h200.sh models|pic|kernels|all" >&2
    exit 2
    ;;
esac
