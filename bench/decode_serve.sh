#!/usr/bin/env bash
# The decode issue's GPU measurements in one command, from the repository root on one H100 or H200:
#
#   bash bench/decode_serve.sh [VARIANT...]
#
# First the batched step per bucket (`decode_step.py`): the routed experts' copies sorted by expert and one block
# per copy (`--moe-copy-blocks 0 64`), and a step with one admission of 16 cached documents of 768 tokens and a
# 64-token query, apart and in one program (`--fused-prefill 16 768 64`). Then the server on the decode issue's
# RAG trace (`serve.py`, transition_rope_recompute, 64 decode rows, 128 tokens out), once per VARIANT (default:
# fused default):
#   default      the server's defaults
#   fused        --fused-prefill-tokens 256 (an admission's stitched forward inside the decode step)
#   chunk        --prefill-chunk 1024
#   fusedchunk   both
#   compact      --compact-rows
# Layers and floor bandwidth follow the card: 40 layers at 4,800 GB/s on an H200, 20 at 3,350 GB/s on an H100
# (whose memory does not hold the 40-layer weights beside the pools); LAYERS overrides. Reports go to $OUT
# (default ./bench-out): step.json, serve_VARIANT.json and the printed tables. RATES (default "8 10 12") are the
# request rates; COMPILE_CACHE is the servers' shared compile cache folder (default: one under $TMPDIR);
# STEP_TIMEOUT and SERVE_TIMEOUT (seconds, default 0: none) bound each part. starlette and uvicorn must be
# importable (the server).
set -u -o pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}. XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  LAYERS=${LAYERS:-40}; BANDWIDTH=4800
else
  LAYERS=${LAYERS:-20}; BANDWIDTH=3350
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
echo "layers $LAYERS, floor at $BANDWIDTH GB/s" | tee -a "$OUT/gpu.txt"

timeout "${STEP_TIMEOUT:-0}" python3 bench/decode_step.py --layers "$LAYERS" --max-batch 64 --steps 10 \
  --bandwidth "$BANDWIDTH" --moe-copy-blocks 0 64 --fused-prefill 16 768 64 --json "$OUT/step.json" \
  2>&1 | tee "$OUT/step.txt"

step=()
[ -f "$OUT/step.json" ] && step=(--step-json "$OUT/step.json")
for v in ${*:-fused default}; do
  case $v in
    default) extra=() ;;
    fused) extra=(--fused-prefill-tokens 256) ;;
    chunk) extra=(--prefill-chunk 1024) ;;
    fusedchunk) extra=(--fused-prefill-tokens 256 --prefill-chunk 1024) ;;
    compact) extra=(--compact-rows) ;;
    *) echo "unknown variant $v" >&2; exit 2 ;;
  esac
  # shellcheck disable=SC2086
  timeout "${SERVE_TIMEOUT:-0}" python3 bench/serve.py --random-35b --layers "$LAYERS" --docs-per-request 16 \
    --doc-tokens 768 --max-tokens 128 --max-batch 64 --pool 150 --token-rungs 256 1024 16384 --cache-gb 12 \
    --duration 15 --warm-pool --modes transition_rope_recompute --rates ${RATES:-8 10 12} "${step[@]}" \
    --compile-cache "${COMPILE_CACHE:-${TMPDIR:-/tmp}/hypic-jax-bench-cache}" "${extra[@]}" \
    --out "$OUT/serve_$v.json" 2>&1 | tee "$OUT/serve_$v.txt"
done
