"""Request parsing of the OpenAI API: images as data URLs are decoded at the ViT's size; bad ones are 400s."""

import base64
import io

import numpy as np
import pytest
from PIL import Image

from serving.openai_api import APIError, ChatCompletionRequest, chat_prompt, decode_image


def _png(pixels) -> str:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_a_png_data_url_becomes_rgb_pixels_at_the_vit_size(rng):
    pixels = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    np.testing.assert_array_equal(decode_image(_png(pixels), 16), pixels)  # same size: untouched
    assert decode_image(_png(rng.integers(0, 256, (40, 30, 3), dtype=np.uint8)), 16).shape == (16, 16, 3)
    grey = rng.integers(0, 256, (20, 20), dtype=np.uint8)
    assert decode_image(_png(grey), 16).shape == (16, 16, 3)


@pytest.mark.parametrize("url, words", [
    ("https://example.com/cat.png", "data: URLs"), ("data:image/png,rawbytes", "base64"),
    ("data:image/png;base64,!!!", "broken image"), ("data:image/png;base64," + base64.b64encode(b"GIF89a").decode(),
                                                     "broken image")])
def test_unusable_images_are_400s(url, words):
    with pytest.raises(APIError, match=words) as e:
        decode_image(url, 16)
    assert e.value.status == 400 and e.value.body()["error"]["param"] == "messages"


def test_chat_prompt_returns_the_images_in_placeholder_order(rng):
    a, b = (rng.integers(0, 256, (16, 16, 3), dtype=np.uint8) for _ in range(2))
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png(a)}},
                                     {"type": "text", "text": "and"},
                                     {"type": "image_url", "image_url": {"url": _png(b)}}]}]})
    prompt, images = chat_prompt(req, max_images=4, tokens_per_image=4, image_size=16)
    assert len(images) == 2 and (images[0] == a).all() and (images[1] == b).all()
    with pytest.raises(APIError, match="no vision encoder"):
        chat_prompt(req, max_images=4, tokens_per_image=0)


def test_a_tenant_salt_comes_from_cache_salt_and_user():
    from pydantic import ValidationError

    from serving.openai_api import tenant_salt

    body = lambda **kw: ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kw)
    assert tenant_salt(body()) is None  # no tenant named: the shared cache
    salts = {tenant_salt(body(**kw)) for kw in ({"user": "a"}, {"user": "b"}, {"cache_salt": "a"},
                                                {"cache_salt": "a", "user": "a"})}
    assert len(salts) == 4 and None not in salts  # a user is not a salt of the same text
    assert tenant_salt(body(user="a")) == tenant_salt(body(user="a"))
    for bad in ({"cache_salt": ""}, {"cache_salt": "x" * 257}, {"cache_salt": 3}):
        with pytest.raises(ValidationError):
            body(**bad)
