"""Registers, spills and shared memory of our Pallas Triton kernels, on a machine with no GPU.

Pallas lowers a kernel to Triton IR for an abstract H200 (as `tests/pallas_kernels/
test_lowers_for_cuda.py` does); this script captures that IR and compiles it with pip's `triton`
(which bundles LLVM and ptxas) for sm_90a, then reads ptxas's resource report.  It is a proxy:
jaxlib builds its own Triton, so counts differ by a few registers (KDA decode at 32 columns / 4
warps: 64 here, 70 under Nsight Compute on an H100), but spills and their direction of change
show before any device time.  fla's decode kernel compiles beside ours when fla's source is on
the path (the wheel unpacked), with the constants its decode call uses.

    pip install --target /tmp/tritonpkg triton==3.6.0         # once; the CPU wheel has ptxas
    PYTHONPATH=$PWD:/tmp/tritonpkg python benchmarks/ptxas_probe.py [--what decode,intra] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax.sharding import AbstractDevice, AbstractMesh, AxisType

from benchmarks import common

S = jax.ShapeDtypeStruct
BF16, F32, I32 = jnp.bfloat16, jnp.float32, jnp.int32
H200 = AbstractMesh((1,), ("x",), (AxisType.Explicit,),
                    abstract_device=AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu"))


def triton_ir(fn, *shapes) -> list[str]:
    """The Triton IR (text) of every Pallas Triton kernel `fn` lowers to, in launch order."""
    import jax._src.pallas.triton.pallas_call_registration as reg

    captured, lower = [], reg.lowering.lower_jaxpr_to_triton_module

    def capture(*a, **k):
        res = lower(*a, **k)
        captured.append(res.module.operation.get_asm(enable_debug_info=False))
        return res

    reg.lowering.lower_jaxpr_to_triton_module = capture
    try:
        with jax.sharding.use_abstract_mesh(H200):
            jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",))
    finally:
        reg.lowering.lower_jaxpr_to_triton_module = lower
    return captured


def _ptxas_report(ptx: str) -> dict:
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    out = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    text = out.stdout + out.stderr
    num = lambda pat: int(m[1]) if (m := re.search(pat, text)) else 0
    return dict(registers=num(r"Used (\d+) registers"), spill_stores_b=num(r"(\d+) bytes spill stores"),
                spill_loads_b=num(r"(\d+) bytes spill loads"), stack_b=num(r"(\d+) bytes stack frame"))


def compile_ir(ir_text: str, num_warps: int, num_stages: int = 1) -> dict:
    """ptxas's report for Triton IR text compiled for sm_90a at num_warps / num_stages."""
    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.NamedTemporaryFile("w", suffix=".ttir", delete=False) as f:
        f.write(ir_text)
    try:
        kern = triton.compile(f.name, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=num_warps, num_stages=num_stages))
    finally:
        os.unlink(f.name)
    return dict(_ptxas_report(kern.asm["ptx"]), shared_b=kern.metadata.shared, num_warps=num_warps)


def blocks_per_sm(registers: int, num_warps: int, regs_per_sm: int = 65536) -> int:
    """Resident blocks an SM's register file allows (allocation in units of 256 a warp)."""
    per_warp = -(-registers * 32 // 256) * 256
    return regs_per_sm // (per_warp * num_warps)


def decode_rows(b=256, h=32, d=128, tilings=((64, 8), (32, 4), (64, 4), (32, 2), (32, 1))):
    from pallas_kernels import kda

    rows = []
    for bv, warps in tilings:
        fn = lambda q, k, v, g, beta, pool, slots, n_acc, bv=bv, warps=warps: kda._fused_recurrent_core(
            q, k, v, g, beta, pool, slots, n_acc, scale=d ** -0.5, block_v=bv, interpret=False, num_warps=warps)
        (ir,) = triton_ir(fn, *[S((b, 1, h, d), BF16)] * 4, S((b, 1, h), BF16), S((2 * b, h, d, d), F32),
                          S((b,), I32), S((b,), I32))
        rows.append(dict(kernel="kda_fused_recurrent", tiling=f"block_v {bv}, {warps} warps", **compile_ir(ir, warps)))
    fla = _fla_decode()
    if fla:
        rows.append(fla)
    return rows


def _fla_decode() -> dict | None:
    """fla 0.6's `fused_recurrent_kda_fwd_kernel` with its decode call's constants (BV 32, 4 warps,
    2 stages; a state pool by slot, in place, as vLLM calls it); None without fla's source.  fla
    imports torch at package level, so the kernel's source is compiled from its file directly."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("fla")
        root = list(spec.submodule_search_locations or [])[:1] if spec else []
        path = os.path.join(root[0], "ops", "kda", "fused_recurrent.py") if root else None
    except (ImportError, ValueError):
        path = None
    if not path or not os.path.exists(path):
        return None
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = open(path).read()
    body = src[src.index("@triton.heuristics"):src.index("@dispatch('kda')")]
    with tempfile.NamedTemporaryFile("w", suffix="_fla_kda.py", delete=False, dir=tempfile.gettempdir()) as f:
        f.write("import triton, triton.language as tl\n@triton.jit\ndef exp(x): return tl.exp(x.to(tl.float32))\n"
                "@triton.jit\ndef softplus(x): return tl.where(x < 20.0, tl.log(1 + tl.exp(x)), x)\n" + body)
    spec = importlib.util.spec_from_file_location("_fla_kda_probe", f.name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    kern = mod.fused_recurrent_kda_fwd_kernel.fn
    names = list(kern.arg_names)
    ptrs = dict(q="*bf16", k="*bf16", v="*bf16", g="*bf16", beta="*bf16", o="*bf16", h0="*fp32", ht="*fp32",
                ssm_state_indices="*i32")
    sig = {n: ptrs.get(n, "i64" if n in ("N", "T") else "constexpr") for n in names}
    kv, hv = 128, 32
    const = dict(A_log=None, dt_bias=None, cu_seqlens=None, num_accepted_tokens=None, lower_bound=None,
                 scale=kv ** -0.5, H=hv, HV=hv, K=kv, V=kv, BK=kv, BV=32, stride_init_state_token=hv * kv * kv,
                 stride_final_state_token=hv * kv * kv, stride_indices_seq=1, stride_indices_tok=1,
                 USE_INITIAL_STATE=True, INPLACE_FINAL_STATE=True, IS_BETA_HEADWISE=False,
                 USE_QK_L2NORM_IN_KERNEL=False, IS_VARLEN=False, IS_CONTINUOUS_BATCHING=True, IS_SPEC_DECODING=False,
                 STORE_FINAL_STATE=True, HAS_A=False, HAS_BIAS=False, USE_GATE_IN_KERNEL=False, USE_LOWER_BOUND=False,
                 APPLY_BETA_SIGMOID=False, ALLOW_NEG_EIGVAL=False, STATE_V_FIRST=False, num_stages=2)
    source = ASTSource(fn=kern, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=2))
    os.unlink(f.name)
    return dict(kernel="fla fused_recurrent_kda_fwd_kernel (pooled, in place)", tiling="BV 32, 4 warps, 2 stages",
                **_ptxas_report(compiled.asm["ptx"]), shared_b=compiled.metadata.shared, num_warps=4)


def intra_rows(t=1024, h=4, d=128, warps=(4, 8, 16)):
    """The prefill's kernels (ours, bf16, a state every 128 tokens) at each intra warp count."""
    from pallas_kernels import kda

    rows = []
    for w in warps:
        tuning = {"intra": (w, 1)}
        fn = lambda q, k, v, g, beta, tu=tuning: kda.chunk_kda(
            q, k, v, g, beta, output_final_state=True, checkpoint_positions=list(range(128, t + 1, 128)),
            interpret=False, tuning=tu)
        irs = triton_ir(fn, *[S((1, t, h, d), BF16)] * 3, S((1, t, h, d), F32), S((1, t, h), BF16))
        names = [re.search(r"tt\.func (?:public )?@(\w+)", ir)[1] for ir in irs]
        for name, ir in zip(names, irs):
            if "intra" in name or w == warps[0]:  # the other kernels once
                warps_stages = tuning["intra"] if "intra" in name else kda._tuned(None)[
                    "solve" if "solve" in name else "state"]
                rows.append(dict(kernel=name, tiling=f"{w} warps" if "intra" in name else "default",
                                 **compile_ir(ir, *warps_stages)))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--what", default="decode,intra")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    try:
        import triton  # noqa: F401
    except ImportError:
        sys.exit("ptxas_probe needs pip's triton (pip install --target /tmp/tritonpkg triton==3.6.0; on PYTHONPATH)")
    rows = []
    for what in args.what.split(","):
        rows += {"decode": decode_rows, "intra": intra_rows}[what]()
    for r in rows:
        r["blocks_per_sm_by_registers"] = blocks_per_sm(r["registers"], r["num_warps"])
        print(r, flush=True)
    common.write_results(args.out, "ptxas_probe", rows)


if __name__ == "__main__":
    main()
