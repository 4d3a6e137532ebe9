"""One quantized checkpoint for every serving manifest, and loading it by manifest.

`quantize_checkpoint(IN, OUT)` (``kimik3 quantize``) reads a checkpoint (`kimik3.checkpoint`)
and writes what the serving manifests (`kimik3.quantization.SERVING_MANIFESTS`) need, each
tensor once::

    OUT/config.json    the ModelConfig
    OUT/quant.json     the manifests this checkpoint serves, every stored entry (format, GEMM
                       shape) and where the weights came from
    OUT/plain/         orbax: params some manifest keeps unquantized (bf16 in the config's dtype;
                       fp32 where the model keeps fp32)
    OUT/<fmt>/         orbax, one per format (fp8, mxfp8, mxfp4): {"values", "scales"} of each
                       param a manifest stores in it, as bytes (uint8; e4m3 / e8m0 bit patterns)

The routed experts are MXFP4 in both ``fp8_attn`` and ``mxfp8_attn``: stored once.  With
``keep_bf16_experts`` they are also kept plain, and the ``*_bf16_moe`` manifests (quantized
attention, the MoE path in bf16) load from the same directory.

Each weight is stored in its GEMM form (`gemm_shape`: [K, N], experts [E, K, N]) and quantized
on its own; `load(OUT, manifest)` checks every entry against what the manifest needs for this
config (format, shape, scales well formed: `formats.check`) before anything runs, builds the
checkpoint layout with `QTensor` leaves and fuses it (`kimik3.fused`: members concatenate, bits
unchanged).  A manifest this checkpoint does not serve, a missing, mis-shaped or corrupt entry, or
a plain checkpoint asked for a manifest are ValueErrors naming the problem.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from kimik3 import checkpoint, fused, model, quantization
from kimik3.config import ModelConfig
from kimik3.quant import formats

log = logging.getLogger(__name__)

VERSION = 1
PLAIN = ("bf16", "fp32")
_VALUE_DTYPES = {"fp8": jnp.float8_e4m3fn, "mxfp8": jnp.float8_e4m3fn, "mxfp4": jnp.uint8}
_SCALE_DTYPES = {"fp8": jnp.float32, "mxfp8": jnp.float8_e8m0fnu, "mxfp4": jnp.float8_e8m0fnu}


def is_quantized(path: str | os.PathLike) -> bool:
    return os.path.exists(os.path.join(os.fspath(path), "quant.json"))


def gemm_shape(name: str, shape: tuple) -> tuple:
    """The [K, N] (experts: [E, K, N]) matrix a weight is in its GEMM: x @ W contracts the
    leading axes its name's letters put first (``_hvd``: H and V; ``_elf`` / ``_efl``: E is a
    batch axis, then one; otherwise one)."""
    if name.endswith(("_elf", "_efl")):
        return (shape[0], shape[1], math.prod(shape[2:]))
    if name.endswith("_hvd"):
        return (shape[0] * shape[1], math.prod(shape[2:]))
    return (shape[0], math.prod(shape[1:]))


def _paths(tree):
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        yield jax.tree_util.keystr(path, simple=True, separator="/"), leaf


def _set(tree: dict, path: str, value):
    *parents, name = path.split("/")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[name] = value


def _get(tree: dict, path: str):
    for p in path.split("/"):
        tree = tree[p]
    return tree


def manifest_formats(cfg: ModelConfig, names) -> dict:
    """{manifest: {param path: format}} over the config's params."""
    abstract = model.abstract_params(cfg, "float32")
    return {
        name: {path: quantization.MANIFESTS[name].format_of(path) for path, _ in _paths(abstract)} for name in names
    }


def served_manifests(keep_bf16_experts: bool) -> tuple[str, ...]:
    return tuple(m for m in quantization.SERVING_MANIFESTS if keep_bf16_experts or not m.endswith("_bf16_moe"))


def _served_leaf(path: str, leaf, rules: quantization.QuantManifest, dtype):
    """One checkpoint-layout leaf as `rules` stores it: a QTensor in its GEMM form, or the plain
    leaf cast to `dtype` (fp32 where the manifest keeps fp32)."""
    fmt = rules.format_of(path)
    if fmt in PLAIN:
        return jnp.asarray(leaf).astype(jnp.float32 if fmt == "fp32" else jnp.dtype(dtype))
    shape = gemm_shape(path.rsplit("/", 1)[-1], tuple(leaf.shape))
    return formats.quantize(jnp.asarray(leaf, jnp.float32).reshape(shape), fmt)


def _served_tree(tree, rules: quantization.QuantManifest, dtype, prefix: str = "") -> dict:
    """`_served_leaf` of every leaf of `tree` (paths under `prefix`), as a nested dict."""
    out = {}
    for path, leaf in _paths(tree):
        _set(out, path, _served_leaf(prefix + path, leaf, rules, dtype))
    return out


def quantize_params(params, cfg: ModelConfig, manifest: str, *, fuse: bool = True):
    """The checkpoint-layout `params` as `manifest` stores them, in memory (what `load` returns
    for a checkpoint `quantize_checkpoint` wrote from them): QTensors in their GEMM form,
    plain leaves cast to the config's dtype (fp32 where the model keeps it); fused unless
    fuse=False.  For benchmarks and tests; serving loads checkpoints."""
    out = _served_tree(params, quantization.MANIFESTS[manifest], cfg.dtype)
    return fused.fuse_projections(out, cfg) if fuse else out


def init_served_params(cfg: ModelConfig, key, manifest: str = "bf16", *, on_layer=None):
    """Random params drawn on the device straight into the serving layout of `manifest`:
    ``quantize_params(model.init_params(cfg, key), cfg, manifest)``, leaf for leaf, without ever
    holding the whole checkpoint-layout model.  Block by block: draw it (`model.init_params`'s
    per-block program and key), store each leaf as the manifest says, fuse the block
    (`kimik3.fused.fuse_layer`), and drop the draw before the next block, so the peak is the
    served params plus one block's draw (Kimi-Linear with MXFP4 experts: 29 GB served, where its
    bf16 draw is 98 GB).  on_layer(i, block) -> block, if given, runs on each served block before
    the next is drawn (e.g. moving MXFP4 experts into a kernel's layout; the result then no longer
    equals `quantize_params`'s).  Unknown manifests are a ValueError."""
    if manifest not in quantization.MANIFESTS:
        raise ValueError(f"unknown manifest {manifest!r}; known: {sorted(quantization.MANIFESTS)}")
    rules, dtype = quantization.MANIFESTS[manifest], jnp.dtype(cfg.dtype).name
    top_key, blocks_key = jax.random.split(key)
    with model.cheap_threefry():
        out = _served_tree(model.init_top(top_key, cfg=cfg, dtype=dtype), rules, dtype)
        for i in range(cfg.n_layers):
            name = f"layer_{i}"
            drawn = model.init_block(
                jax.random.fold_in(blocks_key, i), cfg=cfg, layer=model.first_of_kind(cfg, i), dtype=dtype
            )
            block = fused.fuse_layer(_served_tree(drawn, rules, dtype, prefix=f"{name}/"))
            del drawn
            out[name] = block if on_layer is None else on_layer(i, block)
            jax.block_until_ready(out[name])  # the draw's buffers go before the next block's are made
    log.info("drew %s at random as %s, block by block", cfg.name, manifest)
    return out


def _bits(q: formats.QTensor) -> dict:
    """A QTensor's arrays as the bytes orbax stores (uint8 views of the float8 types)."""
    as_bytes = lambda a: jax.lax.bitcast_convert_type(a, jnp.uint8) if a.dtype.itemsize == 1 else a
    return {"values": np.asarray(as_bytes(q.values)), "scales": np.asarray(as_bytes(q.scales))}


def quantize_checkpoint(
    src: str | os.PathLike, out: str | os.PathLike, *, keep_bf16_experts: bool = False, progress=None
) -> dict:
    """Write the quantized checkpoint of `src` to `out` (see the module comment).  Returns the
    quant.json record.  progress(done, total) after each tensor, if given."""
    src, out = os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(out))
    if is_quantized(src):
        raise ValueError(f"{src} is already a quantized checkpoint")
    params, cfg = checkpoint.restore(src)
    names = served_manifests(keep_bf16_experts)
    formats_of = manifest_formats(cfg, names)
    leaves = dict(_paths(params))
    plain_dtype = jnp.dtype(cfg.dtype)
    plain, quantized, entries = {}, {}, {}
    todo = [(path, fmt) for path in leaves for fmt in sorted({formats_of[m][path] for m in names})]
    for i, (path, fmt) in enumerate(todo):
        leaf = leaves[path]
        if fmt in PLAIN:
            dtype = jnp.float32 if fmt == "fp32" else plain_dtype
            _set(plain, path, np.asarray(jnp.asarray(leaf, jnp.float32).astype(dtype)))
        else:
            shape = gemm_shape(path.rsplit("/", 1)[-1], tuple(leaf.shape))
            q = formats.quantize(jnp.asarray(leaf, jnp.float32).reshape(shape), fmt)
            _set(quantized.setdefault(fmt, {}), path, _bits(q))
            entries.setdefault(fmt, {})[path] = list(shape)
        if progress is not None:
            progress(i + 1, len(todo))
    os.makedirs(out, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(out, "plain"), plain)
        for fmt, tree in quantized.items():
            ckptr.save(os.path.join(out, fmt), tree)
    with open(os.path.join(out, "config.json"), "w") as f:
        f.write(cfg.to_json())
    record = {
        "version": VERSION,
        "source": src,
        "config": cfg.name,
        "config_sha256": hashlib.sha256(cfg.to_json().encode()).hexdigest(),
        "keep_bf16_experts": keep_bf16_experts,
        "manifests": list(names),
        "entries": entries,
        "bytes": {m: sum(_entry_bytes(formats_of[m][p], leaves[p].shape) for p in leaves) for m in names},
    }
    with open(os.path.join(out, "quant.json"), "w") as f:
        json.dump(record, f, indent=1)
    log.info("wrote the %s quantized checkpoint of %s to %s (manifests %s)", cfg.name, src, out, ", ".join(names))
    return record


def _entry_bytes(fmt: str, shape) -> int:
    return int(math.ceil(math.prod(shape) * quantization.BITS_PER_VALUE[fmt] / 8))


def read_record(path: str | os.PathLike) -> dict:
    path = os.fspath(path)
    if not is_quantized(path):
        raise ValueError(
            f"{path} is not a quantized checkpoint (no quant.json): write one with "
            f"`kimik3 quantize --checkpoint {path} --out DIR`"
        )
    with open(os.path.join(path, "quant.json")) as f:
        record = json.load(f)
    if record.get("version") != VERSION:
        raise ValueError(f"{path}: quantized checkpoint version {record.get('version')}; this kimik3 reads {VERSION}")
    return record


def _restore(path: str, item: str):
    with ocp.StandardCheckpointer() as ckptr:
        stored = ckptr.metadata(os.path.join(path, item))
        tree = getattr(stored, "item_metadata", stored)
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), tree)
        return ckptr.restore(os.path.join(path, item), target)


def _qtensor(path: str, fmt: str, arrays: dict, want_shape: tuple) -> formats.QTensor:
    """The stored bytes as a checked QTensor of `want_shape`, or a ValueError naming the entry."""
    values, scales = arrays.get("values"), arrays.get("scales")
    if values is None or scales is None:
        raise ValueError(f"{path}: the {fmt} entry lacks its values or scales")
    as_type = lambda a, dtype: (
        jax.lax.bitcast_convert_type(jnp.asarray(a), dtype)
        if jnp.dtype(dtype).itemsize == 1 and a.dtype == jnp.uint8
        else jnp.asarray(a)
    )
    q = formats.QTensor(as_type(values, _VALUE_DTYPES[fmt]), as_type(scales, _SCALE_DTYPES[fmt]), fmt, want_shape)
    try:
        return formats.check(q)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


def load(path: str | os.PathLike, manifest: str, *, fuse: bool = True):
    """(params, cfg) of a quantized checkpoint as `manifest` stores them: the serving layout
    (`kimik3.fused`) with `QTensor` leaves, or with fuse=False the checkpoint layout.  Checked
    whole before it returns (see the module comment)."""
    path = os.path.abspath(os.fspath(path))
    record = read_record(path)
    if manifest not in quantization.MANIFESTS:
        raise ValueError(f"unknown manifest {manifest!r}; known: {sorted(quantization.MANIFESTS)}")
    if manifest not in record["manifests"]:
        hint = " (written without --keep-bf16-experts)" if manifest.endswith("_bf16_moe") else ""
        raise ValueError(f"{path} serves the manifests {record['manifests']}, not {manifest!r}{hint}")
    cfg = checkpoint.load_config(path)
    if hashlib.sha256(cfg.to_json().encode()).hexdigest() != record["config_sha256"]:
        raise ValueError(f"{path}: config.json is not the config the weights were quantized for")
    want = manifest_formats(cfg, [manifest])[manifest]
    abstract = dict(_paths(model.abstract_params(cfg, "float32")))
    needed = sorted({f for f in want.values() if f not in PLAIN})
    stored = {fmt: _restore(path, fmt) for fmt in needed if os.path.isdir(os.path.join(path, fmt))}
    plain = _restore(path, "plain")
    params = {}
    for p, fmt in want.items():
        if fmt in PLAIN:
            try:
                leaf = _get(plain, p)
            except KeyError:
                raise ValueError(
                    f"{path}: manifest {manifest} keeps {p} unquantized, but the checkpoint holds no plain copy"
                ) from None
            if tuple(leaf.shape) != tuple(abstract[p].shape):
                raise ValueError(f"{path}: {p} is {tuple(leaf.shape)}; {cfg.name} needs {tuple(abstract[p].shape)}")
            _set(params, p, jnp.asarray(leaf))
            continue
        shape = gemm_shape(p.rsplit("/", 1)[-1], tuple(abstract[p].shape))
        if record["entries"].get(fmt, {}).get(p) != list(shape):
            raise ValueError(
                f"{path}: manifest {manifest} needs {p} in {fmt} {shape}; the checkpoint has "
                f"{[f for f, e in record['entries'].items() if p in e] or 'no quantized copy'}"
            )
        try:
            arrays = _get(stored[fmt], p)
        except KeyError:
            raise ValueError(f"{path}: the {fmt} entry of {p} is missing from its store") from None
        _set(params, p, _qtensor(p, fmt, arrays, shape))
    log.info("loaded %s as %s from %s", cfg.name, manifest, path)
    return (fused.fuse_projections(params, cfg) if fuse else params), cfg


def load_params(path: str | os.PathLike, manifest: str | None = None):
    """(params, cfg) of any checkpoint: `kimik3.checkpoint.restore` without a manifest, `load`
    with one (clear errors where the two do not match)."""
    if manifest is None:
        if is_quantized(path):
            raise ValueError(
                f"{path} is a quantized checkpoint: pass --manifest, one of {read_record(path)['manifests']}"
            )
        return checkpoint.restore(path)
    return load(path, manifest)
