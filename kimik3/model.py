"""The hybrid Kimi-K3 model: a Flax module tree over a plain pytree of params.

`forward(params, cfg, tokens, ...)` is pure: caches are explicit pytrees passed
in and returned (see `init_cache`), so prefill in pieces, decode, and later
paging all run through the same code.

Contiguous cache (`init_cache`), one row per sequence; the entries are `kimik3.caches` types::

    {"lengths": int32 [B]               tokens already in the cache per sequence,
     "layers":  tuple, one per layer:
        KDA: KDAState(state=f32 [B, H, K, V], conv=[B, W-1, 3, H*D])  (the q, k, v convs' last inputs)
        MLA: MLALatent(latent=[B, max_len, kv_lora + rope])}

Paged cache (`init_paged_cache` + `paged_view`): pools shared by every request, one per
mixer kind for all its layers, and the batch's view of them::

    {"lengths": int32 [B], "block_tables": int32 [B, max_pages], "slots": int32 [B],
     "kda": {"state": f32 [n_kda * num_slots, H, K, V], "conv": [n_kda * num_slots, W-1, 3, H*D]},
     "mla": {"pages": [n_mla * num_pages, page_tokens, kv_lora + rope]}}

KDA layer k's slot s is row k * num_slots + s; MLA layer m's page p is m * num_pages + p
(`kimik3.caches.PagedPools`): every layer, unrolled or scanned (`kimik3.stacked`), updates its
rows in place.  Both caches go through the same layers.

`forward_caches` runs over the typed caches (`kimik3.caches.LayerCaches`, `PagedPools`) and takes
what a call asks for (export_at, valid_b) as arguments; its exports are a return value.
`forward_paged` is its form over a paged view (the serving steps: `paged_step`), `forward_apply`
over either cache dict above with every token real and nothing exported (`forward`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn

try:  # the threefry lowering switch is only reachable through jax's config module
    from jax._src import config as jax_config
except ImportError:  # pragma: no cover
    jax_config = None

from kimik3 import layerwise, ops, stacked, tokenizer
from kimik3.block import (  # noqa: F401 (re-exported: the model's public names)
    Block,
    block_kind,
    embed_inputs,
    first_of_kind,
    head_logits,
    splice_image_embeddings,
)
from kimik3.caches import (  # noqa: F401 (re-exported)
    KDASlots,
    KDAState,
    LayerCaches,
    MLALatent,
    MLAPages,
    PagedPools,
    is_paged,
    kind_index,
    pool_offsets,
)
from kimik3.config import ATTENTION_PERIOD, ModelConfig
from kimik3.quant.formats import QTensor
from kimik3.layers.kda import init_kda_cache
from kimik3.layers.mla import init_mla_cache
from kimik3.layers.primitives import RMSNorm, fan_in_init
from kimik3.layers.vit import ViT

Params = Any
Cache = dict

# Leaves that stay fp32 whatever the serving dtype: the router (its math is
# fp32 by design) and the KDA gate's parameters (they sit inside an exp).
FP32_PARAM_PATTERN = re.compile(r"(w_router_de|router_bias_e|a_log_h|dt_bias_hk)$")


def _run_block(block, x, positions_bt, caches, cfg, layer, period, export_at, valid_b):
    """One block over `caches` (`kimik3.caches`): its layer's entry in, what it wrote back.
    Returns (x, caches, the KDA exports of this layer or None: `Block`)."""
    entry = None if caches is None else caches.get(cfg, layer, period)
    x, new, exports = block(x, positions_bt, entry, export_at=export_at, valid_b=valid_b)
    return x, None if caches is None else caches.put(cfg, layer, period, new), exports


class Period(nn.Module):
    """One scan step over the stacked periods (`kimik3.stacked`): layers first .. first + P - 1
    stand for period `period`'s (traced int32 []); their weights are that period's slice."""

    cfg: ModelConfig
    first: int
    expert_path: str = "grouped"
    kernels: str = "auto"

    @nn.compact
    def __call__(self, carry, period, positions_bt, export_at, valid_b):
        x, caches = carry
        exports = []
        for j in range(ATTENTION_PERIOD):
            block = Block(self.cfg, self.first + j, self.expert_path, self.kernels, name=f"layer_{j}")
            layer = self.first + j
            x, caches, e = _run_block(block, x, positions_bt, caches, self.cfg, layer, period, export_at, valid_b)
            exports.append(e)
        return (x, caches), tuple(exports)


class KimiK3(nn.Module):
    """tokens [B, T], positions [B, T], caches (`kimik3.caches.LayerCaches`, `PagedPools` or None),
    images -> (logits [B, T, V] fp32, the caches written, the KDA layers' exports or None).

    export_at (int32 [E] token counts of this call, traced): every KDA layer exports its cache
    entry as it stood after each count; the exports are then one `kimik3.caches.KDAState`
    [B, E, ...] per KDA layer, in layer order (see `kimik3.layers.kda.KDA`).  Without export_at
    they are None.

    With params in the scanned layout (`kimik3.stacked`: a "periods" subtree) the repeated
    periods run as one `nn.scan` step; the math per layer is the same."""

    cfg: ModelConfig
    expert_path: str = "grouped"
    kernels: str = "auto"  # see kimik3.ops
    blocks: bool = True  # False: the embedding, ViT, final norm and head only (`init_params` draws blocks apart)
    taps: tuple[int, ...] = ()  # layers whose output (the residual stream) is sown as intermediates "tap_{i}"

    @nn.compact
    def __call__(
        self, tokens_bt, positions_bt, caches=None, images_nhwc=None, logits_tail=None, valid_b=None, export_at=None
    ):
        """images_nhwc: [N, S, S, C] pixels, or {"rows": [M, D], "first": int32 []} image
        embeddings computed earlier (`image_embeddings`) and the row the first placeholder
        among `tokens_bt` takes.  logits_tail: logits for only the last this many positions
        ([B, logits_tail, V]): a serving step needs the last one, and the fp32 head over every
        prompt token would cost more than a layer.  valid_b: int32 [B], row b's real tokens
        (the rest pad it and change no cache); with logits_tail=1 the logits are those of its
        last real token."""
        cfg = self.cfg
        embed = self.param("embed_vd", nn.initializers.normal(1.0), (cfg.vocab_size, cfg.d_model))
        vit = None if cfg.vit is None else ViT(cfg.vit, cfg.d_model, name="vit")
        x = embed_inputs(embed, tokens_bt, images_nhwc, vit)
        first, n = stacked.scan_layout(cfg)
        scanned = stacked.scanned_layers(cfg) if self.has_variable("params", stacked.PERIODS) else ()
        exports = {}
        if set(self.taps) & set(scanned):
            raise ValueError(
                f"taps {sorted(set(self.taps) & set(scanned))} are scanned layers (`kimik3.stacked`): "
                f"tap the unrolled layout"
            )
        for i in range(cfg.n_layers if self.blocks else 0):
            if i in scanned:
                if i == first:  # the periods as one scan step over their stacked weights (`kimik3.stacked`)
                    if isinstance(caches, LayerCaches):
                        caches = caches.stack(first, n)
                    periods = nn.scan(
                        Period,
                        variable_axes={"params": 0},
                        split_rngs={"params": True},
                        in_axes=(0, nn.broadcast, nn.broadcast, nn.broadcast),
                        length=n,
                    )
                    (x, caches), period_exports = periods(
                        cfg, first, self.expert_path, self.kernels, name=stacked.PERIODS
                    )((x, caches), jnp.arange(n), positions_bt, export_at, valid_b)
                    if isinstance(caches, LayerCaches):
                        caches = caches.unstack(n)
                    exports.update(
                        {l: e for l, e in stacked.unstack_positions(period_exports, first, n).items() if e is not None}
                    )
                continue
            block = Block(cfg, i, self.expert_path, self.kernels, name=f"layer_{i}")
            x, caches, e = _run_block(block, x, positions_bt, caches, cfg, i, None, export_at, valid_b)
            if e is not None:
                exports[i] = e
            if i in self.taps:
                self.sow("intermediates", f"tap_{i}", x)
        if logits_tail is not None and valid_b is not None:
            if logits_tail != 1:
                raise ValueError("a padded call returns the logits of its last real token only (logits_tail=1)")
            x = jnp.take_along_axis(x, jnp.clip(valid_b - 1, 0, x.shape[1] - 1)[:, None, None], axis=1)
        elif logits_tail is not None:
            x = x[:, -logits_tail:]
        x = RMSNorm(cfg.d_model, cfg.norm_eps, name="final_norm")(x)
        lm_head = self.param("lm_head_dv", fan_in_init(cfg.d_model), (cfg.d_model, cfg.vocab_size))
        return head_logits(x, lm_head), caches, tuple(exports[i] for i in sorted(exports)) or None


# ---- params -----------------------------------------------------------------------------------


def example_inputs(cfg: ModelConfig):
    tokens = jnp.zeros((1, 1), jnp.int32)
    images = None
    if cfg.vit is not None:
        images = jnp.zeros((1, cfg.vit.image_size, cfg.vit.image_size, cfg.vit.channels), jnp.float32)
    return tokens, tokens, None, images


def cast_params(params: Params, dtype) -> Params:
    """Cast floating leaves to `dtype`, keeping FP32_PARAM_PATTERN leaves fp32."""
    dtype = jnp.dtype(dtype)

    def cast(path, leaf):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        if isinstance(leaf, QTensor):  # quantized weights keep their storage types
            return leaf
        if not jnp.issubdtype(leaf.dtype, jnp.floating) or FP32_PARAM_PATTERN.search(name):
            return leaf
        if isinstance(leaf, jax.ShapeDtypeStruct):  # abstract trees (restore targets)
            return jax.ShapeDtypeStruct(leaf.shape, dtype, sharding=leaf.sharding)
        return leaf.astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, params, is_leaf=lambda x: isinstance(x, QTensor))


@functools.partial(jax.jit, static_argnames=("cfg", "dtype"))
def init_top(key, *, cfg: ModelConfig, dtype: str) -> Params:
    params = KimiK3(cfg, blocks=False).init(key, *example_inputs(cfg))["params"]
    return cast_params(params, dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "layer", "dtype"))
def init_block(key, *, cfg: ModelConfig, layer: int, dtype: str) -> Params:
    x = jnp.zeros((1, 1, cfg.d_model), jnp.float32)
    params = Block(cfg, layer).init(key, x, jnp.zeros((1, 1), jnp.int32), None)["params"]
    return cast_params(params, dtype)


@contextlib.contextmanager
def cheap_threefry():
    """The init's draws compile small: threefry as one kernel per draw on GPU
    (`jax_threefry_gpu_kernel_lowering`: its rounds are not inlined per parameter, a tenth of
    `small`'s compile time and host memory) and the non-partitionable counter layout (less
    to compile on every backend: the init is never sharded).  Both scoped to the init (JAX's
    config is process-global); the bits are the same on CPU and GPU."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(jax.threefry_partitionable(False))
        kernel = getattr(jax_config, "threefry_gpu_kernel_lowering", None)
        if kernel is not None:
            stack.enter_context(kernel(True))
        yield


def init_params(cfg: ModelConfig, key, dtype=None) -> Params:
    """Random params (fp32 init, then cast to `dtype`, default cfg.dtype).

    Block i draws from fold_in(blocks key, i) in a program compiled once per `block_kind`
    (one whole-model program inlined a threefry per parameter: 127 s of compile for `small`
    on an H200 host); the embedding, ViT, final norm and head draw from the other key."""
    dtype = jnp.dtype(dtype or cfg.dtype).name
    top_key, blocks_key = jax.random.split(key)
    with cheap_threefry():
        params = dict(init_top(top_key, cfg=cfg, dtype=dtype))
        for i in range(cfg.n_layers):
            params[f"layer_{i}"] = init_block(
                jax.random.fold_in(blocks_key, i), cfg=cfg, layer=first_of_kind(cfg, i), dtype=dtype
            )
    return params


@functools.lru_cache(maxsize=8)
def abstract_params(cfg: ModelConfig, dtype=None) -> Params:
    """Shapes and dtypes of the params without allocating them (jax.eval_shape)."""
    return jax.eval_shape(lambda: init_params(cfg, jax.random.PRNGKey(0), dtype))


# ---- cache --------------------------------------------------------------------------------------


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=None) -> Cache:
    """An empty cache for `batch` sequences of up to `max_len` tokens: {"lengths": int32 [B]
    zeros, "layers": per layer a `KDAState` or an `MLALatent` of zeros} (the module comment)."""
    if not 0 < max_len <= cfg.max_seq_len:
        raise ValueError(f"cache max_len {max_len} must be in [1, max_seq_len={cfg.max_seq_len}]")
    dtype = jnp.dtype(dtype or cfg.dtype)
    layers = tuple(
        init_kda_cache(cfg, batch, dtype) if kind == "kda" else init_mla_cache(cfg, batch, max_len, dtype)
        for kind in cfg.mixer_kinds
    )
    return {"lengths": jnp.zeros((batch,), jnp.int32), "layers": layers}


def init_paged_cache(cfg: ModelConfig, num_pages: int, num_slots: int, page_tokens: int = 128, dtype=None):
    """Pools: `num_pages` MLA latent pages of `page_tokens` per MLA layer and `num_slots`
    KDA state rows per KDA layer, one pool per kind (`kimik3.caches.PagedPools`'s layout).
    View them per batch with `paged_view`; `pool_layers` splits them per layer."""
    dtype = jnp.dtype(dtype or cfg.dtype)
    n_kda, n_mla = cfg.mixer_kinds.count("kda"), cfg.mixer_kinds.count("mla")
    rows = init_kda_cache(cfg, n_kda * num_slots, dtype)
    return {
        "kda": {"state": rows.state, "conv": rows.conv},
        "mla": {"pages": jnp.zeros((n_mla * num_pages, page_tokens, cfg.mla_latent_dim), dtype)},
    }


def pools_of(view: Cache) -> Cache:
    """The pools of a paged view (or of the cache a paged forward returned)."""
    return {"kda": view["kda"], "mla": view["mla"]}


def pool_layers(cfg: ModelConfig, pools: Cache) -> tuple:
    """Per layer, its part of the pools: KDA {"state": [S, ...], "conv": [S, ...]}, MLA
    {"pages": [P, ...]} (slices: copies, for inspection and the sharded steps' gathers)."""
    sizes = dict(zip(("kda", "mla"), pool_offsets(cfg, pools)))
    return tuple(
        {
            key: v[kind_index(cfg, i) * sizes[kind] : (kind_index(cfg, i) + 1) * sizes[kind]]
            for key, v in pools[kind].items()
        }
        for i, kind in enumerate(cfg.mixer_kinds)
    )


def paged_view(pools: Cache, block_tables, slots, lengths) -> Cache:
    """A batch's view of the pools: block_tables int32 [B, max_pages], slots int32 [B]
    (distinct KDA rows), lengths int32 [B] (tokens already cached); the module comment's
    layout.  A call's export positions and real tokens per row are `forward_paged`'s
    arguments, its exports that function's return value."""
    return dict(pools_of(pools), block_tables=_int32(block_tables), slots=_int32(slots), lengths=_int32(lengths))


def _int32(x):
    """x as int32: a host value stays a numpy array (a jitted call takes it as it is: no eager
    XLA op per entry, which costs a launch each on a GPU), a traced or device one a jax array."""
    if isinstance(x, (jax.Array, jax.core.Tracer)):
        return jnp.asarray(x, jnp.int32)
    return np.asarray(x, np.int32)


def cache_capacity(cfg: ModelConfig, cache: Cache) -> int:
    """Tokens per sequence the cache can hold (MLA latent rows; KDA has no limit)."""
    if "mla" not in cfg.mixer_kinds:
        return cfg.max_seq_len
    if is_paged(cache):
        return cache["block_tables"].shape[1] * cache["mla"]["pages"].shape[1]
    return cache["layers"][cfg.mixer_kinds.index("mla")].latent.shape[1]


# ---- forward ------------------------------------------------------------------------------------


def forward_caches(
    params,
    tokens,
    positions,
    caches,
    images,
    *,
    cfg,
    expert_path,
    kernels="auto",
    logits_tail=None,
    taps=(),
    export_at=None,
    valid_b=None,
):
    """The forward over typed caches (`kimik3.caches.LayerCaches`, `PagedPools`, or None):
    (logits [B, T, V] fp32, the caches written, the exports) and, with taps (layers, static), a
    fourth output: the residual stream after each of them [B, T, len(taps), D] (what an EAGLE-3
    draft reads, `kimik3.eagle`).

    export_at: int32 [E] token counts of this call after which every KDA layer exports its
    entry; the exports are then per KDA layer, in layer order, a `kimik3.caches.KDAState`
    (state [B, E, H, K, V], conv [B, E, W-1, 3, H*D]), else None.  valid_b: int32 [B], each
    row's real tokens (the rest pad the call and change no cache; `KimiK3`)."""
    module = KimiK3(cfg, expert_path, ops.resolve(kernels), taps=tuple(taps))
    args = ({"params": params}, tokens, positions, caches, images, logits_tail, valid_b, export_at)
    if taps:
        (logits, caches, exports), state = module.apply(*args, mutable=["intermediates"])
        return logits, caches, exports, stacked_taps(state, tuple(taps))
    return module.apply(*args)


def forward_paged(
    params,
    tokens,
    positions,
    view,
    images,
    *,
    cfg,
    expert_path,
    kernels="auto",
    logits_tail=None,
    taps=(),
    export_at=None,
    valid_b=None,
):
    """`forward_caches` over a paged view (`paged_view`): tokens int32 [B, T] at positions
    int32 [B, T], images as `KimiK3` takes them (or None) -> (logits fp32 [B, T, V] (the last
    logits_tail positions' with logits_tail), the view after, the exports) and, with taps
    (layers, static), a fourth output: the residual stream after each of them
    [B, T, len(taps), D].

    The view after is the one given with its pools written in place (every layer at its
    offset: `kimik3.caches.PagedPools`) and its lengths advanced by valid_b, or by T.
    export_at: int32 [E] token counts of this call after which every KDA layer exports its
    entry; the exports are then per KDA layer, in layer order, a `kimik3.caches.KDAState`
    (state f32 [B, E, H, K, V], conv [B, E, W-1, 3, H*D]), else None.  valid_b: int32 [B],
    each row's real tokens; the rest pad the call to a compiled length and change nothing
    (the logits with logits_tail=1 are the last real token's; see `kimik3.layers.kda.KDA` and
    `kimik3.layers.mla.MLA`)."""
    # Every layer reads and writes its rows of the pools in place by offset (`kimik3.caches`):
    # KDA rows by slot inside the layer (in the decode kernel), MLA pages through the tables.
    caches = PagedPools(view["kda"], view["mla"], view["slots"], view["block_tables"])
    export_at = None if export_at is None else _int32(export_at)
    valid_b = None if valid_b is None else _int32(valid_b)
    logits, caches, exports, *tapped = forward_caches(
        params,
        tokens,
        positions,
        caches,
        images,
        cfg=cfg,
        expert_path=expert_path,
        kernels=kernels,
        logits_tail=logits_tail,
        taps=taps,
        export_at=export_at,
        valid_b=valid_b,
    )
    advance = tokens.shape[1] if valid_b is None else valid_b
    out = dict(view, lengths=view["lengths"] + advance, kda=caches.kda, mla=caches.mla)
    return (logits, out, exports, *tapped)


def forward_apply(
    params, tokens, positions, cache, images, *, cfg, expert_path, kernels="auto", logits_tail=None, taps=()
):
    """`forward_caches` over a cache dict (`init_cache`, `paged_view`) or None, every token of
    tokens [B, T] real and nothing exported: (logits [B, T, V] fp32, the cache dict after:
    lengths advanced by T) and, with taps, a third output: the taps [B, T, len(taps), D].  A
    call that pads rows or exports KDA states is `forward_paged`'s."""
    static = dict(cfg=cfg, expert_path=expert_path, kernels=kernels, logits_tail=logits_tail, taps=taps)
    if is_paged(cache):
        logits, cache, _, *tapped = forward_paged(params, tokens, positions, cache, images, **static)
        return (logits, cache, *tapped)
    caches = None if cache is None else LayerCaches(tuple(cache["layers"]))
    logits, caches, _, *tapped = forward_caches(params, tokens, positions, caches, images, **static)
    if cache is None:
        return (logits, None, *tapped)
    return (logits, {"lengths": cache["lengths"] + tokens.shape[1], "layers": caches.layers}, *tapped)


_STATIC = ("cfg", "expert_path", "kernels", "logits_tail", "taps")
forward_step_jit = jax.jit(forward_apply, static_argnames=_STATIC)
paged_step_jit = jax.jit(forward_paged, static_argnames=_STATIC)


def step_compiler_options(environ=os.environ) -> dict:
    """XLA options of the serving step (`paged_step`, the prefill chunks' program), each a 0 / 1
    variable (default 1, XLA's own choice; the decode program keeps XLA's defaults: its TPOT is
    every token's):

    - ``KIMIK3_PREFILL_TRITON_GEMM=0`` compiles its GEMM fusions without XLA's Triton tilings: a
      cold compile of `small`'s 256-token chunk program in about half the time, since the
      autotuner does not compile and time ~20 Triton kernels a GEMM (RESULTS.md, serving); the
      demo's cold warm-up does not shorten (its compiles run in parallel: 25.9 s against 26.3).
    - ``KIMIK3_PREFILL_COMMAND_BUFFER=0`` launches its kernels one by one instead of as XLA's
      CUDA graphs (command buffers), whose update for each call's new buffers is host time on
      every step that runs a chunk."""
    options = {}
    for name, off in (
        ("KIMIK3_PREFILL_TRITON_GEMM", {"xla_gpu_enable_triton_gemm": False}),
        ("KIMIK3_PREFILL_COMMAND_BUFFER", {"xla_gpu_enable_command_buffer": ""}),
    ):
        value = environ.get(name, "1")
        if value not in ("0", "1"):
            raise ValueError(f"{name} must be 0 or 1; got {value!r}")
        if value == "0":
            options.update(off)
    return options


# The serving step: `forward_paged` with the view donated, so the pools (every MLA page and KDA
# state row) are updated in place instead of copied each call; export_at and valid_b are its
# arguments, the exports its third output.  The caller must drop its references to the donated
# view and keep the returned one.
paged_step = jax.jit(
    forward_paged, static_argnames=_STATIC, donate_argnames=("view",), compiler_options=step_compiler_options() or None
)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _image_embeddings(params, images, *, cfg):
    emb = ViT(cfg.vit, cfg.d_model).apply({"params": params["vit"]}, images.astype(params["embed_vd"].dtype))
    return emb.reshape(-1, cfg.d_model)


def image_embeddings(params: Params, cfg: ModelConfig, images):
    """The ViT's embeddings of images [N, S, S, C] -> [N * tokens_per_image, D], the rows that
    replace their <|image|> placeholders in order (what a serving engine computes once per
    request and splices chunk by chunk)."""
    images = check_images(images, None, cfg)
    return _image_embeddings(params, images, cfg=cfg)


def prepare_inputs(cfg: ModelConfig, tokens, *, images=None, cache: Cache | None = None, positions=None):
    """Check and convert `forward`'s inputs; returns (tokens, positions, images).

    Raises ValueError naming the problem for bad token ids, lengths, images or
    positions.  Checks that need values run only on concrete (non-traced) inputs.
    """
    tokens = _as_tokens(tokens, cfg)
    b, t = tokens.shape
    start = np.zeros((b,), np.int32) if cache is None else cache["lengths"]
    # numpy where the values are known: an eager call then compiles no small programs of its own
    xp = np if _concrete(start) else jnp
    start = np.asarray(start) if xp is np else start
    expected = start[:, None].astype(np.int32) + xp.arange(t, dtype=np.int32)[None]
    if positions is None:
        positions = jnp.asarray(expected)
    else:
        positions = jnp.asarray(positions, jnp.int32)
        if positions.shape != (b, t):
            raise ValueError(f"positions must have shape {(b, t)}; got {positions.shape}")
        if _concrete(positions) and _concrete(expected) and not np.array_equal(positions, expected):
            raise ValueError("positions must continue the cache: lengths + arange(T)")
    if _concrete(start):
        end = int(np.max(np.asarray(start))) + t
        limit = cfg.max_seq_len if cache is None else min(cfg.max_seq_len, cache_capacity(cfg, cache))
        if end > limit:
            raise ValueError(
                f"sequence of {end} tokens exceeds the context limit of {limit} tokens "
                f"(max_seq_len={cfg.max_seq_len}"
                + ("" if cache is None else f", cache capacity={cache_capacity(cfg, cache)}")
                + ")"
            )
    return tokens, positions, check_images(images, tokens, cfg, continuing=cache is not None)


def forward(
    params: Params,
    cfg: ModelConfig,
    tokens,
    *,
    images=None,
    cache: Cache | None = None,
    positions=None,
    expert_path: str = "grouped",
    kernels: str = "auto",
    programs: str = "auto",
):
    """Run the model on new tokens.

    Args:
      tokens: int [B, T] new token ids.
      images: [N, S, S, C] float in [0, 1] (or uint8) for the <|image|>
        placeholders among `tokens`, in row-major order; N * tokens_per_image
        placeholders are required.
      cache: from `init_cache` or a previous call; None runs without state
        (the whole sequence is `tokens`).
      positions: int [B, T] absolute positions; they must be the cache's next
        positions (``lengths + arange(T)``), and default to them.
      kernels: "auto" | "reference" | "pallas" (see `kimik3.ops`).
      programs: "whole" (one program for the model), "layerwise" (one per block kind, run
        layer by layer: `kimik3.layerwise`) or "auto" (layerwise where that compiles less: eager
        CPU calls of a deep model).  The math, and on the CPU the numbers, are the same.
    Returns:
      logits float32 [B, T, vocab] and the updated cache (None without one).
    Raises:
      ValueError (see `prepare_inputs`), before any launch.
    """
    tokens, positions, images = prepare_inputs(cfg, tokens, images=images, cache=cache, positions=positions)
    if layerwise.use_layerwise(programs, params, cfg, cache, tokens, images):
        return layerwise.forward(
            params, tokens, positions, cache, images, cfg=cfg, expert_path=expert_path, kernels=ops.resolve(kernels)
        )
    return forward_step_jit(
        params, tokens, positions, cache, images, cfg=cfg, expert_path=expert_path, kernels=ops.resolve(kernels)
    )


@functools.partial(jax.jit, static_argnames=("cfg", "layers", "kernels"))
def forward_taps_step(params, tokens, positions, *, cfg, layers, kernels):
    model = KimiK3(cfg, "grouped", kernels, taps=layers)
    (logits, _, _), state = model.apply({"params": params}, tokens, positions, mutable=["intermediates"])
    return logits, stacked_taps(state, layers)


def stacked_taps(state, layers: tuple[int, ...]):
    """The residual streams a `KimiK3(taps=layers)` pass sowed: [B, T, len(layers), D]."""
    return jnp.stack([state["intermediates"][f"tap_{i}"][0] for i in layers], axis=2)


def forward_taps(params: Params, cfg: ModelConfig, tokens, layers: tuple[int, ...], *, kernels: str = "auto"):
    """The model on whole sequences (no cache), with the residual stream after each of `layers`:
    (logits [B, T, vocab] fp32, hidden [B, T, len(layers), D] in the params' dtype).  What
    EAGLE-3's draft head reads from its target (low, middle and high layers).  Raises
    ValueError for a layer out of range or, in the scanned layout, inside the scan."""
    layers = tuple(int(i) for i in layers)
    if not layers or any(not 0 <= i < cfg.n_layers for i in layers):
        raise ValueError(f"layers must be a non-empty tuple in [0, {cfg.n_layers}); got {layers}")
    tokens, positions, _ = prepare_inputs(cfg, tokens)
    return forward_taps_step(params, tokens, positions, cfg=cfg, layers=layers, kernels=ops.resolve(kernels))


def _concrete(x) -> bool:
    """Whether x's values can be read here: not a tracer, nor a global array of a multi-process
    group with shards on other processes (`sharding.distributed`)."""
    if isinstance(x, jax.core.Tracer):
        return False
    return not isinstance(x, jax.Array) or x.is_fully_addressable


def _as_tokens(tokens, cfg: ModelConfig):
    if not hasattr(tokens, "dtype"):
        tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [B, T]; got shape {tokens.shape}")
    if tokens.shape[1] == 0:
        raise ValueError("tokens is empty: at least one token per sequence is needed")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integer ids; got dtype {tokens.dtype}")
    if _concrete(tokens):
        arr = np.asarray(tokens)
        bad = (arr < 0) | (arr >= cfg.vocab_size)
        if bad.any():
            raise ValueError(f"token id {int(arr[bad][0])} is out of range [0, {cfg.vocab_size})")
    if isinstance(tokens, np.ndarray):  # converted on the host: no device program for the cast
        tokens = tokens.astype(np.int32, copy=False)
    return jnp.asarray(tokens, jnp.int32)


def check_images(images, tokens, cfg: ModelConfig, continuing: bool = False):
    """continuing: the tokens extend a cache; an <|image|> there without images is one the model
    generated, a text token (`splice_image_embeddings`), not a prompt missing its images."""
    if cfg.vit is None and images is None:  # no vision encoder: <|image|>'s id is a text token like any
        return None
    n_placeholders = (
        int(np.sum(np.asarray(tokens) == tokenizer.IMAGE_ID)) if tokens is not None and _concrete(tokens) else None
    )
    if images is None:
        if n_placeholders and not continuing:
            raise ValueError(f"tokens hold {n_placeholders} <|image|> placeholders but no images were given")
        return None
    if cfg.vit is None:
        raise ValueError(f"config {cfg.name!r} has no vision encoder; images are not accepted")
    v = cfg.vit
    if not hasattr(images, "dtype"):
        images = np.asarray(images)
    want = (v.image_size, v.image_size, v.channels)
    if images.ndim != 4 or tuple(images.shape[1:]) != want:
        raise ValueError(f"images must be [N, {want[0]}, {want[1]}, {want[2]}]; got shape {tuple(images.shape)}")
    if images.dtype == np.uint8:
        images = jnp.asarray(images, jnp.float32) / 255.0
    elif not jnp.issubdtype(images.dtype, jnp.floating):
        raise ValueError(f"images must be float in [0, 1] or uint8; got dtype {images.dtype}")
    if _concrete(images) and not np.all(np.isfinite(np.asarray(images, np.float32))):
        raise ValueError("images contain NaN or infinite values")
    if n_placeholders is not None and n_placeholders != images.shape[0] * v.tokens_per_image:
        raise ValueError(
            f"{images.shape[0]} images need {images.shape[0] * v.tokens_per_image} <|image|> "
            f"placeholders ({v.tokens_per_image} each); tokens hold {n_placeholders}"
        )
    return jnp.asarray(images)


class Model:
    """`cfg` bound once: ``Model(cfg).forward(params, tokens, images=, cache=, positions=)``."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg

    def init(self, key, dtype=None) -> Params:
        return init_params(self.cfg, key, dtype)

    def init_cache(self, batch: int, max_len: int, dtype=None) -> Cache:
        return init_cache(self.cfg, batch, max_len, dtype)

    def forward(self, params, tokens, *, images=None, cache=None, positions=None):
        return forward(params, self.cfg, tokens, images=images, cache=cache, positions=positions)
