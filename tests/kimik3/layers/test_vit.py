"""ViT: shapes, patch order, and embeddings landing on the placeholders."""

import jax
import jax.numpy as jnp
import numpy as np

from kimik3 import tokenizer
from kimik3.layers.vit import ViT, merge_patches, patchify
from kimik3.model import splice_image_embeddings


def test_vit_maps_images_to_tokens_per_image_embeddings(rng, tiny_cfg):
    v = tiny_cfg.vit
    images = jnp.asarray(rng.random((3, v.image_size, v.image_size, 3)), jnp.float32)
    vit = ViT(v, tiny_cfg.d_model)
    params = vit.init(jax.random.PRNGKey(0), images)
    emb = vit.apply(params, images)
    assert emb.shape == (3, v.tokens_per_image, tiny_cfg.d_model)
    # images are encoded independently
    np.testing.assert_allclose(vit.apply(params, images[1:2])[0], emb[1], atol=1e-5)


def test_patchify_is_row_major_and_merge_groups_neighbours():
    img = jnp.arange(4 * 4).reshape(1, 4, 4, 1).astype(jnp.float32)
    p = patchify(img, 2)
    np.testing.assert_array_equal(p[0, 1], [2, 3, 6, 7])  # top-right patch
    m = merge_patches(jnp.arange(16.0).reshape(1, 16, 1), side=4, merge=2)
    np.testing.assert_array_equal(m[0, 0], [0, 1, 4, 5])


def test_splice_replaces_placeholders_in_order():
    x = jnp.zeros((2, 4, 1))
    toks = jnp.array([[1, tokenizer.IMAGE_ID, 2, tokenizer.IMAGE_ID], [tokenizer.IMAGE_ID, 3, 4, 5]])
    emb = jnp.array([[[10.0], [11.0], [12.0]]])  # one image of three tokens
    out = splice_image_embeddings(x, toks, emb)
    np.testing.assert_array_equal(out[..., 0], [[0, 10, 0, 11], [12, 0, 0, 0]])


def test_placeholders_past_the_last_image_row_stay_text_tokens():
    # A generated <|image|> (after the prompt's placeholders) is embedded like any generated
    # token, as a decode step embeds it: the oracle's full recompute must do the same.
    x = jnp.arange(5.0).reshape(1, 5, 1) * -1
    toks = jnp.array([[tokenizer.IMAGE_ID, 1, tokenizer.IMAGE_ID, tokenizer.IMAGE_ID, 2]])
    emb = jnp.array([[[10.0], [11.0]]])
    np.testing.assert_array_equal(splice_image_embeddings(x, toks, emb)[0, :, 0], [10, -1, 11, -3, -4])
    # a chunk starting after the first row: its first placeholder takes row 1, the next is text
    np.testing.assert_array_equal(splice_image_embeddings(x, toks, emb, first_row=1)[0, :, 0], [11, -1, -2, -3, -4])
