"""MLA kernels on the GPU, with the peers measured in the same run.

    PYTHONPATH=$PWD python3 benchmarks/mla.py [--out DIR] [--tiny]

Decode (`mla_decode`, absorbed, paged, bf16 latent 512 + 64, page 128): B in
{1, 16, 64, 128} x context in {1k, 8k, 32k} x heads {16, 96}; reports achieved
bytes/s (latent cache + queries read, outputs written) against the XLA copy
bandwidth, and FLOP/s against a bf16 matmul measured in this run, plus the
time of the XLA reference on gathered pages.
Prefill (`mla_prefill`, naive form, qk 192 / v 128): against cuDNN doing the same work
(`cudnn_peers`: JAX's cuDNN call with v 128 and torch SDPA's cuDNN backend; the old peer with v
padded to 192, 20% more work, beside them), every side timed with calls back to back and one
sync.
Chunk (a prefill chunk continuing a cache: B1, 2048 new tokens after 0 / 2k / 8k cached,
H16 and H96): `mla_prefill_chunk` (what the model runs), its Hopper twin `mla_prefill_chunk_hopper`, the
absorbed decode kernel with Sq = 2048 and XLA's masked attention on expanded K/V, with errors
against XLA.
`--tiny` runs every code path at toy sizes in interpret mode (CPU smoke test).
"""

from __future__ import annotations

import argparse
import functools
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import common
from benchmarks.common import time_jax
from pallas_kernels import mla, mla_decode_hopper, mla_hopper
from pallas_kernels.attention import attend


def matmul_tflops(n=8192):
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    return 2 * n ** 3 / (time_jax(jax.jit(lambda x: x @ x), a) * 1e-3) / 1e12


def _best(fn_of_cfg, cfgs, record=None):
    """(ms, cfg) of the fastest config that runs; failures are reported, not fatal.  record: a dict
    that gets every config's ms (keyed by the config joined with "x", as --hopper-configs takes it)."""
    best = (None, None)
    for cfg in cfgs:
        try:
            ms = fn_of_cfg(cfg)
        except Exception as e:  # noqa: BLE001 - a config that does not compile is reported and skipped
            print(f"config {cfg} failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        print(f"config {cfg}: {ms:.3f} ms", flush=True)
        if record is not None:
            record["x".join(map(str, cfg))] = ms
        if best[0] is None or ms < best[0]:
            best = (ms, cfg)
    return best


# the Hopper decode, and with row tiles in CTA pairs ("cl")
HOPPER_DECODES = ("hopper", "hoppercl")


def decode_fn(cfg):
    """The decode kernel a config names: ("hopper", block_kv, steps) the Mosaic GPU
    kernel, or (rows, warps[, value columns[, block_k[, stages]]]) the Triton kernel."""
    if cfg[0] in HOPPER_DECODES:
        return functools.partial(mla_decode_hopper.mla_decode_hopper, block_kv=cfg[1], steps=cfg[2],
                                 cluster=2 if cfg[0] == "hoppercl" else 1)
    bm, nw, bv, bk, ns = (tuple(cfg) + (None, 64, 2)[len(cfg) - 2:])[:5]
    return functools.partial(mla.mla_decode, block_m=bm, num_warps=nw, block_v=bv, block_k=bk, num_stages=ns)


def decode_rows(bw, tflops, batches, contexts, heads, r=512, p=64, page=128, sq=1, interpret=False,
                configs=((16, 4),), deadline=float("inf"), xla_ref=True):
    rows = []
    for h in heads:
        for b in batches:
            for ctx in contexts:
                if time.monotonic() > deadline:
                    print(f"budget spent: skipping decode H{h} B{b} ctx{ctx}")
                    continue
                n_pages_seq = ctx // page
                key = jax.random.PRNGKey(b * 7 + ctx)
                pages = jax.random.normal(key, (b * n_pages_seq + 8, page, r + p), jnp.bfloat16)
                table = jax.random.permutation(key, b * n_pages_seq + 8)[:b * n_pages_seq].reshape(b, n_pages_seq)
                table = table.astype(jnp.int32)
                lens = jnp.full((b,), ctx, jnp.int32)
                ql = jax.random.normal(key, (b, sq, h, r), jnp.bfloat16)
                qp = jax.random.normal(key, (b, sq, h, p), jnp.bfloat16)
                iters = 5 if interpret else 20

                reps = 2 if interpret else 20

                rolled, by_cfg, err_by_cfg, first = [], {}, {}, []

                def run(cfg):
                    decode = decode_fn(cfg)
                    # each config's outputs against the first's (the same inputs), before any timing
                    o = np.asarray(decode(ql, qp, pages, table, lens, scale=0.1, interpret=interpret)[0], np.float32)
                    if not first:
                        first.append(o)
                    err_by_cfg["x".join(map(str, cfg))] = float(np.abs(o - first[0]).max())

                    # `reps` dependent calls in one program (each step's output is the next query), so
                    # the time is the kernel's and not Python dispatch's.  Unrolled: the calls are
                    # launched back to back, the rule every peer is timed by; a rolled loop (XLA's
                    # while, its predicate read by the host every step on the GPU) is kept beside it.
                    def loop(unroll):
                        def f(a, c, pg, t, n):
                            body = lambda _, x: decode(x, c, pg, t, n, scale=0.1, interpret=interpret)[0]
                            return jax.lax.fori_loop(0, reps, body, a, unroll=unroll)
                        return jax.jit(f)

                    ms = time_jax(loop(True), ql, qp, pages, table, lens, iters=iters) / reps
                    if not interpret and not rolled:  # the first config's, beside it
                        rolled.append(time_jax(loop(1), ql, qp, pages, table, lens, iters=iters) / reps)
                    return ms

                rows_q = sq * h
                cfgs = [c for c in configs if isinstance(c[0], str) or c[0] <= max(16, 1 << (rows_q - 1).bit_length())]
                ms, bm = _best(run, cfgs, by_cfg)
                if ms is None:
                    continue
                ref = jax.jit(lambda a, c, pg, t, n: mla.mla_decode_ref(a, c, pg, t, n, scale=0.1))
                ms_ref = time_jax(ref, ql, qp, pages, table, lens, iters=5 if interpret else 20) if xla_ref else None
                bytes_moved = b * ctx * (r + p) * 2 + ql.nbytes + qp.nbytes + b * sq * h * r * 2
                flops = 2 * b * sq * h * ctx * (r + p + r)
                gbs = bytes_moved / (ms * 1e-3) / 1e9
                tfs = flops / (ms * 1e-3) / 1e12
                rows.append(dict(section="decode", case=f"H{h} B{b} ctx{ctx} Sq{sq}", block_m_warps_v=bm, ours_ms=ms,
                                 first_config_rolled_loop_ms=(rolled or [None])[0], ms_by_config=by_cfg,
                                 max_abs_diff_vs_first_config=err_by_cfg, xla_ref_ms=ms_ref,
                                 gbs=gbs, of_copy=gbs / bw, tflops=tfs, of_matmul=tfs / tflops,
                                 bound="memory" if flops / bytes_moved < tflops * 1e3 / bw else "compute"))
                print(rows[-1], flush=True)
    return rows


def cudnn_peers(q, k, v, b: int, t: int, h: int) -> dict:
    """cuDNN flash attention on the same causal MLA prefill, timed by the same rule as ours.
    Fair peers do our work exactly (q/k 192, v 128): JAX's cuDNN call with unequal head dims
    (`fused_attention_stablehlo.dot_product_attention`: cuDNN >= 9.10 on Hopper) and torch's
    SDPA on its cuDNN backend; the old handicapped peer (`jax.nn.dot_product_attention` needs
    v's head dim equal to k's: v padded to 192, 20% more P @ V work) is kept beside them with
    its FLOP ratio.  Returns {"fair": which fair peer is fastest, "fair_ms", and each peer's
    ms or its failure}."""
    out = {}
    qb, kb, vb = q.reshape(b, t, h, 192), k.reshape(b, t, h, 192), v.reshape(b, t, h, 128)
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa

        mla_cudnn = jax.jit(lambda q, k, v: fa.dot_product_attention(q, k, v, scale=192 ** -0.5,
                                                                     mask_type=fa.MaskType.CAUSAL))
        out["jax_cudnn_v128_ms"] = common.pipelined_ms(mla_cudnn, qb, kb, vb)
    except Exception as e:  # noqa: BLE001 - report, keep going
        out["jax_cudnn_v128_failed"] = repr(e)[:200]
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        tq, tk, tv = (torch.from_dlpack(a).permute(0, 2, 1, 3) for a in (qb, kb, vb))  # [B, H, T, D]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            call = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True,
                                                                             scale=192 ** -0.5)
            out["torch_cudnn_v128_ms"] = common.time_torch_pipelined(call)
    except Exception as e:  # noqa: BLE001
        out["torch_cudnn_v128_failed"] = repr(e)[:200]
    try:
        padded = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=192 ** -0.5,
                                                                       implementation="cudnn"))
        v_pad = jnp.pad(vb, ((0, 0), (0, 0), (0, 0), (0, 64)))  # padded once, outside the timing
        out["jax_cudnn_v192_padded_ms"] = common.pipelined_ms(padded, qb, kb, v_pad)
        out["padded_flop_ratio"] = (192 + 192) / (192 + 128)
    except Exception as e:  # noqa: BLE001
        out["jax_cudnn_v192_padded_failed"] = repr(e)[:200]
    fair = {name: out[f"{name}_ms"] for name in ("jax_cudnn_v128", "torch_cudnn_v128") if f"{name}_ms" in out}
    if fair:
        out["fair"] = min(fair, key=fair.get)
        out["fair_ms"] = fair[out["fair"]]
    return out


def prefill_rows(shapes, interpret=False, configs=((64, 64, 4, 2),), hopper_configs=(), deadline=float("inf")):
    """configs: (block_q, block_k, num_warps, num_stages) of the Triton kernel to try;
    hopper_configs: (block_q, block_kv, steps) of the Mosaic GPU kernel; the best of each is reported."""
    rows = []
    for b, t, h in shapes:
        if time.monotonic() > deadline:
            print(f"budget spent: skipping prefill B{b} T{t} H{h}")
            continue
        key = jax.random.PRNGKey(t)
        q = jax.random.normal(key, (b * t, h, 192), jnp.bfloat16)
        k = jax.random.normal(jax.random.PRNGKey(1), (b * t, h, 192), jnp.bfloat16)
        v = jax.random.normal(jax.random.PRNGKey(2), (b * t, h, 128), jnp.bfloat16)
        cu = [i * t for i in range(b + 1)]

        def run(cfg):
            bq, bk, nw, ns = cfg
            ours = jax.jit(lambda q, k, v: mla.mla_prefill(q, k, v, cu_seqlens=cu, scale=192 ** -0.5, rope_dim=64,
                                                           block=bq, block_k=bk, num_warps=nw, num_stages=ns,
                                                           interpret=interpret)[0])
            return common.pipelined_ms(ours, q, k, v, iters=5 if interpret else 20)

        ms, cfg = _best(run, list(configs))
        if ms is None:
            continue
        peers = {} if interpret else cudnn_peers(q, k, v, b, t, h)
        ms_cudnn = peers.get("fair_ms")
        hop_ms = hop_cfg = hop_err = None
        hop_by_cfg = {}
        if hopper_configs:
            def hopper_kw(cfg):  # (block_q, block_kv, steps[, persistent[, q tiles first]])
                bq, bkv, st, persistent, q_first = (tuple(cfg) + (0, 0))[:5]
                return dict(block_q=bq, block_kv=bkv, steps=st, persistent=bool(persistent),
                            tile_order="q_tiles" if q_first else "heads", interpret=interpret)

            def run_hopper(cfg):
                fn = jax.jit(lambda q, k, v: mla_hopper.mla_prefill_hopper(
                    q, k, v, cu_seqlens=cu, scale=192 ** -0.5, **hopper_kw(cfg))[0])
                return common.pipelined_ms(fn, q, k, v, iters=5 if interpret else 20)

            hop_ms, hop_cfg = _best(run_hopper, list(hopper_configs), hop_by_cfg)
            if hop_ms is not None:  # agreement with the Triton kernel on the same inputs
                o_h = mla_hopper.mla_prefill_hopper(q, k, v, cu_seqlens=cu, scale=192 ** -0.5, **hopper_kw(hop_cfg))[0]
                o_t = mla.mla_prefill(q, k, v, cu_seqlens=cu, scale=192 ** -0.5, rope_dim=64, interpret=interpret)[0]
                hop_err = float(jnp.max(jnp.abs(o_h.astype(jnp.float32) - o_t.astype(jnp.float32))))
        flops = b * h * t * t * (192 + 128)  # causal: half of 2 * t^2 * (dqk + dv)
        rows.append(dict(section="prefill", case=f"B{b} T{t} H{h} qk192 v128 causal", bq_bk_warps_stages=cfg, ours_ms=ms,
                         cudnn_ms=ms_cudnn, cudnn_peer=peers.get("fair"), **{k_: v_ for k_, v_ in peers.items()
                                                                               if k_ not in ("fair", "fair_ms")},
                         ours_tflops=flops / (ms * 1e-3) / 1e12,
                         vs_cudnn=(ms_cudnn / ms) if ms_cudnn else None,
                         hopper_cfg=hop_cfg, hopper_ms=hop_ms,
                         hopper_tflops=flops / (hop_ms * 1e-3) / 1e12 if hop_ms else None,
                         hopper_vs_cudnn=(ms_cudnn / hop_ms) if (ms_cudnn and hop_ms) else None,
                         hopper_max_diff_vs_triton=hop_err, hopper_ms_by_cfg=hop_by_cfg))
    return rows


def chunk_rows(shapes, r=512, p=64, nope=128, dv=128, page=128, interpret=False, deadline=float("inf")):
    """A prefill chunk continuing a cache (B sequences x T new tokens after P cached, H heads):
    `mla_prefill_chunk` (expanded form, what `kimik3.ops` runs) and its Hopper twin (GPU only)
    against the absorbed decode kernels with Sq = T (Hopper where it runs, else Triton) and
    XLA's masked attention on the expanded K/V; FLOPs of the expanded form (causal within
    the chunk)."""
    rows = []
    for b, t, prefix_len, h in shapes:
        if time.monotonic() > deadline:
            print(f"budget spent: skipping chunk B{b} T{t} P{prefix_len} H{h}")
            continue
        ks = jax.random.split(jax.random.PRNGKey(t + prefix_len + h), 6)
        n_pages = -(-(prefix_len + t) // page)
        pages = jax.random.normal(ks[0], (b * n_pages + 4, page, r + p), jnp.bfloat16)
        table = jax.random.permutation(ks[1], b * n_pages + 4)[:b * n_pages].reshape(b, n_pages).astype(jnp.int32)
        q = jax.random.normal(ks[2], (b, t, h, nope + p), jnp.bfloat16)
        w_kb = (jax.random.normal(ks[3], (r, h, nope)) * r ** -0.5).astype(jnp.bfloat16)
        w_vb = (jax.random.normal(ks[4], (r, h, dv)) * r ** -0.5).astype(jnp.bfloat16)
        lens = jnp.full((b,), prefix_len, jnp.int32)
        scale = (nope + p) ** -0.5
        chunk_latent = mla.gather_pages(pages, table)[:, prefix_len:prefix_len + t]

        def chunk_operands(q, pages, table, lens):  # what kimik3.ops hands a chunk kernel
            return (q, *mla.expand_heads(chunk_latent, w_kb, w_vb), mla.LatentPrefix(pages, table, lens, w_kb, w_vb))

        def expanded(*args):
            return mla.mla_prefill_chunk(*chunk_operands(*args), scale=scale, rope_dim=p, interpret=interpret)[0]

        def expanded_hopper(*args, **kw):
            return mla_hopper.mla_prefill_chunk_hopper(*chunk_operands(*args), scale=scale, interpret=interpret,
                                                       **kw)[0]

        def absorbed(q, pages, table, lens):
            q_latent = jnp.einsum("bthn,rhn->bthr", q[..., :nope], w_kb)
            decode = mla.mla_decode if interpret or h * t < 64 else mla_decode_hopper.mla_decode_hopper
            o = decode(q_latent, q[..., nope:], pages, table, lens + t, scale=scale, interpret=interpret)[0]
            return jnp.einsum("bthr,rhv->bthv", o, w_vb)

        def xla(q, pages, table, lens):
            k, v = mla.expand_heads(mla.gather_pages(pages, table), w_kb, w_vb)
            q_pos = lens[:, None] + jnp.arange(t)[None]
            k_pos = jnp.broadcast_to(jnp.arange(k.shape[1])[None], k.shape[:2])
            return attend(q, k, v, scale=scale, q_pos_bt=q_pos, k_pos_bs=k_pos)

        args = (q, pages, table, lens)
        times, outs = {}, {}
        hopper_128 = functools.partial(expanded_hopper, block_kv=128)
        kernels = (("expanded", expanded),) + (() if interpret else (
            ("expanded_hopper", expanded_hopper), ("expanded_hopper_128", hopper_128),
            ("expanded_hopper_128_persistent", functools.partial(hopper_128, persistent=True))))
        for name, fn in kernels + (("absorbed", absorbed), ("xla", xla)):
            try:
                jitted = jax.jit(fn)
                outs[name] = jitted(*args).astype(jnp.float32)
                times[name] = time_jax(jitted, *args, iters=3 if interpret else 20)
            except Exception as e:  # noqa: BLE001 - report, keep going
                print(f"chunk {name} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        ref = outs.get("xla")
        err = {n: float(jnp.max(jnp.abs(o - ref)) / jnp.max(jnp.abs(ref))) for n, o in outs.items() if ref is not None}
        flops = 2 * b * h * t * (prefix_len + (t + 1) / 2) * (nope + p + dv)
        rows.append(dict(section="chunk", case=f"B{b} T{t} P{prefix_len} H{h}",
                         expanded_ms=times.get("expanded"), expanded_hopper_ms=times.get("expanded_hopper"),
                         expanded_hopper_128_ms=times.get("expanded_hopper_128"),
                         expanded_hopper_128_persistent_ms=times.get("expanded_hopper_128_persistent"),
                         absorbed_ms=times.get("absorbed"), xla_ms=times.get("xla"),
                         expanded_tflops=flops / (times["expanded"] * 1e-3) / 1e12 if "expanded" in times else None,
                         expanded_err=err.get("expanded"), expanded_hopper_err=err.get("expanded_hopper"),
                         absorbed_err=err.get("absorbed")))
        print(rows[-1], flush=True)
    return rows


def parse_decode_config(text: str) -> tuple:
    """'64x8x512x32' -> (64, 8, 512, 32); 'hopperx64x2' -> ('hopper', 64, 2);
    'hopperclx64x2' -> ('hoppercl', 64, 2) (row tiles in CTA pairs)."""
    parts = text.split("x")
    if parts[0] in HOPPER_DECODES:
        return (parts[0],) + tuple(int(v) for v in parts[1:])
    return tuple(int(v) for v in parts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tiny", action="store_true", help="toy sizes in interpret mode (CPU smoke test)")
    ap.add_argument("--decode-configs", default="16x4,64x8x512x32,hopperx64x2",
                    help="decode configs to try, the best reported: Triton (rows per block)x(num_warps)[x(value "
                         "columns per program)[x(block_k)[x(num_stages)]]], or hopperx(block_kv)x(steps) for the "
                         "Mosaic GPU kernel (hoppercl...: row tiles in CTA pairs)")
    ap.add_argument("--sections", default="prefill,decode,chunk")
    ap.add_argument("--decode-heads", default="16,96", help="decode head counts to sweep")
    ap.add_argument("--decode-batches", default="1,16,64,128", help="decode batch sizes to sweep")
    ap.add_argument("--decode-contexts", default="1024,8192,32768", help="one-query decode contexts to sweep")
    ap.add_argument("--decode-sq", default="1,4", help="query tokens per sequence (4: speculative verify, B64 "
                    "ctx8k only)")
    ap.add_argument("--skip-xla-ref", action="store_true",
                    help="do not time the XLA reference (its compiles dominate the H96 sweep's time)")
    ap.add_argument("--prefill-configs", default="64x64x4x2,128x64x8x2,128x64x8x3,128x128x8x2,128x32x4x3",
                    help="prefill (block_q)x(block_k)x(num_warps)x(num_stages) to try; the best is reported")
    ap.add_argument("--hopper-configs", default="64x128x2,64x128x2x0x1,64x128x2x1,64x64x2",
                    help="Mosaic GPU prefill (block_q)x(block_kv)x(steps)[x(1: persistent)[x(1: q tiles "
                         "first)]] to try ('' to skip)")
    ap.add_argument("--chunk-cases", default="1x2048x0x16,1x2048x2048x16,1x2048x8192x16,1x2048x8192x96",
                    help="chunk cases (B)x(T new)x(P cached)x(H) to time")
    ap.add_argument("--budget-s", type=float, default=1e9, help="skip cases that start after this many seconds")
    args = ap.parse_args()
    deadline = time.monotonic() + args.budget_s
    rows = []
    # the run's ceilings (issue 22): the best D2D copy of torch and Pallas (XLA's copy beside it),
    # the best bf16 matmul of XLA and torch
    ceil = {"copy_gbs": common.copy_gbs(), "matmul_tflops": 1.0} if args.tiny else common.ceilings()
    bw, tf = ceil["copy_gbs"], ceil["matmul_tflops"]
    rows.append(dict(section="roofline", case="ceilings: copy GB/s, bf16 matmul TFLOP/s", **ceil))
    if args.tiny:
        rows += decode_rows(bw, tf, [2], [256], [2], r=32, p=16, page=64, interpret=True)
        rows += decode_rows(bw, tf, [1], [256], [2], r=32, p=16, page=64, sq=2, interpret=True)
        rows += decode_rows(bw, tf, [1], [128], [2], r=128, p=64, page=64, interpret=True,
                            configs=(("hopper", 32, 2),))
        rows += prefill_rows([(1, 128, 1)], interpret=True, hopper_configs=((64, 64, 2), (64, 64, 2, 1)))
        rows += chunk_rows([(1, 24, 40, 2)], r=32, p=16, nope=16, dv=16, page=16, interpret=True)
    else:
        dec = dict(configs=[parse_decode_config(c) for c in args.decode_configs.split(",")], deadline=deadline)
        if "prefill" in args.sections:
            configs = [tuple(int(v) for v in c.split("x")) for c in args.prefill_configs.split(",")]
            hopper = [tuple(int(v) for v in c.split("x")) for c in args.hopper_configs.split(",") if c]
            rows += prefill_rows([(1, 4096, 16), (1, 16384, 16), (4, 4096, 96)], configs=configs,
                                 hopper_configs=hopper, deadline=deadline)
        if "chunk" in args.sections:
            rows += chunk_rows([tuple(int(v) for v in c.split("x")) for c in args.chunk_cases.split(",")],
                               deadline=deadline)
        if "decode" in args.sections:
            heads = [int(h) for h in args.decode_heads.split(",")]
            sqs = [int(v) for v in args.decode_sq.split(",")]
            dec["xla_ref"] = not args.skip_xla_ref
            if 1 in sqs:
                batches = [int(v) for v in args.decode_batches.split(",")]
                contexts = [int(v) for v in args.decode_contexts.split(",")]
                rows += decode_rows(bw, tf, batches, contexts, heads, **dec)
            if 4 in sqs:  # speculative verify: 4 query tokens per sequence
                rows += decode_rows(bw, tf, [64], [8192], heads, sq=4, **dec)
    common.write_results(args.out, "mla_bench", rows)

if __name__ == "__main__":
    main()
