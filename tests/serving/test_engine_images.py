"""Requests with images: the engine splices each request's ViT rows chunk by chunk, and image
content hashes enter the block hashes, so prefix hits never cross a different image."""

import numpy as np
import pytest

from kimik3 import tokenizer
from kimik3.generate import generate
from serving.disagg import DisaggregatedServer
from serving.engine import Engine

PAGE = 16


def _engine(params, cfg, **kw):
    # Chunks of 8 tokens: an image's placeholders span several chunks.
    kw = dict(
        dict(
            num_pages=48,
            num_slots=3,
            num_snapshots=12,
            page_tokens=PAGE,
            kda_block_tokens=4 * PAGE,
            max_pages_per_request=16,
            prefill_chunk_tokens=8,
            kernels="reference",
        ),
        **kw,
    )
    return Engine(params, cfg, **kw)


def _chat(cfg, text, n_images):
    return tokenizer.apply_chat_template(
        [tokenizer.Message("user", text, n_images=n_images)], tokens_per_image=cfg.vit.tokens_per_image
    )


def _oracle(params, cfg, prompt, n, images):
    return generate(params, cfg, prompt, n, images=images).tokens.tolist()


def test_image_requests_beside_text_requests_equal_the_oracle(rng, tiny_cfg, tiny_params):
    eng = _engine(tiny_params, tiny_cfg)
    imgs = rng.random((2, 16, 16, 3)).astype(np.float32)
    with_images = _chat(tiny_cfg, "what is in these pictures, and which is brighter?", 2)
    text_only = _chat(tiny_cfg, "no pictures here", 0)
    a = eng.submit(with_images, 6, images=imgs)
    b = eng.submit(text_only, 6)
    eng.run(max_steps=300)
    assert a.output == _oracle(tiny_params, tiny_cfg, with_images, 6, imgs)
    assert b.output == _oracle(tiny_params, tiny_cfg, text_only, 6, None)


def test_a_second_turn_hits_only_with_the_same_image(rng, tiny_cfg, tiny_params):
    eng = _engine(tiny_params, tiny_cfg)
    img, other = (rng.random((1, 16, 16, 3)).astype(np.float32) for _ in range(2))
    turn1 = _chat(tiny_cfg, "describe the picture in some detail please", 1)
    first = turn1.index(tokenizer.IMAGE_ID)
    r1 = eng.submit(turn1, 4, images=img)
    eng.run(max_steps=200)
    turn2 = turn1 + r1.output + _chat(tiny_cfg, "and the colours?", 0)[1:]
    same = eng.submit(turn2, 4, images=img)
    eng.run(max_steps=200)
    assert same.cached_tokens >= PAGE > first + tiny_cfg.vit.tokens_per_image  # a hit past the image
    assert same.output == _oracle(tiny_params, tiny_cfg, turn2, 4, img)
    diff = eng.submit(turn2, 4, images=other)  # same token ids, another image
    eng.run(max_steps=200)
    assert diff.cached_tokens <= first  # nothing from the image's page on
    assert diff.output == _oracle(tiny_params, tiny_cfg, turn2, 4, other)


def test_pd_handoff_carries_the_images(rng, tiny_cfg, tiny_params):
    imgs = rng.random((1, 16, 16, 3)).astype(np.float32)
    prompt = _chat(tiny_cfg, "a picture", 1)
    server = DisaggregatedServer(
        _engine(tiny_params, tiny_cfg, role="prefill"), _engine(tiny_params, tiny_cfg, role="decode"), "direct"
    )
    req = server.submit(prompt, 5, images=imgs)
    done = server.run(max_steps=200)
    assert done[req.request_id].output == _oracle(tiny_params, tiny_cfg, prompt, 5, imgs)


def test_image_inputs_are_checked(rng, tiny_cfg, tiny_params):
    eng = _engine(tiny_params, tiny_cfg)
    prompt = _chat(tiny_cfg, "two pictures", 2)
    with pytest.raises(ValueError, match="no images"):
        eng.submit(prompt, 3)
    with pytest.raises(ValueError, match="placeholders"):
        eng.submit(prompt, 3, images=rng.random((1, 16, 16, 3)))
    with pytest.raises(ValueError, match="images must be"):
        eng.submit(prompt, 3, images=rng.random((2, 8, 8, 3)))
    bad = rng.random((2, 16, 16, 3))
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        eng.submit(prompt, 3, images=bad)
    assert not eng.waiting


def test_the_encoder_cache_serves_an_image_whose_prefix_misses_and_changes_no_token(rng, tiny_cfg, tiny_params):
    """The encoder cache (L3): a second request with the same image behind a different text (its prefix
    misses the prefix cache) takes the image's ViT rows from the encoder cache; an image that
    differs in one pixel, or the same image of another tenant, misses; every output equals the
    oracle's and the outputs of an engine with no encoder cache."""
    img = rng.random((1, 16, 16, 3)).astype(np.float32)
    one_pixel = img.copy()
    one_pixel[0, 5, 7, 1] += 1 / 255
    first = _chat(tiny_cfg, "what is this?", 1)
    other_text = _chat(tiny_cfg, "a different question, same picture: is it bright?", 1)
    cases = [(first, img, None), (other_text, img, None), (other_text, one_pixel, None), (first, img, "tenant-b")]
    outs = {}
    for budget in (64 << 20, 0):
        eng = _engine(tiny_params, tiny_cfg, encoder_cache_bytes=budget)
        outs[budget] = []
        for prompt, image, salt in cases:  # one at a time: each finds what the earlier ones left
            req = eng.submit(prompt, 4, images=image, cache_salt=salt)
            eng.run(max_steps=200)
            outs[budget].append(req.output)
        if budget:
            second = eng.encoder_cache.stats
            assert (second.hits, second.misses) == (1, 3), second  # only case 2 hits
            assert eng.encoder_cache.bytes_held > 0
        else:
            assert eng.encoder_cache is None
    assert outs[64 << 20] == outs[0]
    for (prompt, image, _), out in zip(cases, outs[0]):
        assert out == _oracle(tiny_params, tiny_cfg, prompt, 4, image)


def test_vit_rows_spilled_to_a_shared_host_tier_serve_another_engine(rng, tiny_cfg, tiny_params):
    """EngineConfig.encoder_cache_to_host: an engine writes the ViT rows it computes to the host
    tier; a second engine on the same tier (its own encoder cache empty, its prefix a miss) takes
    them from there instead of running the ViT, with the oracle's tokens; another tenant does not."""
    from cache.host_tier import EmbeddedHostKVTier

    host = EmbeddedHostKVTier(64 << 20)
    img = rng.random((1, 16, 16, 3)).astype(np.float32)
    a, b = (_engine(tiny_params, tiny_cfg, encoder_cache_to_host=True, host=host) for _ in range(2))
    first = a.submit(_chat(tiny_cfg, "what is this?", 1), 3, images=img)
    a.run(max_steps=200)
    prompt = _chat(tiny_cfg, "another question about the same picture", 1)
    second = b.submit(prompt, 3, images=img)
    b.run(max_steps=200)
    assert a.encoder_cache.host_hits == 0 and b.encoder_cache.host_hits == 1 and first.output
    assert second.output == _oracle(tiny_params, tiny_cfg, prompt, 3, img)
    other = b.submit(prompt, 3, images=img, cache_salt="tenant-b")
    b.run(max_steps=200)
    assert b.encoder_cache.host_hits == 1 and other.output == second.output
