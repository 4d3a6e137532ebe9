"""Save and restore params plus config with orbax; Hugging Face model directories restore too.

Layout of a checkpoint directory::

    <path>/config.json   the ModelConfig
    <path>/params/       orbax StandardCheckpointer tree

A Hugging Face directory (a ``config.json`` with a ``model_type`` beside safetensors: a
Kimi-Linear checkpoint) is read by `kimik3.hf` wherever a checkpoint is taken.
"""

from __future__ import annotations

import json
import logging
import os

import jax
import orbax.checkpoint as ocp

from kimik3 import hf
from kimik3.config import ModelConfig
from kimik3.model import cast_params

log = logging.getLogger(__name__)


def save(path: str | os.PathLike, params, cfg: ModelConfig) -> None:
    """Write params and config to `path` (a new directory)."""
    path = os.path.abspath(os.fspath(path))
    os.makedirs(path, exist_ok=True)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(path, "params"), params)
    with open(os.path.join(path, "config.json"), "w") as f:
        f.write(cfg.to_json())
    log.info("saved checkpoint of %s to %s", cfg.name, path)


def load_config(path: str | os.PathLike) -> ModelConfig:
    if hf.is_hf_dir(os.fspath(path)):
        return hf.read_config(os.fspath(path))
    with open(os.path.join(os.fspath(path), "config.json")) as f:
        return ModelConfig.from_dict(json.load(f))


def restore(path: str | os.PathLike, dtype=None):
    """Read (params, cfg) from `path`.

    With `dtype`, floating params are restored as that dtype (those the model
    keeps fp32 stay fp32), the cast happening during the read.
    """
    path = os.path.abspath(os.fspath(path))
    if hf.is_hf_dir(path):
        return hf.load(path, dtype=dtype)
    cfg = load_config(path)
    with ocp.StandardCheckpointer() as ckptr:
        stored = ckptr.metadata(os.path.join(path, "params"))
        stored_tree = getattr(stored, "item_metadata", stored)
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), stored_tree)
        if dtype is not None:
            target = cast_params(target, dtype)
        params = ckptr.restore(os.path.join(path, "params"), target)
    return params, cfg
