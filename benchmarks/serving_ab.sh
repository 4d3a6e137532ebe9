#!/usr/bin/env bash
# Same-call A/B of the decode step: `serving_bench.py` in each tree, interleaved, ROUNDS rounds
# (this GPU's spread between calls is +-5-10%: compare trees within one call only).
#
#   git archive <rev> kimik3 pallas_kernels serving cache sharding benchmarks | tar -x -C ab/<name>
#   benchmarks/serving_ab.sh OUT ROUNDS . ab/old ...      (on the GPU machine; ab/ is git-ignored)
#
# Each line: tree, round, then per batch (B1, B32): async ms, program ms, launches.  The full
# tables land in OUT/<tree>_<round>.log.
set -uo pipefail
out=$1; rounds=$2; shift 2
mkdir -p "$out"
export XLA_PYTHON_CLIENT_PREALLOCATE=false
for r in $(seq 1 "$rounds"); do
  for tree in "$@"; do
    d=$(cd "$tree" && pwd); name=$(basename "$d"); [ "$tree" = "." ] && name=head
    log="$out/${name}_$r.log"
    (cd "$d" && PYTHONPATH="$d" timeout 120 python3 benchmarks/serving_bench.py --modes "" --loads 32 \
      --decode-batches 1,32 --out "/tmp/serving_ab/${name}_$r" > "$log" 2>&1)
    echo "$name $r $(grep -E '^\| B(1|32) ctx' "$log" | sort -u | awk -F'|' '{printf "%s async %s program %s launches %s; ", $2, $4, $8, $16}')" \
      | tee -a "$out/ab.txt"
  done
done
