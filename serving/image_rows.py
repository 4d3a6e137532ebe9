"""The ViT's rows of a request's images, through the encoder cache (L3) and optionally the host tier.

Every image runs through the ViT alone (`kimik3.model.image_embeddings`), cached or not; a
hit, in the engine's `EncoderCache` by (tenant, image content), holds exactly the rows a miss
computes.  With
`EngineConfig.encoder_cache_to_host` the rows an engine computes are written to the host tier
too and an encoder-cache miss looks there first, so another engine on the same store finds
them.  A tier fault is a miss (reads) or a lost spill (writes), never an error.
"""

from __future__ import annotations

import hashlib
import logging

import jax
import jax.numpy as jnp
import numpy as np

from cache.host_tier import make_key
from kimik3 import model

log = logging.getLogger(__name__)


class ImageRows:
    """``rows = ImageRows(engine)(request)``: [n_images * tokens_per_image, D] for the request's images."""

    def __init__(self, engine):
        self.eng = engine
        self._vit_rows = None  # ShapeDtypeStruct of one image's ViT rows, once needed

    def __call__(self, req):
        """The ViT's rows [n_images * tokens_per_image, D] for the request's images, one image at a
        time with or without L3 (the encoder cache): a hit holds exactly the rows a miss computes,
        and an engine without L3 computes them too (a batch of N images through the ViT rounds
        differently from N batches of one in bf16 on a GPU, where GEMM tiles follow the row
        count), so the cache tier changes when the work is done, never its bits.  The ViT
        compiles for one shape."""
        if self.eng.encoder_cache is None:
            rows = [model.image_embeddings(self.eng.params, self.eng.cfg, img[None]) for img in req.images]
            return rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=0)
        rows = []
        for img, item in zip(req.images, req.mm_items):
            key = self.eng.encoder_cache.key(item.content_hash, req.cache_salt)
            r = self.eng.encoder_cache.get(key)
            if r is None:
                r = self._from_host(key)
            if r is None:
                r = model.image_embeddings(self.eng.params, self.eng.cfg, img[None])
                self.eng.encoder_cache.put(key, r)
                self._to_host(key, r)
            rows.append(r)
        return rows[0] if len(rows) == 1 else jnp.concatenate(rows, axis=0)

    def _host_key(self, key: tuple) -> str | None:
        if not (self.eng.config.encoder_cache_to_host and self.eng.manager.host is not None):
            return None
        tenant, content = key
        return make_key(
            self.eng.manager.spec.namespace,
            "vit",
            hashlib.blake2b(tenant.encode() + b"\0" + content, digest_size=16).digest(),
        )

    def _from_host(self, key: tuple):
        hk = self._host_key(key)
        if hk is None:
            return None
        if self._vit_rows is None:  # what one image's rows are, without running the ViT
            s = self.eng.cfg.vit.image_size
            self._vit_rows = jax.eval_shape(
                lambda: model.image_embeddings(
                    self.eng.params, self.eng.cfg, np.zeros((1, s, s, self.eng.cfg.vit.channels), np.float32)
                )
            )
        out = np.empty(self._vit_rows.shape, self._vit_rows.dtype)
        try:
            found = self.eng.manager.host.batch_get_into([hk], [out])[0]
        except Exception as e:  # noqa: BLE001 - a tier fault is a miss
            log.warning("host tier read of ViT rows failed: %r", e)
            found = False
        if not found:
            return None
        rows = jnp.asarray(out)
        self.eng.encoder_cache.put(key, rows)
        self.eng.encoder_cache.host_hits += 1
        return rows

    def _to_host(self, key: tuple, rows) -> None:
        hk = self._host_key(key)
        if hk is None:
            return
        try:
            self.eng.manager.host.batch_put([hk], [np.asarray(rows)])
        except Exception as e:  # noqa: BLE001 - a tier fault costs the spill, nothing else
            log.warning("host tier write of ViT rows failed: %r", e)
