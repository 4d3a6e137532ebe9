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


@pytest.mark.parametrize(
    "url, words",
    [
        ("https://example.com/cat.png", "data: URLs"),
        ("data:image/png,rawbytes", "base64"),
        ("data:image/png;base64,!!!", "broken image"),
        ("data:image/png;base64," + base64.b64encode(b"GIF89a").decode(), "broken image"),
    ],
)
def test_unusable_images_are_400s(url, words):
    with pytest.raises(APIError, match=words) as e:
        decode_image(url, 16)
    assert e.value.status == 400 and e.value.body()["error"]["param"] == "messages"


def test_chat_prompt_returns_the_images_in_placeholder_order(rng):
    a, b = (rng.integers(0, 256, (16, 16, 3), dtype=np.uint8) for _ in range(2))
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": _png(a)}},
                        {"type": "text", "text": "and"},
                        {"type": "image_url", "image_url": {"url": _png(b)}},
                    ],
                }
            ],
        }
    )
    prompt, images = chat_prompt(req, max_images=4, tokens_per_image=4, image_size=16)
    assert len(images) == 2 and (images[0] == a).all() and (images[1] == b).all()
    with pytest.raises(APIError, match="no vision encoder"):
        chat_prompt(req, max_images=4, tokens_per_image=0)


def test_a_tenant_salt_comes_from_cache_salt_and_user():
    from pydantic import ValidationError

    from serving.openai_api import tenant_salt

    body = lambda **kw: ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **kw)
    assert tenant_salt(body()) is None  # no tenant named: the shared cache
    salts = {
        tenant_salt(body(**kw))
        for kw in ({"user": "a"}, {"user": "b"}, {"cache_salt": "a"}, {"cache_salt": "a", "user": "a"})
    }
    assert len(salts) == 4 and None not in salts  # a user is not a salt of the same text
    assert tenant_salt(body(user="a")) == tenant_salt(body(user="a"))
    for bad in ({"cache_salt": ""}, {"cache_salt": "x" * 257}, {"cache_salt": 3}):
        with pytest.raises(ValidationError):
            body(**bad)


def test_an_http_image_url_is_fetched_through_l1_and_gives_the_data_urls_pixels(rng):
    """With a fetcher an http(s) image_url gives exactly the pixels of the same image as a
    data: URL, a second request is served from L1, and a refused fetch is a 400 naming why."""
    from cache.media import FetchPolicy, MediaFetcher
    from cache.media.l1 import EmbeddedFetchCache
    from cache.media.l2 import PixelCache
    from tests.cache.test_media_fetch import ImageServer

    pixels = rng.integers(0, 256, (20, 24, 3), dtype=np.uint8)
    data_url = _png(pixels)
    server = ImageServer()
    try:
        server.routes["/p.png"] = (200, {"Content-Type": "image/png"}, base64.b64decode(data_url.split(",", 1)[1]))
        fetcher = MediaFetcher(FetchPolicy(allow_networks=("127.0.0.1/32",)), EmbeddedFetchCache(), pixels=PixelCache())
        req = lambda url: ChatCompletionRequest.model_validate(
            {
                "model": "m",
                "messages": [  # noqa: E731
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": url}},
                            {"type": "text", "text": "what is it"},
                        ],
                    }
                ],
            }
        )
        want = chat_prompt(req(data_url), max_images=2, tokens_per_image=4, image_size=16)
        for _ in range(2):
            got = chat_prompt(
                req(server.url("/p.png")), max_images=2, tokens_per_image=4, image_size=16, fetcher=fetcher, tenant="t"
            )
            assert got[0] == want[0] and (got[1][0] == want[1][0]).all()
        stats = fetcher.stats()
        assert server.requests == 1 and stats["l1_hits"] == 1 and stats["l2_hits"] == 1 and stats["l2_misses"] == 1
        # L2 by content: one pixel changed is another image (a miss and its own pixels), never a false hit
        other = pixels.copy()
        other[3, 5, 1] ^= 1
        got = chat_prompt(
            req(_png(other)), max_images=2, tokens_per_image=4, image_size=24, fetcher=fetcher, tenant="t"
        )[1][0]
        assert fetcher.stats()["l2_misses"] == 2
        np.testing.assert_array_equal(got, decode_image(_png(other), 24))
        with pytest.raises(APIError, match="non-public address") as e:  # the default policy: loopback refused
            chat_prompt(
                req(server.url("/p.png")), max_images=2, tokens_per_image=4, image_size=16, fetcher=MediaFetcher()
            )
        assert e.value.status == 400 and e.value.body()["error"]["code"] == "image_fetch_refused"
        assert server.requests == 1
        server.routes["/t.txt"] = (200, {"Content-Type": "text/plain"}, b"not an image")
        with pytest.raises(APIError, match="content type"):
            chat_prompt(req(server.url("/t.txt")), max_images=2, tokens_per_image=4, image_size=16, fetcher=fetcher)
        with pytest.raises(APIError, match="remote fetching is off"):
            chat_prompt(req(server.url("/p.png")), max_images=2, tokens_per_image=4, image_size=16)
    finally:
        server.close()


def _chat(**kw):
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


@pytest.mark.parametrize(
    "field, value",
    [
        ("repetition_penalty", 1.2),
        ("logit_bias", {"50": 10}),
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "auto"),
        ("response_format", {"type": "json_object"}),
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("reasoning_effort", "low"),
        ("prediction", {"type": "content", "content": "a draft"}),
    ],
)
def test_a_field_this_server_does_not_implement_is_a_400_naming_it(field, value):
    from serving.openai_api import check_common

    req = ChatCompletionRequest.model_validate(_chat(**{field: value}))
    with pytest.raises(APIError, match=f"'{field}' is not supported") as e:
        check_common(req)
    assert e.value.status == 400 and e.value.param == field and e.value.code == "unsupported_parameter"


def test_neutral_values_of_those_fields_are_what_clients_send_by_default_and_pass():
    from serving.openai_api import check_common

    check_common(
        ChatCompletionRequest.model_validate(
            _chat(
                logprobs=False,
                top_logprobs=0,
                frequency_penalty=0,
                presence_penalty=0.0,
                repetition_penalty=1,
                logit_bias={},
                top_k=-1,
                min_p=0,
                tools=[],
                tool_choice="none",
                parallel_tool_calls=True,
                response_format={"type": "text"},
            )
        )
    )
    from serving.openai_api import CompletionRequest

    check_common(
        CompletionRequest.model_validate(
            {"model": "m", "prompt": "x", "echo": False, "suffix": "", "best_of": 1, "logprobs": None}
        )
    )
    with pytest.raises(APIError, match="'echo'"):
        check_common(CompletionRequest.model_validate({"model": "m", "prompt": "x", "echo": True}))


def test_logprobs_and_penalties_reach_the_workers_as_asked_and_out_of_range_values_are_400s():
    from pydantic import ValidationError

    from serving.openai_api import CompletionRequest, check_common, logprobs_count, sampling_options

    chat = lambda **kw: ChatCompletionRequest.model_validate(_chat(**kw))
    assert "logprobs" not in sampling_options(chat(logprobs=False, frequency_penalty=0))  # neutral: the plain step
    assert "presence_penalty" not in sampling_options(chat(presence_penalty=0.0))
    opts = sampling_options(chat(logprobs=True, top_logprobs=5, presence_penalty=-1, frequency_penalty=0.5))
    assert (opts["logprobs"], opts["presence_penalty"], opts["frequency_penalty"]) == (5, -1, 0.5)
    assert logprobs_count(chat(logprobs=True)) == 0  # the chosen token's only
    completion = lambda **kw: CompletionRequest.model_validate({"model": "m", "prompt": "x", **kw})
    assert logprobs_count(completion(logprobs=0)) == 0 and logprobs_count(completion()) is None
    with pytest.raises(APIError, match="top_logprobs needs logprobs"):
        check_common(chat(top_logprobs=2))
    for bad in (
        dict(top_logprobs=21, logprobs=True),
        dict(logprobs=1),
        dict(presence_penalty=2.5),
        dict(frequency_penalty="1"),
    ):
        with pytest.raises(ValidationError):
            chat(**bad)
    with pytest.raises(ValidationError):
        completion(logprobs=True)


def test_logprobs_objects_have_openais_shapes():
    """Chat: content entries {token, logprob, bytes, top_logprobs}; a byte that is only a piece of a
    character is "bytes:\\x.." with its bytes.  Completions: parallel lists and text offsets."""
    from kimik3 import tokenizer
    from serving.openai_api import chat_logprobs, completion_logprobs
    from serving.sampling import TokenLogprobs

    tokens = [ord("h"), 0xE2, tokenizer.EOS_ID]
    entries = [TokenLogprobs(-0.5, ((ord("h"), -0.5), (ord("i"), -1.5))), None, TokenLogprobs(-2.0, ())]
    from kimik3.text import ByteTokenizer

    tok = ByteTokenizer()
    chat = chat_logprobs(tok, tokens, entries)
    assert chat["content"] == [
        {
            "token": "h",
            "logprob": -0.5,
            "bytes": [104],
            "top_logprobs": [
                {"token": "h", "logprob": -0.5, "bytes": [104]},
                {"token": "i", "logprob": -1.5, "bytes": [105]},
            ],
        },
        {"token": "<|eos|>", "logprob": -2.0, "bytes": list(b"<|eos|>"), "top_logprobs": []},
    ]
    one = chat_logprobs(tok, [0xE2], [TokenLogprobs(-1.0)])["content"][0]
    assert one["token"] == "bytes:\\xe2" and one["bytes"] == [0xE2]
    legacy = completion_logprobs(tok, tokens[:1], entries[:1], [7])
    assert legacy == {
        "tokens": ["h"],
        "token_logprobs": [-0.5],
        "top_logprobs": [{"h": -0.5, "i": -1.5}],
        "text_offset": [7],
    }


@pytest.mark.parametrize(
    "body, where",
    [
        (_chat(frobnicate=1), "frobnicate"),
        (_chat(echo=True), "echo"),  # echo is a completions field
        ({"model": "m", "messages": [{"role": "user", "content": "hi", "tool_result": "x"}]}, "messages.0.tool_result"),
    ],
)
def test_an_unknown_field_is_a_400_naming_it(body, where):
    from pydantic import ValidationError

    from serving.openai_api import validation_error

    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate(body)
    err = validation_error(e.value)
    assert (
        err.status == 400 and err.param == where and f"Unrecognized request argument supplied: {where}" in err.message
    )


def test_stop_sequences_and_stop_token_ids_are_checked():
    from serving.openai_api import check_common, stop_strings

    ok = ChatCompletionRequest.model_validate(_chat(stop="\n\n", stop_token_ids=[1, 2]))
    check_common(ok, vocab_size=300)
    assert stop_strings(ok) == ["\n\n"]
    for kw, words in (
        ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
        ({"stop": [""]}, "1 to 256"),
        ({"stop": "x" * 257}, "1 to 256"),
        ({"stop_token_ids": [300]}, "not a token id"),
        ({"stop_token_ids": [-1]}, "not a token id"),
    ):
        with pytest.raises(APIError, match=words):
            check_common(ChatCompletionRequest.model_validate(_chat(**kw)), vocab_size=300)


def test_the_default_temperature_is_openais():
    from serving.openai_api import sampling_options

    assert sampling_options(ChatCompletionRequest.model_validate(_chat()))["temperature"] == 1.0
    assert sampling_options(ChatCompletionRequest.model_validate(_chat(temperature=0)))["temperature"] == 0.0
    assert sampling_options(ChatCompletionRequest.model_validate(_chat(top_p=0.5)))["top_p"] == 0.5
    opts = sampling_options(ChatCompletionRequest.model_validate(_chat(top_k=40, min_p=0.05)))
    assert (opts["top_k"], opts["min_p"]) == (40, 0.05)  # vLLM's filters reach the workers


def test_what_the_openai_sdk_sends_in_a_multi_turn_conversation_passes():
    """An assistant message replayed with `message.model_dump()` (null tool_calls, refusal, audio,
    annotations), a tool message with its tool_call_id, store: false and empty metadata are what
    ordinary clients send; tool calls themselves are not (a 400 naming them)."""
    from serving.openai_api import check_common

    history = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "hello",
            "tool_calls": None,
            "refusal": None,
            "function_call": None,
            "audio": None,
            "annotations": [],
        },
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "user", "content": "and?"},
    ]
    check_common(
        ChatCompletionRequest.model_validate(
            _chat(messages=history, store=False, metadata={}, service_tier="auto", modalities=["text"])
        )
    )
    history[1]["tool_calls"] = [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    with pytest.raises(APIError, match="'messages.1.tool_calls' is not supported") as e:
        check_common(ChatCompletionRequest.model_validate(_chat(messages=history)))
    assert e.value.param == "messages.1.tool_calls"
    with pytest.raises(APIError, match="'store'"):
        check_common(ChatCompletionRequest.model_validate(_chat(store=True)))
    with pytest.raises(APIError, match="continuous_usage_stats"):
        check_common(ChatCompletionRequest.model_validate(_chat(stream_options={"continuous_usage_stats": True})))


def test_every_field_the_schema_declares_without_a_type_is_refused_unless_neutral():
    """A field typed `Any` is one the server declares only to answer it: each request model's such
    fields are exactly the ones its unsupported table checks, so a field added to the schema
    without an implementation cannot be accepted and ignored."""
    from typing import Any

    from serving.openai_api import MESSAGE_UNSUPPORTED, UNSUPPORTED, ChatMessage, CompletionRequest

    for model, table in (
        (ChatCompletionRequest, UNSUPPORTED),
        (CompletionRequest, UNSUPPORTED),
        (ChatMessage, MESSAGE_UNSUPPORTED),
    ):
        untyped = {name for name, f in model.model_fields.items() if f.annotation is Any}
        assert untyped and untyped <= set(table), (model.__name__, sorted(untyped - set(table)))
    chat_only = set(UNSUPPORTED) - set(ChatCompletionRequest.model_fields)
    assert chat_only <= set(CompletionRequest.model_fields), sorted(chat_only)
