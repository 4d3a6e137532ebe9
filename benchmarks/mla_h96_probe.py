"""Quick H96 decode check of `mla_decode` row / value blocking (one short GPU call).

    PYTHONPATH=$PWD python3 benchmarks/mla_h96_probe.py

Loop-timed like `benchmarks/mla.py` decode rows; one row per config so the
configs can be compared (mla.py reports only the best).
"""

import time

from benchmarks import common
from benchmarks.mla import decode_rows, matmul_tflops

if __name__ == "__main__":
    bw, tf = common.copy_gbs(), matmul_tflops()
    print(f"copy {bw:.0f} GB/s, matmul {tf:.0f} TFLOP/s", flush=True)
    deadline = time.monotonic() + 100
    # (rows, warps[, value columns[, block_k[, stages]]]); 64 rows x block_k 64 x 2 stages
    # overflowed shared memory on the H200; (64, 8, 512, 32) was the best of the first probe
    # and ("hopper", block_kv, steps): the Mosaic GPU kernel (FlashMLA's layout; block_kv 32 with
    # 2-3 slots fits in shared memory at kv_lora 512), not yet run on a GPU
    for cfg in ((16, 4), (64, 8, 512, 32), ("hopper", 32, 2), ("hopper", 32, 3)):
        for row in decode_rows(bw, tf, [16], [8192], [96], configs=(cfg,), deadline=deadline):
            print(cfg, f"{row['ours_ms']:.3f} ms  {row['tflops']:.0f} TFLOP/s  {100 * row['of_matmul']:.0f}% of matmul",
                  flush=True)
