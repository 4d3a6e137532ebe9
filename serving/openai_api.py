"""The OpenAI-compatible request schemas (pydantic), error shape and prompt building.

Sampling: `temperature` (default 1, as OpenAI's and vLLM's; 0 is greedy and reproduces the
oracle), `top_p`, and `seed` (drawn by the router when absent; one seed serves every retry and
failover of a request, and draws are seeded per position, so a request that moves between
workers continues the same sample); vLLM's `top_k` and `min_p`; `presence_penalty` and
`frequency_penalty` (vLLM's definition, over the output: `serving.sampling`); `logprobs` (chat:
`logprobs: true` with `top_logprobs` <= 20; completions: `logprobs` <= 20 alternatives), the
model's own distribution before penalties and temperature (vLLM's default), in OpenAI's shapes
(`chat_logprobs`, `completion_logprobs`).  `stop` (up to 4 strings; the text ends before the first,
also while streaming: `serving.stop`) and vLLM's `stop_token_ids`.  Images: `image_url` parts
with base64 `data:` URLs (PNG, JPEG, ...), decoded and resized to the ViT's input here; remote
URLs and undecodable images are 400s.  `n` must be 1.

No field is ignored: an unknown field is a 400 naming it (as OpenAI answers), and a field of
OpenAI's or vLLM's that this server does not implement (`UNSUPPORTED`: tools, logit_bias,
repetition_penalty, ...) is a 400 naming it unless it holds its neutral value (what clients send by
default: `logprobs: false`, `frequency_penalty: 0`, `tools: []`, ...).  Extensions: `ignore_eos`
(do not stop at <|eos|>) and `cache_salt` in requests, `token_ids` on each choice (and on each
streamed chunk's choice) in responses.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import random
from typing import Annotated, Any, Literal, Union

import numpy as np
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from cache.media import FetchError
from kimik3 import tokenizer
from kimik3.text import ByteTokenizer
from serving.sampling import SAMPLING_BOUNDS
from serving.stop import MAX_STOP_CHARS, MAX_STOP_SEQUENCES


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def error_path(error: dict, skip: tuple[str, ...] = ()) -> str:
    """Where a pydantic error is, as a dotted path ("messages.0.content"; "body" for the whole body),
    the location parts in `skip` left out (FastAPI's "body" and "query" prefixes)."""
    return ".".join(str(p) for p in error["loc"] if p not in skip) or "body"


def describe_errors(errors: list[dict], skip: tuple[str, ...] = ()) -> str:
    """The first five of pydantic's `errors` as "path: message; ..." (`error_path`): the text of
    the router's 400s and the worker's."""
    return "; ".join(f"{error_path(e, skip)}: {e['msg']}" for e in errors[:5])


def validation_error(err: ValidationError) -> APIError:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"]) or None
    if first["type"] == "extra_forbidden":
        return APIError(400, f"Unrecognized request argument supplied: {loc}", param=loc, code="unknown_parameter")
    return APIError(400, f"invalid request: {describe_errors(err.errors())}", param=loc, code="invalid_value")


# Every numeric field is bounded where it enters: a value out of range (2^31, 2^63, -1, NaN, Infinity) is a
# 400 naming the field, never an overflow further in (an integer literal past Python's conversion limit is
# refused, by name, as the body is parsed: `serving.router_body.loads`).
INT32_LIMIT = 2**31  # token counts and ids: the device reads them as int32
# an id's upper bound (the vocabulary's, and the sign, are `check_common`'s and `completion_prompt`'s)
TokenId = Annotated[StrictInt, Field(lt=INT32_LIMIT)]
TokenCount = Annotated[StrictInt, Field(ge=1, lt=INT32_LIMIT)]


def _real(name: str) -> Any:
    """The sampling parameter `name` as a finite float field in its range (`SAMPLING_BOUNDS`);
    strict: "0.5" is a 400, as "5" is."""
    return Field(None, strict=True, allow_inf_nan=False, **SAMPLING_BOUNDS[name])


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ImageURL(_Strict):
    url: StrictStr
    detail: StrictStr | None = None


class ImagePart(_Strict):
    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[Union[TextPart, ImagePart], Field(discriminator="type")]


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None  # a tool message's: its content is rendered as text
    # what an SDK's assistant message carries when replayed (`message.model_dump()`): accepted
    # empty (`MESSAGE_UNSUPPORTED`), since this server neither calls tools nor returns audio
    tool_calls: Any = None
    function_call: Any = None
    refusal: Any = None
    audio: Any = None
    annotations: Any = None

    def text_and_images(self) -> tuple[str, int]:
        if self.content is None or isinstance(self.content, str):
            return self.content or "", 0
        text = "".join(p.text for p in self.content if isinstance(p, TextPart))
        return text, sum(isinstance(p, ImagePart) for p in self.content)


class StreamOptions(_Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # vLLM's; only its default is served


class _Common(_Strict):
    model: StrictStr
    max_tokens: TokenCount | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = _real("temperature")
    top_p: float | None = _real("top_p")
    top_k: StrictInt | None = Field(None, **SAMPLING_BOUNDS["top_k"])  # vLLM's: 0 or -1 off
    min_p: float | None = _real("min_p")  # vLLM's: 0 off
    seed: StrictInt | None = Field(None, **SAMPLING_BOUNDS["seed"])
    n: StrictInt = 1  # one choice per request (`check_common`)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=64)  # vLLM's
    ignore_eos: StrictBool = False
    user: StrictStr | None = Field(None, max_length=256)
    # vLLM's field: requests share prefix-cache blocks only with requests of the same salt
    cache_salt: StrictStr | None = Field(None, min_length=1, max_length=256)
    presence_penalty: float | None = _real("presence_penalty")
    frequency_penalty: float | None = _real("frequency_penalty")
    # OpenAI's / vLLM's fields this server does not implement: accepted at their neutral values only
    # (`check_common`), so that no request is answered as if a field it set had been honoured
    repetition_penalty: Any = None
    logit_bias: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: TokenCount | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, **SAMPLING_BOUNDS["logprobs"])


class CompletionRequest(_Common):
    prompt: StrictStr | list[TokenId] | list[StrictStr]
    logprobs: StrictInt | None = Field(None, **SAMPLING_BOUNDS["logprobs"])  # the alternatives per token
    echo: Any = None
    suffix: Any = None
    best_of: Any = None


def _is_number(v, value: float) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == value


# field -> whether a value is its neutral one (what a client sends when it does not use the field)
UNSUPPORTED = {
    "repetition_penalty": lambda v: _is_number(v, 1),
    "logit_bias": lambda v: v == {},
    "tools": lambda v: v == [],
    "tool_choice": lambda v: v == "none",
    "parallel_tool_calls": lambda v: isinstance(v, bool),  # meaningless without tools
    "functions": lambda v: v == [],
    "function_call": lambda v: v == "none",
    "response_format": lambda v: v == {"type": "text"},
    "store": lambda v: v is False,  # nothing is stored here
    "metadata": lambda v: v == {},
    "service_tier": lambda v: v in ("auto", "default"),
    "modalities": lambda v: v == ["text"],
    "echo": lambda v: v is False,
    "suffix": lambda v: v == "",
    "best_of": lambda v: _is_number(v, 1),
    # no value of these is neutral: the model has no reasoning budget to set, and predicted
    # outputs (a client's draft) are not verified here (the server's own drafts are: EAGLE-3)
    "reasoning_effort": lambda v: False,
    "prediction": lambda v: False,
}


def sampling_options(req: _Common) -> dict:
    """The workers' sampling parameters of a request (a fresh seed if the client gave none)."""
    seed = req.seed if req.seed is not None else random.getrandbits(63)
    opts = {
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "seed": seed,
        "top_k": req.top_k or 0,
        "min_p": req.min_p or 0.0,
    }
    if req.presence_penalty or req.frequency_penalty:
        opts.update(presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0)
    k = logprobs_count(req)
    if k is not None:
        opts["logprobs"] = k
    return opts


def logprobs_count(req: _Common) -> int | None:
    """How many alternatives per token the response reports (None: no logprobs): a chat request's
    top_logprobs when logprobs is true, a completion request's logprobs."""
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def token_entry(tok, token: int, logprob: float) -> dict:
    """{"token", "logprob", "bytes"} as OpenAI's chat logprobs give a token of `tok` (a
    `kimik3.text.Tokenizer`): its text, or "bytes:\\x.." where its bytes are not UTF-8 on their
    own (a piece of a character)."""
    raw = tok.token_bytes(token)
    return {"token": _token_text(raw), "logprob": logprob, "bytes": list(raw)}


def _token_text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def chat_logprobs(tok, tokens: list[int], entries: list) -> dict:
    """OpenAI's chat `logprobs` object for `tokens` and their `TokenLogprobs` (None: not known)."""
    content = []
    for t, e in zip(tokens, entries):
        if e is None:
            continue
        content.append({**token_entry(tok, t, e.logprob), "top_logprobs": [token_entry(tok, i, lp) for i, lp in e.top]})
    return {"content": content, "refusal": None}


def completion_logprobs(tok, tokens: list[int], entries: list, offsets: list[int]) -> dict:
    """The legacy completions `logprobs` object: tokens, token_logprobs, top_logprobs ({text: logprob}
    per token) and text_offset (each token's start in the completion's text)."""
    kept = [(t, e, o) for t, e, o in zip(tokens, entries, offsets) if e is not None]
    text = lambda t: _token_text(tok.token_bytes(t))
    return {
        "tokens": [text(t) for t, _, _ in kept],
        "token_logprobs": [e.logprob for _, e, _ in kept],
        "top_logprobs": [{text(i): lp for i, lp in e.top} for _, e, _ in kept],
        "text_offset": [o for _, _, o in kept],
    }


def stop_strings(req: _Common) -> list[str]:
    """The request's stop sequences as a list (checked by `check_common`)."""
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def tenant_salt(req: _Common) -> str | None:
    """The prefix-cache salt of a request's tenant: its `cache_salt` and its `user`, hashed
    together (None when it names neither: the shared cache).  A prompt cached by one tenant is
    then never a hit for another, so `cached_tokens` (and the time to first token) cannot be
    used to guess another tenant's prompt."""
    if req.cache_salt is None and req.user is None:
        return None
    tenant = json.dumps([req.cache_salt, req.user])
    return hashlib.sha256(tenant.encode()).hexdigest()[:32]


# the same for fields of a chat message (None is neutral for all)
MESSAGE_UNSUPPORTED = {
    "tool_calls": lambda v: v == [],
    "function_call": lambda v: False,
    "refusal": lambda v: False,
    "audio": lambda v: False,
    "annotations": lambda v: v == [],
}


def _refuse_unsupported(obj, table: dict, where: str = "") -> None:
    for name, neutral in table.items():
        value = getattr(obj, name, None)
        if value is not None and not neutral(value):
            raise APIError(
                400,
                f"'{where}{name}' is not supported by this server (got {json.dumps(value)[:80]}); leave it out",
                param=where + name,
                code="unsupported_parameter",
            )


def check_common(req: _Common, vocab_size: int | None = None) -> None:
    """APIError (400) naming the first field this server cannot honour as given."""
    if req.n != 1:
        raise APIError(400, f"n must be 1 (got {req.n}): one choice per request", param="n")
    if isinstance(req, ChatCompletionRequest) and req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
    _refuse_unsupported(req, UNSUPPORTED)
    for i, m in enumerate(getattr(req, "messages", None) or ()):
        _refuse_unsupported(m, MESSAGE_UNSUPPORTED, f"messages.{i}.")
    if req.stream_options is not None:
        _refuse_unsupported(req.stream_options, {"continuous_usage_stats": lambda v: v is False}, "stream_options.")
    stops = stop_strings(req)
    if len(stops) > MAX_STOP_SEQUENCES:
        raise APIError(400, f"at most {MAX_STOP_SEQUENCES} stop sequences (got {len(stops)})", param="stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise APIError(400, f"stop sequences must be 1 to {MAX_STOP_CHARS} characters long", param="stop")
    bad = [t for t in req.stop_token_ids or [] if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise APIError(
            400, f"stop_token_ids: {bad[0]} is not a token id (ids lie in [0, {vocab_size}))", param="stop_token_ids"
        )


MAX_IMAGE_BYTES = 16 << 20
MAX_IMAGE_PIXELS = 4096 * 4096  # checked from the header, before anything is decoded


def decode_image(url: str, size: int, fetcher=None, tenant: str | None = None) -> np.ndarray:
    """An image URL -> RGB uint8 [size, size, 3], resized to the ViT's input: a base64 `data:`
    URL (PNG, JPEG, ...), or with a `fetcher` (`cache.media.MediaFetcher`) an http(s) URL,
    fetched under its policy through its L1 cache as `tenant`.  A refused fetch or an
    undecodable image is a 400, never a worker error."""
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0].lower()
        if fetcher is None or scheme not in ("http", "https"):
            accepted = "base64 data: URLs" if fetcher is None else "base64 data: URLs or http(s) URLs"
            off = "; remote fetching is off on this server" if fetcher is None and scheme in ("http", "https") else ""
            raise APIError(400, f"image URLs must be {accepted}{off}", param="messages", code="unsupported_image_url")

        try:
            raw = fetcher.get(url, tenant)
        except FetchError as e:
            raise APIError(400, f"image URL refused: {e}", param="messages", code="image_fetch_refused") from None
        return fetcher.decoded(raw, size, tenant, decode_image_bytes)
    header, _, payload = url.partition(",")
    if ";base64" not in header:
        raise APIError(400, "image data URLs must be base64-encoded", param="messages", code="invalid_image")
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise APIError(400, f"image larger than {MAX_IMAGE_BYTES >> 20} MiB", param="messages", code="invalid_image")
    try:
        raw = base64.b64decode(payload, validate=True)
    except binascii.Error as e:
        raise APIError(400, f"broken image: {type(e).__name__}: {e}", param="messages", code="invalid_image") from None
    return decode_image_bytes(raw, size) if fetcher is None else fetcher.decoded(raw, size, tenant, decode_image_bytes)


def decode_image_bytes(raw: bytes, size: int) -> np.ndarray:
    """Encoded image bytes -> RGB uint8 [size, size, 3]; the pixel count is checked from the
    header before anything is decoded; a broken image is a 400."""
    if len(raw) > MAX_IMAGE_BYTES:
        raise APIError(400, f"image larger than {MAX_IMAGE_BYTES >> 20} MiB", param="messages", code="invalid_image")
    try:
        with Image.open(io.BytesIO(raw)) as im:  # reads the header only
            if im.size[0] * im.size[1] > MAX_IMAGE_PIXELS:
                raise APIError(
                    400,
                    f"image of {im.size[0]} x {im.size[1]} pixels; at most {MAX_IMAGE_PIXELS} pixels are accepted",
                    param="messages",
                    code="image_too_large",
                )
            return np.asarray(im.convert("RGB").resize((size, size), Image.BILINEAR), np.uint8)
    except (binascii.Error, OSError, ValueError, Image.DecompressionBombError) as e:
        raise APIError(400, f"broken image: {type(e).__name__}: {e}", param="messages", code="invalid_image") from None


def chat_prompt(
    req: ChatCompletionRequest,
    *,
    max_images: int,
    tokens_per_image: int,
    image_size: int = 0,
    fetcher=None,
    tenant: str | None = None,
    tok=None,
) -> tuple[list[int], list[np.ndarray]]:
    """Token ids of the conversation through `tok`'s chat template (a `kimik3.text.Tokenizer`;
    None: the byte tokenizer) with the assistant prompt appended, and its images (uint8
    [image_size, image_size, 3] each, in placeholder order); http(s) image URLs are fetched
    through `fetcher` as `tenant` (see `decode_image`)."""
    messages, n_images, images = [], 0, []
    for m in req.messages:
        text, n = m.text_and_images()
        n_images += n
        messages.append(tokenizer.Message("system" if m.role == "developer" else m.role, text, n_images=n))
    if n_images > max_images:
        raise APIError(
            400,
            f"too many images: {n_images} in the request, at most {max_images} allowed",
            param="messages",
            code="too_many_images",
        )
    if n_images and not tokens_per_image:
        raise APIError(
            400,
            "this model has no vision encoder: image inputs are not accepted",
            param="messages",
            code="unsupported_content",
        )
    if n_images and tok is not None and tok.image_id != tokenizer.IMAGE_ID:
        raise APIError(
            400,
            f"this server's tokenizer ({tok.name}) has no image placeholder at the model's id "
            f"{tokenizer.IMAGE_ID}: image inputs are not accepted",
            param="messages",
            code="unsupported_content",
        )
    for m in req.messages:  # the template places a message's images before its text, in order
        if isinstance(m.content, list):
            images += [
                decode_image(p.image_url.url, image_size, fetcher, tenant)
                for p in m.content
                if isinstance(p, ImagePart)
            ]
    try:
        ids = (tok or _byte()).apply_chat_template(messages, tokens_per_image=tokens_per_image)
    except UnicodeEncodeError:  # text that is not valid Unicode: the caller names it
        raise
    except ValueError as e:  # a role the tokenizer's template cannot write
        raise APIError(400, str(e), param="messages") from None
    return ids, images


def _byte():
    return ByteTokenizer()


def completion_prompt(req: CompletionRequest, *, vocab_size: int, tok=None) -> list[int]:
    """The prompt's ids: a string through `tok` (None: the byte tokenizer) after its <|bos|>, or ids as given."""
    p = req.prompt
    if isinstance(p, list) and p and isinstance(p[0], str):
        if len(p) != 1:
            raise APIError(400, "one prompt per request (a list of strings must hold exactly one)", param="prompt")
        p = p[0]
    if isinstance(p, str):
        tok = tok or _byte()
        return ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(p)
    if not p:
        raise APIError(400, "prompt is empty", param="prompt")
    bad = [t for t in p if t < 0 or t >= vocab_size or t == tokenizer.IMAGE_ID]
    if bad:
        raise APIError(
            400, f"token id {bad[0]} is not a valid text token (ids lie in [0, {vocab_size}))", param="prompt"
        )
    return list(p)


def resolve_max_tokens(requested: int | None, prompt_len: int, max_context: int, default: int) -> int:
    """The completion budget, or a 400 for a prompt over the context or a budget out of range."""
    room = max_context - prompt_len
    if room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {max_context} tokens; the prompt has "
            f"{prompt_len} tokens, leaving no room for a completion",
            param="messages",
            code="context_length_exceeded",
        )
    if requested is None:
        return min(default, room)
    if requested < 1:
        raise APIError(
            400, f"max_tokens must be at least 1 (got {requested})", param="max_tokens", code="invalid_value"
        )
    if requested > room:
        raise APIError(
            400,
            f"This model's maximum context length is {max_context} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the "
            f"completion)",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested
