"""The forward as one compiled program per block kind, run layer by layer from Python.

A whole-model program makes XLA optimize and emit every layer it holds: on a CPU, where the
step's run is long beside its launches, that is most of a deep model's first call (XLA:CPU
compiles each distinct fused computation once, but its HLO passes, thunk emission, JAX's
tracing and lowering all grow with the layers).  The layer scan (`kimik3.stacked`) is the
GPU's answer; on XLA:CPU its body's dynamic slices of every stacked weight add more distinct
fusions than the scan saves (benchmarks/RESULTS.md, the compile section).  Here instead::

    embed program     tokens [B, T] (+ images) -> x [B, T, D]
    mixer program     one per mixer kind (KDA, MLA), traced for the kind's first layer (a
                      block's half depends only on its kind): `Block.mix`, (x, positions, the
                      layer's cache entry) -> (x, the entry written), called once per layer
    FFN program       one per FFN kind (dense, MoE): `Block.ffn`, x -> x
    head program      x -> fp32 logits [B, T, V]

so a model compiles its 2 + 2 kinds and not its layers (one program per (mixer, FFN) pair
would compile the KDA mixer and the MoE twice: the dense FFN shares layer 0 with a KDA
mixer).  The math is `kimik3.model`'s: the same `Block` halves, `embed_inputs` and
`head_logits`, and the results are the whole program's (tests/kimik3/test_layerwise.py).
The price is the run: separate programs reuse no temp buffer across layers (see the compile
section of benchmarks/RESULTS.md), so loops that call the model many times (`generate`'s
decode, the engine) keep the whole program.

`kimik3.model.forward` takes this path where it pays (`use_layerwise`): eager calls on the
CPU with the checkpoint or fused layout and no cache or a contiguous one, when the model has
at least twice as many layers as (mixer, FFN) kinds.  Everything else (a paged view, the
scanned layout, a call under an outer `jax.jit`, the GPU, where one program per step is one
CUDA graph) runs the whole program.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from kimik3 import stacked
from kimik3.caches import is_paged
from kimik3.block import Block, block_kind, embed_inputs, first_of_kind, head_logits
from kimik3.config import ModelConfig
from kimik3.layers.primitives import RMSNorm
from kimik3.layers.vit import ViT

PROGRAMS = ("auto", "whole", "layerwise")


def n_kinds(cfg: ModelConfig) -> int:
    """The model's distinct (mixer, FFN) block kinds (3 for every preset)."""
    return len({block_kind(cfg, i) for i in range(cfg.n_layers)})


def _on_cpu(leaf) -> bool:
    devices = getattr(leaf, "devices", None)
    return devices is not None and all(d.platform == "cpu" for d in devices())


def use_layerwise(programs: str, params, cfg: ModelConfig, cache, *args) -> bool:
    """Whether `kimik3.model.forward` runs layer by layer: "whole" never, "layerwise" wherever
    it can (ValueError where it cannot), "auto" where it can and pays (see the module comment)."""
    if programs not in PROGRAMS:
        raise ValueError(f"programs must be one of {PROGRAMS}; got {programs!r}")
    if programs == "whole":
        return False
    blocker = None
    if is_paged(cache):
        blocker = "a paged cache view (the engine's pools) runs the whole program"
    elif stacked.is_stacked(params):
        blocker = "params in the scanned layout (kimik3.stacked) run the whole program"
    elif any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((params, cache, args))):
        blocker = "a call under jax.jit (traced inputs) is one program already"
    if programs == "layerwise":
        if blocker:
            raise ValueError(f"programs='layerwise' is not available here: {blocker}")
        return True
    return blocker is None and _on_cpu(params["embed_vd"]) and cfg.n_layers >= 2 * n_kinds(cfg)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _embed_program(top, tokens_bt, images, *, cfg: ModelConfig):
    vit = None
    if cfg.vit is not None and images is not None and not isinstance(images, dict):
        vit = lambda im: ViT(cfg.vit, cfg.d_model).apply({"params": top["vit"]}, im)
    return embed_inputs(top["embed_vd"], tokens_bt, images, vit)


@functools.partial(jax.jit, static_argnames=("cfg", "layer", "expert_path", "kernels"))
def _mixer_program(
    block_params, x_btd, positions_bt, cache, *, cfg: ModelConfig, layer: int, expert_path: str, kernels: str
):
    return Block(cfg, layer, expert_path, kernels).apply(
        {"params": block_params}, x_btd, positions_bt, cache, method="mix"
    )


@functools.partial(jax.jit, static_argnames=("cfg", "layer", "expert_path", "kernels"))
def _ffn_program(block_params, x_btd, *, cfg: ModelConfig, layer: int, expert_path: str, kernels: str):
    return Block(cfg, layer, expert_path, kernels).apply({"params": block_params}, x_btd, method="ffn")


@functools.partial(jax.jit, static_argnames=("cfg",))
def _head_program(final_norm, lm_head_dv, x_btd, *, cfg: ModelConfig):
    return head_logits(RMSNorm(cfg.d_model, cfg.norm_eps).apply({"params": final_norm}, x_btd), lm_head_dv)


def forward(params, tokens_bt, positions_bt, cache, images, *, cfg: ModelConfig, expert_path: str, kernels: str):
    """`kimik3.model.forward_step_jit`'s (logits, cache) for checked inputs (`kimik3.model.prepare_inputs`),
    cache None or contiguous (`kimik3.model.init_cache`), params unstacked."""
    top = {k: params[k] for k in ("embed_vd", "vit") if k in params}
    x = _embed_program(top, tokens_bt, images, cfg=cfg)
    layers = None if cache is None else list(cache["layers"])
    for i in range(cfg.n_layers):
        block = params[f"layer_{i}"]
        # each half's params only: a program's arguments are what it reads
        mixer = {k: v for k, v in block.items() if k in ("mixer_norm", "kda", "mla")}
        ffn = {k: v for k, v in block.items() if k in ("ffn_norm", "mlp", "moe")}
        x, new, _ = _mixer_program(
            mixer,
            x,
            positions_bt,
            None if layers is None else layers[i],
            cfg=cfg,
            layer=first_of_kind(cfg, i, "mixer"),
            expert_path=expert_path,
            kernels=kernels,
        )
        x = _ffn_program(ffn, x, cfg=cfg, layer=first_of_kind(cfg, i, "ffn"), expert_path=expert_path, kernels=kernels)
        if layers is not None:
            layers[i] = new
    logits = _head_program(params["final_norm"], params["lm_head_dv"], x, cfg=cfg)
    if cache is None:
        return logits, None
    # the lengths on the host: `prepare_inputs` has read them already, and an eager add would
    # compile a program of its own
    lengths = jnp.asarray(np.asarray(cache["lengths"]) + np.int32(tokens_bt.shape[1]))
    return logits, {"lengths": lengths, "layers": tuple(layers)}


def programs_compiled() -> dict:
    """How many programs of each part this process holds (a model compiles one block program
    per kind and shape, not per layer)."""
    return {
        "embed": _embed_program._cache_size(),
        "mixer": _mixer_program._cache_size(),
        "ffn": _ffn_program._cache_size(),
        "head": _head_program._cache_size(),
    }
