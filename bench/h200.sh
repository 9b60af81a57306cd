#!/usr/bin/env bash
# The pending H200 measurements, grouped so that each group fits one 10-minute device command:
#
#   bash bench/h200.sh models    # grouped-matmul test on the GPU, full prefill of the 35B-A3B shape (+ per-layer
#                                # times), the same prefill through transformers (needs the fla wheels in .whl/)
#   bash bench/h200.sh pic       # TTFT of every PIC mode, 64 x 512 + 64 tokens, warm cache
#   bash bench/h200.sh kernels   # fla side by side (needs its wheels in .whl/) + every Pallas variant
#                                # (ALL_SECTIONS="varlen decode" picks run_all's sections; FLA_TIMEOUT and
#                                # KERNEL_TIMEOUT bound the two processes)
#   bash bench/h200.sh focus     # compose fold variants, GDN per-kernel breakdown
#   bash bench/h200.sh explore   # chunk-128 launches, composition bar folds, stream overlap under the latency-hiding
#                                # scheduler
#   bash bench/h200.sh ncucompose  # Nsight Compute: the split-operand composition fold (Triton, Mosaic GPU)
#   bash bench/h200.sh tensorpipe  # Nsight Compute: tensor-core instruction kinds (gmma / hmma) per GDN kernel
#   bash bench/h200.sh profile   # fla at 8k/32k/128k, run_all's steps (the default also at 8k and 128k), then
#                                # Nsight Compute counters of the GDN forward (PROFILES="default emit", NCU_FLA=1)
#   bash bench/h200.sh variants  # trr and full recompute, then trr under each speed knob of the engine
#   bash bench/h200.sh tune      # the request's GPU kernels alone with launch variants, then trr + full, traced
#   bash bench/h200.sh bars      # the three modes the PIC bars compare, one process, with the host split, traced
#   bash bench/h200.sh sweeps    # MoE tiling and span fold variants alone, then the GDN/KDA kernel table
#   bash bench/h200.sh close     # the bars' three modes, then GDN at 32k against fla (default launch, +TS, pieces)
#   bash bench/h200.sh layers    # compose bar variants, then the bars with the span program's HLO and trace kept
#   bash bench/h200.sh final     # the bars' three modes, then the varlen and decode kernels
#   bash bench/h200.sh pending   # what is untimed so far: final-state compose fold, packed-heads attention alone,
#                                # then in the request

# Output goes to $OUT (the device tool's result folder) or ./bench-out. Peaks are the ones measured on the H200
# on 2026-11-29 (bf16 8192^3 matmul 793 TFLOP/s, 4.19 TB/s copy bandwidth); re-measure them if the machine differs.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
OUT=${OUT:-bench-out}
mkdir -p "$OUT"
export XLA_FLAGS="${XLA_FLAGS:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$OUT/gpu.txt"

bar_modes() {  # the three modes the PIC bars compare, one process, traced; $1: its time limit, $2: the summary's
  timeout "$1" python3 bench/pic_ttft.py --bandwidth-tbs 4.19 --peak-tflops 793 \
    --modes transition_rope_recompute prefix_cache full_recompute ${PIC_ARGS:-} --profile-dir /tmp/pic-trace 2>&1 \
    | tee "$OUT/pic_ttft.txt"
  timeout "$2" python3 bench/trace_summary.py /tmp/pic-trace/transition_rope_recompute --top 60 \
    > "$OUT/pic_trace_summary.txt" 2>&1
  # the trr trace itself, for per-layer kernel counts
  find /tmp/pic-trace/transition_rope_recompute -name "*.json.gz" -exec cp {} "$OUT/trr_trace.json.gz" \; -quit
}

case "${1:-}" in
  models)
    # the Pallas grouped matmul against ragged_dot, compiled for the GPU (the MoE path of every prefill below)
    timeout 90 python3 -m pytest -q -x -p no:cacheprovider tests/test_grouped_matmul.py 2>&1 | tail -3 \
      | tee "$OUT/gmm_test.txt"
    timeout 300 python3 bench/prefill.py --lengths 8192 32768 --peak-tflops 793 --breakdown 2>&1 \
      | tee "$OUT/prefill.txt"
    # the same shape through transformers (fla kernels from the carried wheels), in its own process after ours
    if ls .whl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl
      PYTHONPATH=.:/tmp/site timeout 200 python3 bench/transformers_prefill.py --lengths 8192 32768 2>&1 \
        | tee "$OUT/transformers_prefill.txt"
    fi
    ;;
  pic)
    timeout 120 python3 bench/gpu_smoke.py 2>&1 | tee "$OUT/gpu_smoke.txt" || exit 1
    # the modes the bars compare first: each row is printed as soon as it is measured; the optimized HLO of the
    # span programs is dumped so that the trace summary can group device time by the model's named scopes
    XLA_FLAGS="$XLA_FLAGS --xla_dump_to=/tmp/pic-hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*span_forward.*" \
      timeout 500 python3 bench/pic_ttft.py --bandwidth-tbs 4.19 --peak-tflops 793 --modes transition_rope_recompute \
      prefix_cache full_recompute transition_rope transition addition --profile-dir /tmp/pic-trace 2>&1 \
      | tee "$OUT/pic_ttft.txt"
    # one traced warm request per mode, summarised on the device (the raw traces are large)
    timeout 60 python3 bench/trace_summary.py /tmp/pic-trace --top 40 --hlo /tmp/pic-hlo > "$OUT/pic_trace_summary.txt" 2>&1
    ;;
  tune)
    # the request's kernels alone with their launch variants (cheap), then the chosen modes side by side, traced
    # (PIC_ARGS="--variants noseamfold" adds trr without the seam fold, the path before it, for the ratio;
    # KERNEL_SECTIONS="moe span" limits the kernel part to those sections)
    timeout "${KERNEL_TIMEOUT:-110}" python3 bench/pic_kernels.py --out "$OUT" --budget-s "${KERNEL_BUDGET:-80}" \
      ${KERNEL_SECTIONS:+--sections $KERNEL_SECTIONS --skip-compose-bar} > "$OUT/pic_kernels.txt" 2>&1
    XLA_FLAGS="$XLA_FLAGS --xla_dump_to=/tmp/pic-hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*span_forward.*" \
      timeout "${PIC_TIMEOUT:-330}" python3 bench/pic_ttft.py --bandwidth-tbs 4.19 --peak-tflops 793 \
      --modes ${PIC_MODES:-transition_rope_recompute full_recompute} --profile-dir /tmp/pic-trace \
      ${PIC_ARGS:-} 2>&1 | tee "$OUT/pic_ttft.txt"
    timeout 60 python3 bench/trace_summary.py /tmp/pic-trace --top 45 --hlo /tmp/pic-hlo > "$OUT/pic_trace_summary.txt" 2>&1
    ;;
  bars)
    bar_modes "${PIC_TIMEOUT:-530}" 50
    ;;
  close)
    # one command for both issues: the three modes the PIC bars compare (traced), then the GDN forward at 32k,
    # fla's chunk_gated_delta_rule (from the carried wheels) and the default Pallas launch with (T, S) and pieces
    bar_modes "${PIC_TIMEOUT:-340}" 40
    if ls .whl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl
      PYTHONPATH=.:/tmp/site timeout 90 python3 bench/kernels.py --fla-only --out "$OUT" --lengths 32768
    fi
    timeout 120 python3 bench/kernels.py --out "$OUT" --lengths 32768 --check-length 32768 --budget-s 90 \
      --only "pallas tile c32 bv32 bf16 s3,pallas tile c32 bv32 bf16 s3 +TS,pallas P2 tile c32 bv32 bf16 s3,pallas P4 tile c32 bv32 bf16 s3,pallas P4 tile c32 bv32 bf16 s3 +TS" \
      > "$OUT/kernels.txt" 2>&1
    ;;
  pending)
    # added after the last device run, untimed: the final-state fold at the composition bar and the packed-heads
    # attention alone (their launch variants), then the bars' three modes with trr again under attention_pack_gqa
    timeout 200 python3 bench/pic_kernels.py --out "$OUT" --sections bar attention --budget-s 170 \
      > "$OUT/pic_kernels.txt" 2>&1
    PIC_ARGS="--variants packgqa ${PIC_ARGS:-}" bar_modes "${PIC_TIMEOUT:-400}" 40
    ;;
  layers)
    # the composition bar's final-state fold variants, then the bars' three modes (PIC_ARGS adds trr variants) with
    # the span program's optimized HLO kept beside the trace: fusion names in the trace map to ops and layers there
    timeout 100 python3 bench/pic_kernels.py --out "$OUT" --sections bar --budget-s 70 > "$OUT/pic_kernels.txt" 2>&1
    saved_flags=$XLA_FLAGS
    export XLA_FLAGS="$XLA_FLAGS --xla_dump_to=/tmp/pic-hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*span_forward.*"
    bar_modes "${PIC_TIMEOUT:-450}" 40
    export XLA_FLAGS=$saved_flags
    for f in $(ls -t /tmp/pic-hlo/*span_forward*after_optimizations.txt 2>/dev/null | head -2); do
      gzip -c "$f" > "$OUT/$(basename "$f").gz"
    done
    ;;
  final)
    # the bars' three modes (traced), then the packed-segment and decode kernels of issue 5 (untimed so far)
    bar_modes "${PIC_TIMEOUT:-300}" 30
    timeout 120 python3 bench/kernels.py --all --out "$OUT" --check-length 32768 --budget-s 90 \
      --sections varlen decode > "$OUT/kernels_varlen_decode.txt" 2>&1
    ;;
  sweeps)
    # MoE first: the span fold variants compile for 6-12 s each and used up the last run's budget
    timeout 200 python3 bench/pic_kernels.py --out "$OUT" --sections moe span --budget-s 170 --skip-compose-bar \
      > "$OUT/pic_kernels.txt" 2>&1
    timeout 330 python3 bench/kernels.py --all --out "$OUT" --check-length 32768 --budget-s 280 \
      > "$OUT/kernels_all.txt" 2>&1
    ;;
  variants)
    # one process: trr and full recompute side by side, then trr under each knob on the warm cache
    timeout "${PIC_TIMEOUT:-520}" python3 bench/pic_ttft.py --bandwidth-tbs 4.19 --peak-tflops 793 \
      --modes transition_rope_recompute full_recompute --variants ${VARIANTS:-noseamfold attn1 block0} 2>&1 \
      | tee "$OUT/pic_variants.txt"
    ;;
  kernels)
    if ls .whl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=.:/tmp/site
      timeout "${FLA_TIMEOUT:-120}" python3 bench/kernels.py --fla-only --out "$OUT" --lengths 32768
    fi
    timeout "${KERNEL_TIMEOUT:-450}" python3 bench/kernels.py --all --out "$OUT" --check-length 32768 \
      --budget-s "$(( ${KERNEL_TIMEOUT:-450} - 30 ))" ${ALL_SECTIONS:+--sections $ALL_SECTIONS}
    ;;
  explore)
    # fla at 32k, the chunk-128 launches beside the default (whole forward and kernel by kernel), the composition
    # bar's folds (the joint pair layout it timed in the ninth session is at commit 1fe9e81), and the stream-overlap
    # trial under XLA's latency-hiding scheduler
    if ls .whl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl
      PYTHONPATH=.:/tmp/site timeout "${FLA_TIMEOUT:-80}" python3 bench/kernels.py --fla-only --out "$OUT" \
        --lengths 32768 > "$OUT/fla.txt" 2>&1
    fi
    steps="tile c64 lw4 prefetch,tile c128 lw8 ss1,doubling c128 sub64 lw4 ss1,doubling c128 sub64 lw8 ss1"
    timeout "${KERNEL_TIMEOUT:-170}" python3 bench/kernels.py --all --sections steps --out "$OUT" --check-length 32768 \
      --budget-s "$(( ${KERNEL_TIMEOUT:-170} - 20 ))" --only "$steps" --split "$steps" > "$OUT/kernels_steps.txt" 2>&1
    timeout "${BAR_TIMEOUT:-130}" python3 bench/pic_kernels.py --out "$OUT" --sections bar \
      --budget-s "$(( ${BAR_TIMEOUT:-130} - 40 ))" > "$OUT/pic_kernels.txt" 2>&1
    XLA_FLAGS="$XLA_FLAGS --xla_gpu_enable_latency_hiding_scheduler=true" OVERLAP_SCHEDULE=1 \
      timeout "${OVERLAP_TIMEOUT:-70}" python3 bench/overlap_gdn.py --out "$OUT" --parts 1,2,4 > "$OUT/overlap.txt" 2>&1
    ;;
  ncucompose)
    # Nsight Compute on one warm split-operand composition fold at the composition bar's shape: the composed state
    # and the pair under Triton, then under Mosaic GPU (COMPOSE_KINDS), one text report each
    for kind in ${COMPOSE_KINDS:-final pairs mgpu-final mgpu-pairs}; do
      XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="$XLA_FLAGS --xla_gpu_enable_command_buffer=" \
        timeout "${NCU_TIMEOUT:-120}" ncu --profile-from-start off --clock-control none --kernel-name regex:compose \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section LaunchStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        python3 bench/ncu_gdn.py --impl compose --compose-kind "${kind/-/ }" > "$OUT/ncu_compose_$kind.txt" 2>&1
    done
    ;;
  tensorpipe)
    # which tensor-core instructions each GDN kernel issues (Hopper's warpgroup MMA "gmma" against the per-warp
    # "hmma") and how busy each pipe is: one warm forward of ours, then fla's, under Nsight Compute (jax 0.11.2's
    # XLA dumps no PTX or LLVM IR of the Triton kernels with --xla_dump_to, so the counters answer it)
    metrics="regex:sm__inst_executed_pipe_tensor.*\.sum$,regex:sm__pipe_tensor.*cycles_active\.avg\.pct_of_peak_sustained_active$"
    metrics="$metrics,smsp__inst_executed.sum,gpu__time_duration.sum"
    XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="$XLA_FLAGS --xla_gpu_enable_command_buffer=" \
      timeout "${NCU_TIMEOUT:-120}" ncu --profile-from-start off --clock-control none --kernel-name regex:gdn \
      --metrics "$metrics" python3 bench/ncu_gdn.py --impl pallas > "$OUT/ncu_tensorpipe_pallas.txt" 2>&1
    if ls .whl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl
      PYTHONPATH=.:/tmp/site timeout "${NCU_TIMEOUT:-120}" ncu --profile-from-start off --clock-control none \
        --metrics "$metrics" python3 bench/ncu_gdn.py --impl fla > "$OUT/ncu_tensorpipe_fla.txt" 2>&1
    fi
    ;;
  profile)
    # fla's timings (FLA_LENGTHS, default 8k, 32k and 128k; from the carried wheels), run_all's sections
    # (ALL_SECTIONS, default: steps, with the default launch also timed at STEP_LENGTHS) for KERNEL_TIMEOUT, the
    # decode step under Mosaic GPU (with MOSAIC_TIMEOUT), then Nsight Compute's counters of one warm GDN forward at 32k per PROFILES entry ("default"; "emit" adds (T, S);
    # our kernels only, XLA's memory pool and command buffers off) and, with NCU_FLA=1, of fla's, as text
    if ls .whl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl
      PYTHONPATH=.:/tmp/site timeout "${FLA_TIMEOUT:-120}" python3 bench/kernels.py --fla-only --out "$OUT" \
        --lengths ${FLA_LENGTHS:-8192,32768,131072}
    fi
    timeout "${KERNEL_TIMEOUT:-250}" python3 bench/kernels.py --all --out "$OUT" --check-length 32768 \
      --budget-s "$(( ${KERNEL_TIMEOUT:-250} - 30 ))" --sections ${ALL_SECTIONS:-steps} \
      --step-lengths ${STEP_LENGTHS:-8192,131072}
    if [ -n "${MOSAIC_TIMEOUT:-}" ]; then  # the decode step under Mosaic GPU beside the Triton kernel
      timeout "$MOSAIC_TIMEOUT" python3 bench/mosaic_decode.py --out "$OUT" > "$OUT/mosaic_decode.txt" 2>&1
    fi
    sections="--section SpeedOfLight --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis"
    sections="$sections --section ComputeWorkloadAnalysis --section SchedulerStats --section WarpStateStats"
    for variant in ${PROFILES:-}; do
      flags=""
      [ "$variant" = emit ] && flags="--emit"
      XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="$XLA_FLAGS --xla_gpu_enable_command_buffer=" \
        timeout "${NCU_TIMEOUT:-100}" ncu --profile-from-start off --clock-control none --kernel-name regex:gdn \
        --print-details all $sections python3 bench/ncu_gdn.py --impl pallas $flags \
        > "$OUT/ncu_pallas_$variant.txt" 2>&1
    done
    if [ -n "${NCU_FLA:-}" ] && [ -d /tmp/site ]; then
      PYTHONPATH=.:/tmp/site timeout "${NCU_TIMEOUT:-100}" ncu --profile-from-start off --clock-control none \
        --print-details all $sections python3 bench/ncu_gdn.py --impl fla > "$OUT/ncu_fla.txt" 2>&1
    fi
    ;;
  focus)
    # the compose fold variants (block_w 128 reads each T once), the GDN per-kernel breakdown, slow-gate T check
    timeout 300 python3 bench/kernels.py --focus --out "$OUT" --budget-s 240
    ;;
  *)
    echo "usage: bash bench/h200.sh models|pic|kernels|focus|profile|variants|tune|bars|sweeps|close|pending|layers|final" >&2
    exit 2
    ;;
esac
