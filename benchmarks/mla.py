"""MLA kernels: absorbed paged decode, fresh-token prefill and a prefill chunk continuing a paged
cache, each the kernel `kimik3.ops` picks on this device, against FlashMLA / cuDNN / XLA.

Registered in `benchmarks.registry` (mla_decode, mla_prefill, mla_chunk).
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from benchmarks import common
from kimik3 import ops
from pallas_kernels import mla, mla_decode_hopper, mla_hopper
from pallas_kernels.attention import attend

log = logging.getLogger("benchmarks.mla")
TOL = 2e-2  # bf16 outputs against fp32 math: max |err| over max |ref|
DQK, DV, ROPE = 192, 128, 64  # the model's MLA prefill head dims (nope 128 + rope 64, v 128)
CHECK_QUERIES = 1024  # prefill: the reference attends each sequence's first queries only


def _to_torch(x):
    import torch

    return torch.from_dlpack(jax.block_until_ready(x))


def _hopper_decode_fits(r: int, p: int, page: int) -> bool:
    return r % 128 == 0 and p % 64 == 0 and page % 32 == 0


DECODE_VARIANTS = {  # name -> (kernel, keyword overrides, fits(r, p, page))
    "triton": (mla.mla_decode, {}, lambda r, p, page: True),
    "hopper": (mla_decode_hopper.mla_decode_hopper, {}, _hopper_decode_fits),
    "triton_64x8x512x32": (
        mla.mla_decode,
        dict(block_m=64, num_warps=8, block_v=512, block_k=32),
        lambda r, p, page: r % 512 == 0,
    ),
    "hopper_cluster2": (mla_decode_hopper.mla_decode_hopper, dict(cluster=2), _hopper_decode_fits),
}


def _flashmla_ms(ctx, ql, qp, pages, table, lens, scale):
    """FlashMLA on the same pages, viewed as its 64-token blocks, by the same timing rule; None where
    flash_mla does not import.  Returns (ms, output as a jax array)."""
    try:
        import torch
        from flash_mla import flash_mla_with_kvcache, get_mla_metadata
    except Exception:  # noqa: BLE001 - the peer is optional
        return None
    b, sq, h, r = ql.shape
    n_pool, page, width = pages.shape
    per = page // 64
    q = torch.cat([_to_torch(ql), _to_torch(qp)], dim=-1).contiguous()
    blocks = _to_torch(pages).view(n_pool * per, 64, 1, width)
    tab = (_to_torch(table).long()[:, :, None] * per + torch.arange(per, device=q.device)).reshape(b, -1).int()
    seqlens = _to_torch(lens).int()
    meta, splits = get_mla_metadata(seqlens, sq * h, 1)
    call = lambda: flash_mla_with_kvcache(q, blocks, tab, seqlens, r, meta, splits, softmax_scale=scale, causal=True)
    out = call()[0]
    return ctx.time_torch(call), jnp.asarray(out.float().cpu().numpy())


def mla_decode(ctx):
    """mla_decode: B sequences of ctx cached tokens on a shuffled page table, Sq queries each."""
    cc = ops.device_compute_capability()
    scale = 0.1
    for case in ctx.cases():
        h, b, n_ctx, sq, r, p, page = case
        key = jax.random.PRNGKey(b * 7 + n_ctx)
        per_seq = n_ctx // page
        n_pool = b * per_seq + 8
        pages = jax.random.normal(key, (n_pool, page, r + p), jnp.bfloat16)
        table = jax.random.permutation(key, n_pool)[: b * per_seq].reshape(b, per_seq).astype(jnp.int32)
        lens = jnp.full((b,), n_ctx, jnp.int32)
        ql = jax.random.normal(jax.random.PRNGKey(1), (b, sq, h, r), jnp.bfloat16)
        qp = jax.random.normal(jax.random.PRNGKey(2), (b, sq, h, p), jnp.bfloat16)
        args = (ql, qp, pages, table, lens)
        ref = jax.jit(lambda *a: mla.mla_decode_ref(*a, scale=scale)[0])
        want = ref(*args)
        work = {
            "bytes": b * n_ctx * (r + p) * 2 + ql.nbytes + qp.nbytes + b * sq * h * r * 2,
            "flops": 2 * b * sq * h * n_ctx * (r + p + r),
        }
        impl = ops.mla_decode_impl(jnp.bfloat16, r, p, page, sq * h, per_seq * page, cc)
        default = mla_decode_hopper.mla_decode_hopper if impl == "hopper" else mla.mla_decode
        peer = {}

        def peer_ms():
            flash = _flashmla_ms(ctx, ql, qp, pages, table, lens, scale) if ctx.on_gpu else None
            if flash is not None:
                peer["name"] = "FlashMLA"
                peer["err"] = common.check(flash[1], want, TOL)["max_err"]
                return flash[0]
            peer["name"] = "XLA mla_decode_ref"
            return ctx.time(ref, *args)

        def one(kernel, kw, variant):
            fn = jax.jit(lambda *a: kernel(*a, scale=scale, **kw)[0])
            chk = common.check(fn(*args), want, TOL)
            row = ctx.row(
                case,
                chk,
                lambda: ctx.time(fn, *args),
                variant=variant,
                peer_ms=peer_ms,
                work=work,
                extra={"kernel": impl if variant == "default" else variant},
            )
            if peer.get("name") and row["peer_ms"] is not None:
                row["peer"] = peer["name"]
                row["extra"]["peer_err"] = peer.get("err")
            return row

        yield ctx.attempt(case, "default", lambda: one(default, {}, "default"))
        for name in ctx.wanted():
            kernel, kw, fits = DECODE_VARIANTS[name]
            if fits(r, p, page):
                yield ctx.attempt(case, name, lambda kernel=kernel, kw=kw, name=name: one(kernel, kw, name))


def cudnn_ms(ctx, q, k, v, b: int, t: int, h: int) -> dict:
    """cuDNN flash attention doing our prefill's work (q / k 192, v 128, causal), timed by our
    rule: JAX's cuDNN call with unequal head dims and torch SDPA's cuDNN backend.  {"peer": the
    faster's name, "ms": its time, and each one's ms or error}."""
    out = {}
    qb, kb, vb = q.reshape(b, t, h, DQK), k.reshape(b, t, h, DQK), v.reshape(b, t, h, DV)
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa

        fn = jax.jit(lambda q, k, v: fa.dot_product_attention(q, k, v, scale=DQK**-0.5, mask_type=fa.MaskType.CAUSAL))
        out["jax_cudnn_ms"] = ctx.time(fn, qb, kb, vb)
    except Exception as e:  # noqa: BLE001 - the other peer may still run
        out["jax_cudnn_error"] = repr(e)[:200]
    try:
        import torch
        from torch.nn.attention import SDPBackend, sdpa_kernel

        tq, tk, tv = (_to_torch(a).permute(0, 2, 1, 3) for a in (qb, kb, vb))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            call = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, scale=DQK**-0.5)
            out["torch_cudnn_ms"] = ctx.time_torch(call)
    except Exception as e:  # noqa: BLE001
        out["torch_cudnn_error"] = repr(e)[:200]
    fair = {n: out[f"{n}_ms"] for n in ("jax_cudnn", "torch_cudnn") if f"{n}_ms" in out}
    if fair:
        out["peer"] = min(fair, key=fair.get)
        out["ms"] = fair[out["peer"]]
    return out


def _prefill_kernel(impl: str, **kw):
    if impl == "hopper":
        kw.setdefault("block_kv", mla_hopper.prefill_block_kv(DQK, DV))
        return lambda q, k, v, cu: mla_hopper.mla_prefill_hopper(q, k, v, cu_seqlens=cu, scale=DQK**-0.5, **kw)[0]
    return lambda q, k, v, cu: mla.mla_prefill(q, k, v, cu_seqlens=cu, scale=DQK**-0.5, rope_dim=ROPE, **kw)[0]


PREFILL_VARIANTS = {
    "triton": ("triton", {}),
    "hopper": ("hopper", {}),
    "triton_128x64x8x3": ("triton", dict(block=128, block_k=64, num_warps=8, num_stages=3)),
    "hopper_persistent": ("hopper", dict(persistent=True)),
}


def mla_prefill(ctx):
    """mla_prefill: B packed sequences of T fresh tokens, causal."""
    impl = ops.mla_prefill_impl(jnp.bfloat16, DQK, DV, ops.device_compute_capability())
    for case in ctx.cases():
        b, t, h = case
        q = jax.random.normal(jax.random.PRNGKey(t), (b * t, h, DQK), jnp.bfloat16)
        k = jax.random.normal(jax.random.PRNGKey(1), (b * t, h, DQK), jnp.bfloat16)
        v = jax.random.normal(jax.random.PRNGKey(2), (b * t, h, DV), jnp.bfloat16)
        cu = [i * t for i in range(b + 1)]
        n = min(t, CHECK_QUERIES)
        head = lambda x: x.reshape(b, t, *x.shape[1:])[:, :n].reshape(b * n, *x.shape[1:])
        want = mla.mla_prefill_ref(
            head(q), head(k), head(v), cu_seqlens=[i * n for i in range(b + 1)], scale=DQK**-0.5
        )[0]
        work = {"flops": b * h * t * t * (DQK + DV)}  # causal: half of 2 t^2 (dqk + dv)
        peers = {}

        def peer_ms():
            if not ctx.on_gpu:
                return None
            peers.update(cudnn_ms(ctx, q, k, v, b, t, h))
            return peers.get("ms")

        def one(kernel_impl, kw, variant):
            fn = jax.jit(functools.partial(_prefill_kernel(kernel_impl, **kw), cu=cu))
            chk = common.check(head(fn(q, k, v)), want, TOL)
            row = ctx.row(
                case,
                chk,
                lambda: ctx.time(fn, q, k, v),
                variant=variant,
                peer_ms=peer_ms,
                work=work,
                extra={"kernel": kernel_impl},
            )
            if peers.get("peer") and row["peer_ms"] is not None:
                row["peer"] = f"cuDNN ({peers['peer']})"
                row["extra"].update({k_: v_ for k_, v_ in peers.items() if k_ not in ("peer", "ms")})
            return row

        yield ctx.attempt(case, "default", lambda: one(impl, {}, "default"))
        for name in ctx.wanted():
            kernel_impl, kw = PREFILL_VARIANTS[name]
            if kernel_impl == "triton" or mla_hopper.supports(DQK, DV):
                yield ctx.attempt(case, name, lambda ki=kernel_impl, kw=kw, name=name: one(ki, kw, name))


def mla_chunk(ctx):
    """mla_chunk: B sequences of T new tokens after P cached on a shuffled page table, H heads."""
    cc = ops.device_compute_capability()
    for case in ctx.cases():
        b, t, prefix_len, h, r, p, nope, dv, page = case
        ks = jax.random.split(jax.random.PRNGKey(t + prefix_len + h), 6)
        n_pages = -(-(prefix_len + t) // page)
        pages = jax.random.normal(ks[0], (b * n_pages + 4, page, r + p), jnp.bfloat16)
        table = jax.random.permutation(ks[1], b * n_pages + 4)[: b * n_pages].reshape(b, n_pages).astype(jnp.int32)
        q = jax.random.normal(ks[2], (b, t, h, nope + p), jnp.bfloat16)
        w_kb = (jax.random.normal(ks[3], (r, h, nope)) * r**-0.5).astype(jnp.bfloat16)
        w_vb = (jax.random.normal(ks[4], (r, h, dv)) * r**-0.5).astype(jnp.bfloat16)
        lens = jnp.full((b,), prefix_len, jnp.int32)
        scale = (nope + p) ** -0.5
        chunk_latent = mla.gather_pages(pages, table)[:, prefix_len : prefix_len + t]
        args = (q, pages, table, lens)

        def operands(q, pages, table, lens):  # what kimik3.ops hands a chunk kernel
            return (q, *mla.expand_heads(chunk_latent, w_kb, w_vb), mla.LatentPrefix(pages, table, lens, w_kb, w_vb))

        def triton(*a):
            return mla.mla_prefill_chunk(*operands(*a), scale=scale, rope_dim=p)[0]

        def hopper(*a, **kw):
            return mla_hopper.mla_prefill_chunk_hopper(*operands(*a), scale=scale, **kw)[0]

        def absorbed(q, pages, table, lens):
            q_latent = jnp.einsum("bthn,rhn->bthr", q[..., :nope], w_kb)
            kernel = mla_decode_hopper.mla_decode_hopper if _hopper_decode_fits(r, p, page) and cc else mla.mla_decode
            o = kernel(q_latent, q[..., nope:], pages, table, lens + t, scale=scale)[0]
            return jnp.einsum("bthr,rhv->bthv", o, w_vb)

        def xla(q, pages, table, lens):
            k, v = mla.expand_heads(mla.gather_pages(pages, table), w_kb, w_vb)
            q_pos = lens[:, None] + jnp.arange(t)[None]
            k_pos = jnp.broadcast_to(jnp.arange(k.shape[1])[None], k.shape[:2])
            return attend(q, k, v, scale=scale, q_pos_bt=q_pos, k_pos_bs=k_pos)

        peer_fn = jax.jit(xla)
        want = peer_fn(*args)
        hopper_ok = mla_hopper.supports(nope + p, dv, [prefix_len])
        impl = ops.mla_chunk_impl(jnp.bfloat16, nope + p, dv, cc, t)
        best_kv = mla_hopper.prefill_block_kv(nope + p, dv) if hopper_ok else 64
        kernels = {
            "default": functools.partial(hopper, block_kv=best_kv) if impl == "hopper" else triton,
            "triton": triton,
            "hopper": hopper,
            "hopper_128": functools.partial(hopper, block_kv=128),
            "absorbed": absorbed,
        }
        work = {"flops": 2 * b * h * t * (prefix_len + (t + 1) / 2) * (nope + p + dv)}

        def one(variant):
            fn = jax.jit(kernels[variant])
            chk = common.check(fn(*args).astype(jnp.float32), want.astype(jnp.float32), TOL)
            return ctx.row(
                case,
                chk,
                lambda: ctx.time(fn, *args),
                variant=variant,
                peer_ms=lambda: ctx.time(peer_fn, *args),
                work=work,
                extra={"kernel": impl if variant == "default" else variant},
            )

        yield ctx.attempt(case, "default", lambda: one("default"))
        for name in ctx.wanted():
            if not name.startswith("hopper") or (hopper_ok and (name != "hopper_128" or prefix_len % 128 == 0)):
                yield ctx.attempt(case, name, lambda name=name: one(name))
