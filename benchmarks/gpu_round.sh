#!/usr/bin/env bash
# One device call's worth of the kernel work still to measure (issues 20 and 22), in the order it
# matters, each step under its own time limit, results written as they come (one archive,
# $OUT/round.tgz; a step cut by its limit keeps what it printed).  On the GPU machine, from the repo root:
#
#   bash benchmarks/gpu_round.sh ROUND        (ROUND: first | second | third | fourth | fifth | sixth | seventh | eighth | ninth | tenth | eleventh | twelfth | fourteenth | seventeenth | eighteenth | nineteenth | twentieth | twentyfirst | twentysecond | twentythird | twentyfourth | twentyfifth | twentysixth | twentyseventh | twentyeighth | twentyninth | thirtieth | thirtyfirst | thirtysecond | thirtythird | xlaflags | next | must | tests | kernels | attention | serving | warmup)
#
# fla-core comes from .gpuwhl/ (git-excluded; `carry` it): pip download fla-core==0.6.0 there.
# Session 30 measured: a cold machine compiles ~15 s per GPU test, so `tests` takes most of a call.
set -uo pipefail
round=${1:?round: first, second, third, fourth, fifth, sixth, seventh, eighth, ninth, tenth, eleventh, twelfth, fourteenth, seventeenth, eighteenth, nineteenth, twentieth, twentyfirst, twentysecond, twentythird, twentyfourth, twentyfifth, twentysixth, twentyseventh, twentyeighth, twentyninth, thirtieth, thirtyfirst, thirtysecond, thirtythird, xlaflags, next, must, tests, kernels, attention, serving or warmup}
export PYTHONPATH=$PWD:/tmp/fla JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache
[ -d /tmp/fla/fla ] || python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/fla .gpuwhl/fla_core*.whl
t0=$(date +%s)
# Every step's log (and a round's bench output, where it writes under $R) lands in $R and comes back
# as one archive, $OUT/round.tgz, refreshed after each step: the device returns at most 8 files.
R=/tmp/round; mkdir -p "$R"
step() { echo "=== [$(( $(date +%s) - t0 ))s] $*" | tee -a "$R/steps.txt"; }
run() {  # run NAME SECONDS CMD...: CMD's output in $R/NAME.txt, its tail printed
  local name=$1 limit=$2; shift 2
  step "$name"
  timeout "$limit" "$@" > "$R/$name.txt" 2>&1; echo "rc=$?" >> "$R/$name.txt"
  grep -v -i "warning" "$R/$name.txt" | tail -12 | cut -c1-900
  # files past 4 MB stay behind (a dump's cubin text): the archive must come back (16 MiB a file)
  (cd "$R" && find . -type f -size -4M -print0 | tar --null -T - -czf "$OUT/round.tgz")
}
ptxas_report() {  # ptxas_report NAME: the MLA decode's registers, spills and serialization notes
  run "ptxas_$1" 60 env MOSAIC_GPU_DUMP_PTXAS=1 python3 benchmarks/ncu_probe.py --what mla_decode
  grep -a -i -E "C75|spill|registers" "$R/ptxas_$1.txt" | sort | uniq -c | head -8
}
decode_against_base() {  # decode_against_base BASE_S NOW_S CONFIGS: issue 22's MLA decode rows on base.tar's
  # tree (untracked, so it travels; `git archive COMMIT -o base.tar`) and on this one, in the same call
  mkdir -p "$R"/{dec,base}
  local rows="--sections decode --decode-heads 128,96 --decode-batches 64 --decode-contexts 8192 --decode-sq 1,4 --skip-xla-ref"
  if [ -f base.tar ]; then
    mkdir -p /tmp/base && tar -xf base.tar -C /tmp/base
    run mla_decode_base "$1" env PYTHONPATH=/tmp/base sh -c "cd /tmp/base && python3 benchmarks/mla.py $rows \
      --decode-configs hopperx64x2 --budget-s $(($1 - 20)) --out $R/base"
  fi
  run mla_decode_now "$2" python3 benchmarks/mla.py $rows --decode-configs "$3" --budget-s $(($2 - 20)) --out "$R/dec"
}
nvidia-smi -L | tee "$R/gpu.txt"
# the host decides the serving rows (a chained step is mostly host time): which CPU, and its load
(lscpu | grep -E "^(Model name|CPU\(s\)|CPU max MHz)"; uptime) | tee -a "$R/gpu.txt"
gpu_rows() {  # gpu_rows SECONDS: the GPU rows a pytest -k picks (ROWS; default the chunk kernels')
  run gpu_rows "$1" env JAX_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider \
    "tests/gpu/test_fp32_kernels.py" "tests/gpu/test_hopper_kernels.py" -k "${ROWS:-chunk}"
}
kda_prefill_sweep() {  # kda_prefill_sweep NAME SECONDS TUNINGS: kda.py's prefill section (the issue's three
  # shapes, each tuning, fla beside them, export with the best), JSON under $OUT/kdap
  mkdir -p "$OUT/kdap"
  run "$1" "$2" python3 benchmarks/kda.py --sections prefill --out "$OUT/kdap" --tunings "$3"
}
demo_variants() {  # demo_variants "name=VAR=value VAR=value;name=...": the demo once per variant (name=
  # alone: the defaults), each with its own cold compile cache and JAX's compile log
  local v name assign vs
  IFS=';' read -ra vs <<< "$1"
  for v in "${vs[@]}"; do
    name=${v%%=*}; read -ra assign <<< "${v#*=}"
    run "demo_$name" "$2" "${demo[@]}" JAX_LOG_COMPILES=1 "${assign[@]}" KIMIK3_COMPILE_CACHE="/tmp/cc_x_$name" \
      ./run.sh demo --config small
    grep -a "XLA compilation of jit(\(_forward_impl\|decode_program\))\|^| colocated |" \
      "$R/demo_$name.txt" | cut -c1-160
    grep -ao "warm-up (compiles) [0-9.]* s (engine warm-up [0-9.]* s" "$R/demo_$name.txt"
  done
}
# The README's demo command on `small` with the carried wheels (.whl: what the image lacks, grain,
# array-record, fastapi, ..., setuptools for the editable build); `"${demo[@]}" [VAR=...]
# ./run.sh demo --config small`.  Mooncake's wheel (45 MB) does not fit the 64 MiB carry beside
# them, so without it the store extra is left out and the demo skips its Mooncake mode (session 32)
demo=(env KIMIK3_INHERIT_SITE=1 KIMIK3_CUDA=local PYTHON=python3 PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.whl)
ls .whl/mooncake* >/dev/null 2>&1 || demo+=(KIMIK3_EXTRAS=${KIMIK3_EXTRAS:-serve,cuda-local})
case $round in
  first)  # when device time is short: the kernels changed since their last GPU run, then the must-shows they serve
    mkdir -p "$OUT"/{kda,kdap}
    run gpu_changed 270 env JAX_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fp32_kernels.py \
      tests/gpu/test_hopper_kernels.py -k "kda_chunk or fused_recurrent or prefill_at or chunk_over_a_cache"
    run kda_prefill 160 python3 benchmarks/kda.py --sections prefill --out "$OUT/kdap"
    run kda_decode 120 python3 benchmarks/kda.py --sections decode --out "$OUT/kda"
    ;;
  second)  # Nsight Compute on the gaps still unexplained (each probe a few launches), then MoE's k3 FFN
    mkdir -p "$OUT"/{moe,layout}
    ncu_run() {  # ncu_run NAME REGEX PROBE-ARGS...: the matching kernels' counters
      local name=$1 regex=$2; shift 2
      run "ncu_$name" 90 env XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --kernel-name "regex:$regex" \
        --launch-count 8 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section MemoryWorkloadAnalysis python3 benchmarks/ncu_probe.py "$@"
    }
    ncu_run kda '^(kda_fused_recurrent|fused_recurrent_kda_fwd_kernel)$' --what kda
    ncu_run kda_prefill '^kda_' --what kda_prefill
    ncu_run mxfp4 'mxfp4|_kernel$' --what mxfp4
    run moe_ffn 150 python3 benchmarks/moe.py --sections ffn --cases "k3 rank prefill" --out "$OUT/moe"
    run moe_layout 90 python3 benchmarks/moe_layout.py --out "$OUT/layout"
    ;;
  third)  # the MLA and MXFP4 rows still open (MLA: the dense layout; the q-tiles-first launch order, x0x1)
    mkdir -p "$OUT"/{mla,mx}
    run mla_prefill 170 python3 benchmarks/mla.py --sections prefill --prefill-configs 128x64x8x3 \
      --hopper-configs 64x128x2,64x128x2x0x1,64x128x2x1x1 --out "$OUT/mla"
    run mxfp4 200 python3 benchmarks/mxfp4_hopper.py --cases "full EP16 rank gate+up" --rows 32,256 \
      --tilings "16,128,128,4,128,0;16,128,256,4,128,0;16,64,256,4,128,0" --out "$OUT/mx"
    ;;
  must)  # the must-shows the CPU-side changes serve: MLA prefill (dense layout, q-tiles order), MoE k3
    mkdir -p "$OUT"/{mla,moe,layout}
    run mla_prefill 170 python3 benchmarks/mla.py --sections prefill --prefill-configs 128x64x8x3 \
      --hopper-configs 64x128x2,64x128x2x0x1,64x128x2x1x1 --out "$OUT/mla"
    run moe_gemm 170 python3 benchmarks/moe.py --sections gemm,ffn --cases "k3 rank prefill,small prefill T2048" \
      --out "$OUT/moe"
    run moe_layout 90 python3 benchmarks/moe_layout.py --out "$OUT/layout"
    ;;
  tests)  # every kernel changed since its last GPU run, against its reference
    run gpu_moe 220 env JAX_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_hopper.py
    run gpu_kernels 220 env JAX_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_fp32_kernels.py tests/gpu/test_hopper_kernels.py -k "kda or prefill or moe"
    run gpu_quant 120 env JAX_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider tests/gpu/test_quant_kernels.py
    ;;
  kernels)  # the must-shows' numbers, peers in the same process
    mkdir -p "$OUT"/{layout,kda,mla,moe,mx}
    run moe_layout 90 python3 benchmarks/moe_layout.py --out "$OUT/layout"
    run kda_decode 120 python3 benchmarks/kda.py --sections decode --out "$OUT/kda"
    run mla_prefill 150 python3 benchmarks/mla.py --sections prefill --prefill-configs 128x64x8x3 \
      --hopper-configs 64x128x2,64x128x2x1 --out "$OUT/mla"
    run moe_gemm 150 python3 benchmarks/moe.py --sections gemm,ffn --cases "small prefill T2048,k3 rank prefill" \
      --out "$OUT/moe"
    ;;
  attention)  # MLA decode (issue 22's matmul / copy fractions), the chunk-over-a-cache kernels, MXFP4
    mkdir -p "$OUT"/{dec,chunk,mx}
    run mla_decode 170 python3 benchmarks/mla.py --sections decode --decode-heads 16,128 --decode-batches 64 \
      --skip-xla-ref --budget-s 140 --out "$OUT/dec"
    run mla_chunk 150 python3 benchmarks/mla.py --sections chunk --budget-s 120 --out "$OUT/chunk"
    run mxfp4 170 python3 benchmarks/mxfp4_hopper.py --cases "full EP16 rank gate+up" --rows 32,256 --decodes lut \
      --tilings "16,128,256,4,128,0;16,128,256,4,128,0,0,1;16,128,256,2,128,0,0,1;16,128,128,4,128,0;16,128,128,4,128,0,0,1;16,64,256,4,128,0" \
      --out "$OUT/mx"
    ;;
  fourth)  # the ragged GEMM deriving its items in the kernel (no table before it): its GPU rows and the
    # must-show at both sizes; the H96 chunk rows
    mkdir -p "$OUT"/{moe,chunk}
    run gpu_moe 150 env JAX_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_hopper.py -k ragged
    run moe_gemm 200 python3 benchmarks/moe.py --sections gemm --cases "small prefill T2048,k3 rank prefill" --out "$OUT/moe"
    run mla_chunk 200 python3 benchmarks/mla.py --sections chunk --chunk-cases 1x2048x8192x96,1x2048x2048x96 \
      --out "$OUT/chunk"
    ;;
  fifth)  # where the MXFP4 kernels' time goes (they are not bound by bytes): the frame with the
    # cheapest decode (the codes' integers), then the counters (issue slots, stalls)
    mkdir -p "$OUT"/mx
    run gpu_mx 120 env JAX_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider tests/gpu/test_quant_kernels.py \
      -k "bit_for_bit"
    run mxfp4_probe 200 python3 benchmarks/mxfp4_hopper.py --cases "full EP16 rank gate+up" --rows 32,256 \
      --tilings "16,128,128,4,64,0,0;16,128,128,4,128,0,0;16,128,128,4,64,0,1;16,128,128,4,128,0,1;16,128,256,4,128,0,1;16,64,128,4,128,1,1" \
      --decodes bits,lut --probe-upcast --out "$OUT/mx"
    run ncu_mxfp4 200 env XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --kernel-name 'regex:_kernel$' \
      --launch-count 8 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section ComputeWorkloadAnalysis --section InstructionStats --section MemoryWorkloadAnalysis \
      python3 benchmarks/ncu_probe.py --what mxfp4
    ;;
  sixth)  # the new MXFP4 decode ("lut", PTX table lookups) and code loads (load4x), the ragged GEMM's
    # in-kernel work items: each's GPU rows first, then their numbers (sized for a short budget)
    mkdir -p "$OUT"/{mx,moe}
    run gpu_mx 100 env JAX_PLATFORMS=cuda python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_quant_kernels.py \
      -k "bit_for_bit and lut"
    run gpu_moe 90 env JAX_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_hopper.py \
      -k "ragged and 8192"
    run mxfp4_probe 120 python3 benchmarks/mxfp4_hopper.py --cases "full EP16 rank gate+up" --rows 32 \
      --tilings "16,128,128,4,64,0,0;16,128,128,4,64,0,1;16,128,128,4,128,0,1" --decodes bits,lut --probe-upcast \
      --out "$OUT/mx"
    run moe_gemm 110 python3 benchmarks/moe.py --sections gemm --cases "small prefill T2048" --out "$OUT/moe"
    ;;
  seventh)  # `sixth` without its test rows, for a budget of ~5 minutes: each bench checks every
    # candidate's output against its reference before timing it
    mkdir -p "$OUT"/{mx,moe}
    run mxfp4_probe 120 python3 benchmarks/mxfp4_hopper.py --cases "full EP16 rank gate+up" --rows 32 \
      --tilings "16,128,128,4,64,0,0;16,128,128,4,64,0,1;16,128,128,4,128,0,1" --decodes bits,lut --probe-upcast \
      --out "$OUT/mx"
    run moe_gemm 110 python3 benchmarks/moe.py --sections gemm --cases "small prefill T2048" --out "$OUT/moe"
    ;;
  next)  # what session 33 left for the device: the chunk kernel's GPU row (then `auto` can be the
    # default), the MLA decode's counters against issue 22's 65%, the ragged GEMM at the full-scale rank
    mkdir -p "$OUT"/moe
    run gpu_chunk 240 env JAX_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider tests/gpu/test_hopper_kernels.py \
      -k chunk_over_a_cache
    run ncu_mla_decode 120 env XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --profile-from-start off \
      --launch-count 4 --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section SchedulerStats --section LaunchStats --section Occupancy \
      python3 benchmarks/ncu_probe.py --what mla_decode
    run moe_gemm 150 python3 benchmarks/moe.py --sections gemm --cases "k3 rank prefill" --out "$OUT/moe"
    ;;
  eighth)  # session 34: the MXFP4 must-show with the smaller layout (issue 20), then the GPU rows of the
    # kernels changed since their last run (the shared MXFP4 scaling loop, _n_tiles), then the chunk row
    mkdir -p "$R"/mx
    run mxfp4 130 python3 benchmarks/mxfp4_hopper.py --cases "full EP16 rank gate+up" --rows 32,256 \
      --decodes lut,lut_perm --tilings "16,128,256,4,128,0;16,128,128,4,128,0;16,64,256,4,128,0" --out "$R/mx"
    mkdir -p "$R"/mxov  # the new overlap apart: a hang there keeps the rows above
    run mxfp4_overlap 90 python3 benchmarks/mxfp4_hopper.py --cases "full EP16 rank gate+up" --rows 32,256 \
      --decodes lut,lut_perm --tilings "16,128,256,4,128,0,0,1;16,128,256,2,128,0,0,1" --out "$R/mxov"
    run ptxas_mx 45 env MOSAIC_GPU_DUMP_PTXAS=1 python3 benchmarks/ncu_probe.py --what mxfp4
    grep -i -E "warn|serializ|registers|spill|stack|error" "$R/ptxas_mx.txt" | sort | uniq -c | head -20
    run gpu_mx 90 env JAX_PLATFORMS=cuda python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_quant_kernels.py \
      -k "bit_for_bit and lut"
    run gpu_moe 100 env JAX_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider tests/gpu/test_moe_hopper.py
    for c in 16-128-False 96-128-False; do  # one case a process: a hang (a barrier) shows as which
      run "gpu_chunk_$c" 55 env JAX_PLATFORMS=cuda python3 -m pytest -v -p no:cacheprovider --durations=0 \
        "tests/gpu/test_hopper_kernels.py::test_chunk_over_a_cache_at_the_models_dims_every_repeat[$c]"
    done
    ;;
  ninth)  # session 34, after lut_perm: small's chunks on the Hopper chunk kernel (now the default) in
    # an engine; lut_perm's tilings; where its time goes now (Nsight Compute on the Mosaic kernels)
    mkdir -p "$R"/mx
    run gpu_serving_chunk 200 env JAX_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider --durations=3 \
      tests/gpu/test_dispatch_and_serving.py -k chunks_over_a_cache
    run mxfp4 110 python3 benchmarks/mxfp4_hopper.py --cases "full EP16 rank gate+up" --rows 4,32,256 --decodes lut_perm \
      --tilings "16,128,256,4,128,0;16,128,256,4,256,0;16,128,512,3,256,0;16,128,256,5,128,0;16,64,256,4,128,0;16,64,256,4,128,1" \
      --out "$R/mx"
    run ncu_mxfp4 120 env XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --kernel-name 'regex:mosaic' \
      --launch-count 2 --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section ComputeWorkloadAnalysis --section InstructionStats --section MemoryWorkloadAnalysis \
      --section SchedulerStats python3 benchmarks/ncu_probe.py --what mxfp4
    ;;
  tenth)  # session 34: the Hopper chunk kernel against fp32 in `small` (whether `auto` stays the
    # default); the MLA decode without its two side kernels (queries not concatenated, one split
    # not merged): its GPU rows, then H128 / H16 B64 against issue 22's fractions
    mkdir -p "$R"/dec
    run gpu_chunk_logits 150 env JAX_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider --durations=3 \
      tests/gpu/test_dispatch_and_serving.py -k chunks_over_a_cache
    run gpu_decode 100 env JAX_PLATFORMS=cuda python3 -m pytest -q -x -p no:cacheprovider --durations=3 \
      tests/gpu/test_hopper_kernels.py -k decode_at_the_models
    run mla_decode 110 python3 benchmarks/mla.py --sections decode --decode-heads 128,16 --decode-batches 64 \
      --decode-sq 1 --decode-configs hopperx64x2 --skip-xla-ref --budget-s 90 --out "$R/dec"
    ;;
  eleventh)  # what session 34 left: the Hopper chunk kernel's logits in the model (then `auto` can be
    # KIMIK3_MLA_CHUNK's default), small's MXFP4 experts in the Hopper layout (then KIMIK3_MOE_MXFP4's),
    # the H96 Sq4 decode row of issue 22
    mkdir -p "$R"/dec
    run gpu_chunk_logits 170 env JAX_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider --durations=3 \
      tests/gpu/test_dispatch_and_serving.py -k chunks_over_a_cache
    run gpu_mx_serving 120 env JAX_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider --durations=3 \
      tests/gpu/test_quant_kernels.py -k smalls_mxfp4_experts
    run mla_decode_sq4 100 python3 benchmarks/mla.py --sections decode --decode-heads 96,128 --decode-batches 64 \
      --decode-sq 4 --decode-configs hopperx64x2 --skip-xla-ref --budget-s 80 --out "$R/dec"
    ;;
  twelfth)  # session 35: the decodes timed as their peers are (the reps launched back to back, an
    # unrolled loop; the rolled loop's XLA while beside it): MLA H128 Sq1 / H96 H128 Sq4, KDA B64-512
    mkdir -p "$R"/{dec,kda}
    run mla_decode 150 python3 benchmarks/mla.py --sections decode --decode-heads 128,96 --decode-batches 64 \
      --decode-sq 1,4 --decode-configs hopperx64x2 --skip-xla-ref --budget-s 120 --out "$R/dec"
    run kda_decode 200 python3 benchmarks/kda.py --sections decode --out "$R/kda"
    ;;
  seventeenth)  # session 37: the MLA decode with its descriptors computed in the loop (now the only
    # way; the alternating schedule deleted): ptxas' report, the GPU rows, issue 22's decode rows
    # (H128 / H96 B64 ctx8k Sq1 + Sq4, CTA pairs beside; H16 B64 ctx32k), where a tile's time goes
    # (Nsight Compute, with source-level stall sampling), then KDA decode against fla
    mkdir -p "$R"/{dec,dec32,kda}
    ptxas_report def
    run gpu_decode 200 env JAX_PLATFORMS=cuda python3 -m pytest -q -x -p no:cacheprovider --durations=3 \
      tests/gpu/test_hopper_kernels.py -k "test_decode_at or cta_pairs or suite_catches"
    run mla_decode 200 python3 benchmarks/mla.py --sections decode --decode-heads 128,96 --decode-batches 64 \
      --decode-contexts 8192 --decode-sq 1,4 --decode-configs hopperx64x2,hopperclx64x2 --skip-xla-ref \
      --budget-s 170 --out "$R/dec"
    run mla_decode_h16 90 python3 benchmarks/mla.py --sections decode --decode-heads 16 --decode-batches 64 \
      --decode-contexts 32768 --decode-sq 1 --decode-configs hopperx64x2 --skip-xla-ref --budget-s 60 --out "$R/dec32"
    run ncu_def 120 env XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none --profile-from-start off \
      --launch-count 1 --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
      --section WarpStateStats --section SchedulerStats --section SourceCounters \
      python3 benchmarks/ncu_probe.py --what mla_decode
    run kda_decode 150 python3 benchmarks/kda.py --sections decode --out "$R/kda"
    ;;
  eighteenth)  # session 37, after seventeenth: the decode's producer reading each tile's page before it
    # waits for the slot (a `prepare` hook on `hopper_ring.stream`, run uncommitted and not kept:
    # RESULTS.md), against the tree before it (base.tar:
    # `git archive 64a8535 -o base.tar`) in the same call, with deeper 32-key rings beside; the rows
    decode_against_base 120 200 hopperx64x2,hopperx32x4,hopperx32x3
    run gpu_decode 150 env JAX_PLATFORMS=cuda python3 -m pytest -q -x -p no:cacheprovider --durations=3 \
      tests/gpu/test_hopper_kernels.py -k "test_decode_at or cta_pairs"
    ;;
  nineteenth)  # session 37: the score wgmmas issued part by part, each as its part lands (FlashMLA's
    # fine-grained TMA at the three parts' granularity), against the tree before it in the same
    # call (base.tar: `git archive 875e416 -o base.tar`): ptxas first (serialization), then timings, rows
    ptxas_report now
    decode_against_base 100 100 hopperx64x2
    run gpu_decode 120 env JAX_PLATFORMS=cuda python3 -m pytest -q -x -p no:cacheprovider --durations=3 \
      tests/gpu/test_hopper_kernels.py -k "test_decode_at or suite_catches"
    ;;
  fourteenth)  # session 35: KDA prefill's state pass at B4 T8192 H12 fills 96 of 132 SMs at 64 V
    # columns a program: 32 (192 programs) and fewer stages, against the default, then all three shapes
    mkdir -p "$R"/{kdap,kdap3}
    run kda_prefill_h12 150 python3 benchmarks/kda.py --sections prefill --shapes 4x8192x12x128 \
      --tunings '[{}, {"state_block_v": 32}, {"state": [4, 2]}, {"state_block_v": 32, "state": [4, 2]}, {"state_block_v": 32, "state": [8, 2]}]' \
      --out "$R/kdap"
    run kda_prefill 200 python3 benchmarks/kda.py --sections prefill --tunings '[{}, {"state_block_v": 32}]' \
      --out "$R/kdap3"
    ;;
  twentieth)  # session 38, first call: GPU rows (ROWS, a pytest -k; default the chunk kernels'),
    # then the demo's cold warm-up with JAX's per-program timings (tracing, lowering, XLA
    # compile) in its log.  Carry .whl and .gpuwhl
    gpu_rows "${ROWS_LIMIT:-120}"
    # its log straight under $OUT: what it wrote comes back even if the device time ends mid-run
    step demo_logged
    timeout 200 "${demo[@]}" JAX_LOG_COMPILES=1 KIMIK3_COMPILE_CACHE=/tmp/cc_logged ./run.sh demo --config small \
      > "$OUT/demo_logged.txt" 2>&1; echo "rc=$?" >> "$OUT/demo_logged.txt"
    grep -v -i "warning" "$OUT/demo_logged.txt" | tail -12 | cut -c1-900
    ;;
  twentyfirst)  # session 38, second call on the same machine: small's chunk buckets on both chunk
    # kernels, then the demo's warm-up on base.tar's tree (untracked: `git archive COMMIT -o
    # base.tar`) in the .venv twentieth built, its own cold cache
    cases=1x64x0x16,1x64x4096x16,1x256x0x16,1x256x1024x16,1x256x4096x16,1x2048x8192x16,1x2048x8000x16
    mkdir -p "$R/chunk_now"
    run chunk_now 150 python3 benchmarks/mla.py --sections chunk --out "$R/chunk_now" --chunk-cases "$cases"
    if [ -f base.tar ]; then
      mkdir -p /tmp/base && tar -xf base.tar -C /tmp/base
      run demo_base 300 env JAX_LOG_COMPILES=1 KIMIK3_COMPILE_CACHE=/tmp/cc_base PYTHONPATH=/tmp/base \
        bash -c "cd /tmp/base && $PWD/.venv/bin/python -m serving.cli demo --config small --out /tmp/base_out"
    fi
    ;;
  twentysecond)  # session 38's lead for the next: what XLA's compile of a cold warm-up spends on GEMM
    # autotuning: the defaults (autotune logs dumped), no autotuning, no Triton GEMMs.  Run after
    # twentieth (its .venv); compare each program's "XLA compilation" line and the TPOTs
    demo_variants "default=XLA_FLAGS=--xla_gpu_dump_autotune_logs_to=$R/autotune_logs;level0=XLA_FLAGS=--xla_gpu_autotune_level=0;no_triton_gemm=XLA_FLAGS=--xla_gpu_enable_triton_gemm=false" 180
    ;;
  twentythird)  # session 39: the KDA prefill's intra (and solve) kernel looping over 2-8 chunks of a head with
    # Triton's pipelined loads (the issue's three shapes, against fla, export with the best), then
    # GPU rows (ROWS, a pytest -k) for whatever time is left.  Carry .gpuwhl
    kda_prefill_sweep kda_intra_loop "${KDA_LIMIT:-220}" \
      '[{}, {"intra_chunks": 2, "intra": [8, 2]}, {"intra_chunks": 4, "intra": [8, 2]}, {"intra_chunks": 4, "intra": [8, 3]}, {"intra_chunks": 8, "intra": [8, 2]}, {"intra_chunks": 4, "intra": [8, 2], "solve_chunks": 4, "solve": [4, 2]}]'
    gpu_rows "${ROWS_LIMIT:-300}"
    ;;
  twentyfourth)  # session 40: the KDA prefill's intra and solve kernels as one program (prepare_impl
    # "intra_solve": A_kk and beta exp(G) k stay on chip) at the issue's three shapes against the split
    # and fla, and the state pass unpipelined (one stage: 40 KB of shared memory, so ptxas's 246
    # registers allow 2 programs an SM where 3 stages' 200 KB fit one), export with the best; then the
    # chunk prefill's GPU rows.  Carry .gpuwhl
    kda_prefill_sweep kda_intra_solve "${KDA_LIMIT:-200}" \
      '[{}, {"prepare_impl": "intra_solve"}, {"prepare_impl": "intra_solve", "intra_solve": [8, 2]}, {"state": [4, 1]}, {"prepare_impl": "intra_solve", "state": [4, 1]}]'
    ROWS=${ROWS:-kda_chunk_prefill} gpu_rows "${ROWS_LIMIT:-240}"
    ;;
  twentyfifth)  # session 40: twentyfourth's KDA sweep, then the demo on base.tar's tree (`git archive
    # COMMIT -o base.tar`: the engine before chaining decode steps past requests waiting for a slot)
    # and on this one, sharing one compile cache (the same programs: the second run's warm-up is warm),
    # then the chunk prefill's GPU rows.  Carry .whl and .gpuwhl
    kda_prefill_sweep kda_intra_solve "${KDA_LIMIT:-200}" \
      '[{}, {"prepare_impl": "intra_solve"}, {"prepare_impl": "intra_solve", "intra_solve": [8, 2]}, {"state": [4, 1]}]'
    if [ -f base.tar ]; then
      rm -rf /tmp/base && mkdir -p /tmp/base && tar -xf base.tar -C /tmp/base
      run venv 120 "${demo[@]}" ./run.sh demo --help  # run.sh makes .venv; base's run uses it with its own code
      run demo_base "${DEMO_LIMIT:-160}" sh -c "cd /tmp/base && PYTHONPATH=/tmp/base KIMIK3_COMPILE_CACHE=/tmp/cc_ab \
        $PWD/.venv/bin/kimik3 demo --config small"
    fi
    run demo_now "${DEMO_LIMIT:-160}" "${demo[@]}" KIMIK3_COMPILE_CACHE=/tmp/cc_ab ./run.sh demo --config small
    for n in base now; do
      grep -a "^| \(colocated\|pd\)" "$R/demo_$n.txt" | cut -c1-200
      grep -ao "warm-up (compiles) [0-9.]* s (engine warm-up [0-9.]* s" "$R/demo_$n.txt"
    done
    ROWS=${ROWS:-"kda_chunk_prefill and intra_solve"} gpu_rows "${ROWS_LIMIT:-80}"
    ;;
  twentysixth)  # session 41: the demo with the engines' step profiles (host time against the wait on
    # the device, by step kind: what keeps decode-only TPOT above the program), cold, then the
    # prefill program without XLA's Triton GEMMs (KIMIK3_PREFILL_TRITON_GEMM=0), cold.  Carry .whl, .gpuwhl
    demo_variants "default=;prefill_no_triton=KIMIK3_PREFILL_TRITON_GEMM=0" "${DEMO_LIMIT:-170}"
    for n in default prefill_no_triton; do
      grep -a -A6 "^engine steps by kind" "$R/demo_$n.txt" | cut -c1-700
    done
    ;;
  twentyseventh)  # session 41: where a chained decode step's 1.5 ms of host time goes (twentysixth's
    # profile: host 1.5 + wait 0.25 ms a step): benchmarks/decode_host.py at 8 and 32 rows, with XLA's
    # CUDA graphs (command buffers) as they are and off.  Carry .whl (the venv run.sh makes)
    run venv 150 "${demo[@]}" ./run.sh demo --help
    mkdir -p "$OUT/dh"
    for v in "default=" "no_cmd_buffer=--xla_gpu_enable_command_buffer="; do
      for rows in ${DH_ROWS:-8 32}; do
        run "dh_${v%%=*}_$rows" "${DH_LIMIT:-120}" env XLA_FLAGS="${v#*=}" JAX_COMPILATION_CACHE_DIR="/tmp/jc_${v%%=*}" \
          .venv/bin/python benchmarks/decode_host.py --config small --rows "$rows" --out "$OUT/dh/${v%%=*}_$rows.json"
      done
    done
    ;;
  twentyeighth)  # session 41: the demo's colocated setup under cProfile (benchmarks/demo_profile.py): a
    # mixed step's 16 ms of host time (twentysixth), by function.  Carry .whl
    run venv 150 "${demo[@]}" ./run.sh demo --help
    run demo_profile "${PROFILE_LIMIT:-240}" env KIMIK3_COMPILE_CACHE=/tmp/cc_prof .venv/bin/python \
      benchmarks/demo_profile.py --config small --top 45 --out "$R/demo.prof"
    mkdir -p "$OUT/dh"  # and the rows' rewrite on an idle device and behind a running program
    run dh_overwrite "${DH_LIMIT:-120}" env JAX_COMPILATION_CACHE_DIR=/tmp/jc_default \
      .venv/bin/python benchmarks/decode_host.py --config small --rows 8 --out "$OUT/dh/overwrite_8.json"
    ;;
  twentyninth)  # session 41: the demo on base.tar's tree (`git archive 3614fc3 -o base.tar`: prefill
    # calls reading every chunk's logits, eager ops per chunk) and on this one, one compile cache
    # (the second warm-up is warm), with the step profiles.  Carry .whl
    rm -rf /tmp/base && mkdir -p /tmp/base && tar -xf base.tar -C /tmp/base
    run venv 120 "${demo[@]}" ./run.sh demo --help
    # where base's `serving` comes from: session 41's first try ran this tree's code as "base"
    run which_base 20 sh -c "cd /tmp/base && PYTHONPATH=/tmp/base $PWD/.venv/bin/python -c \
      'import sys, serving.model_runner as m; print(m.__file__); print(sys.path[:4]); print(sys.meta_path)'; \
      head -2 $PWD/.venv/bin/kimik3; ls $PWD/.venv/lib/python3*/site-packages | grep -i -E 'editable|kimik3|serving'"
    cat "$R/which_base.txt"
    run demo_base "${DEMO_LIMIT:-120}" sh -c "cd /tmp/base && KIMIK3_COMPILE_CACHE=/tmp/cc_ab $PWD/.venv/bin/python -c \
      \"import sys; sys.path.insert(0, '/tmp/base'); import serving; assert serving.__file__.startswith('/tmp/base'), serving.__file__; \
      from serving.cli import main; sys.argv = ['kimik3', 'demo', '--config', 'small']; sys.exit(main())\""
    run demo_now "${DEMO_LIMIT:-120}" "${demo[@]}" KIMIK3_COMPILE_CACHE=/tmp/cc_ab ./run.sh demo --config small
    for n in base now; do
      grep -a "^| \(colocated\|pd\)\|^  \(colocated\|pd\)" "$R/demo_$n.txt" | cut -c1-400
    done
    ;;
  thirtieth)  # session 42: issue 22's KDA must-shows on this tree, fla in the same process (decode at B64-512,
    # prefill with a state every 128 tokens at the three shapes), then the demo on `small` cold: the
    # warm-up with session 41's warm_moves, no compile while serving.  Carry .whl, .gpuwhl
    mkdir -p "$OUT"/{kda,kdap}
    run kda_decode "${KDA_DEC_LIMIT:-120}" python3 benchmarks/kda.py --sections decode --out "$OUT/kda"
    run kda_prefill "${KDA_LIMIT:-200}" python3 benchmarks/kda.py --sections prefill --out "$OUT/kdap"
    demo_variants "default=" "${DEMO_LIMIT:-170}"
    grep -a -A6 "^engine steps by kind" "$R/demo_default.txt" | cut -c1-700
    ;;
  thirtyfirst)  # session 42: the GPU serving rows (engines on the Pallas kernels against the oracle, the
    # speculative rounds), then issue 22's MLA decode rows (H128 / H96 B64 ctx8k Sq1 and Sq4, H16 ctx32k)
    ROWS=${ROWS:-"not chunks_over_a_cache and not mxfp4"}
    run gpu_serving "${ROWS_LIMIT:-240}" env JAX_PLATFORMS=cuda python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_dispatch_and_serving.py -k "$ROWS"
    mkdir -p "$OUT/dec"
    run mla_decode "${DEC_LIMIT:-200}" python3 benchmarks/mla.py --sections decode --decode-heads 128,96,16 \
      --decode-batches 64 --decode-contexts 8192,32768 --decode-sq 1,4 --decode-configs hopperx64x2 --skip-xla-ref \
      --budget-s $(( ${DEC_LIMIT:-200} - 20 )) --out "$OUT/dec"
    ;;
  thirtysecond)  # session 42: the demo's colocated setup under cProfile on this tree (a mixed step: 11-17 ms of
    # host against ~3.5 ms of wait in thirtieth / twentyninth), the stats file brought back; then the
    # demo with the prefill program's CUDA graphs off (KIMIK3_PREFILL_COMMAND_BUFFER=0) between two
    # default runs, one compile cache (the first default run compiles).  Carry .whl
    if [ -z "${SKIP_PROFILE:-}" ]; then
      run venv 150 "${demo[@]}" ./run.sh demo --help
      run demo_profile "${PROFILE_LIMIT:-200}" env KIMIK3_COMPILE_CACHE=/tmp/cc_42 .venv/bin/python \
        benchmarks/demo_profile.py --config small --top 60 --out "$R/demo.prof"
    fi
    for v in ${DEMO_ORDER:-default_1 prefill_no_cmd default_2}; do
      extra=(); [ $v = prefill_no_cmd ] && extra=(KIMIK3_PREFILL_COMMAND_BUFFER=0)
      run "demo_$v" "${DEMO_LIMIT:-150}" "${demo[@]}" "${extra[@]}" KIMIK3_COMPILE_CACHE=/tmp/cc_42 \
        ./run.sh demo --config small
      grep -a "^| colocated\|^| pd\|^  colocated: \|^  colocated+host: " "$R/demo_$v.txt" | cut -c1-330
    done
    ;;
  thirtythird)  # session 42: where the chain's rows rewrite waits (3.1 ms a call inside the chain, 0.4 ms
    # alone: session 41): decode_host.py's rewrite behind a chained step's work in flight, with its values
    # on the device and with its io not donated.  Carry .whl
    run venv 150 "${demo[@]}" ./run.sh demo --help
    mkdir -p "$OUT/dh"
    for rows in ${DH_ROWS:-8 32}; do
      run "dh_$rows" "${DH_LIMIT:-120}" env JAX_COMPILATION_CACHE_DIR=/tmp/jc_dh .venv/bin/python \
        benchmarks/decode_host.py --config small --rows "$rows" --out "$OUT/dh/rows_$rows.json"
    done
    ;;
  xlaflags)  # session 39: the demo's cold warm-up and TPOT under environment variants (VARIANTS, as
    # demo_variants takes them; default: prefill without Triton GEMMs, and every program without)
    demo_variants "${VARIANTS:-default=;prefill_no_triton=KIMIK3_PREFILL_TRITON_GEMM=0;no_triton=XLA_FLAGS=--xla_gpu_enable_triton_gemm=false}" 150
    ;;
  warmup)  # session 37: the demo's cold warm-up went 16.4 s (session 32) -> 37.3 s; which default
    # moved it: the demo with the MXFP4 experts on Triton, then also the chunk over a cache on
    # Triton (each with its own empty compile cache).  Carry .whl as for `serving`
    for v in mx_triton:"KIMIK3_MOE_MXFP4=triton" both_triton:"KIMIK3_MOE_MXFP4=triton KIMIK3_MLA_CHUNK=triton"; do
      run "demo_${v%%:*}" 240 "${demo[@]}" ${v#*:} KIMIK3_COMPILE_CACHE="/tmp/cc_${v%%:*}" ./run.sh demo --config small
    done
    ;;
  serving)  # what users feel: the demo on `small` with this tree's defaults.  Carry .whl (`demo` above)
    run demo 540 "${demo[@]}" ./run.sh demo --config small
    ;;
  *) echo "unknown round $round" >&2; exit 2 ;;
esac
step done
