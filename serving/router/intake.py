"""A /v1 request from its bytes to a validated, tokenized `Parsed`, or an `APIError` in OpenAI's shape.

`read_body` runs on the event loop as the body arrives and refuses early what could never fit
(too many bytes, too slow, too many JSON values); `Intake.validate` and `Intake.build` are
blocking (parsing, tokenizing, fetching and decoding images) and run on threads
(`serving.router.app`).  A prompt whose text is longer than the context could hold even at the
tokenizer's longest token is refused before it is tokenized.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
from collections.abc import Callable

from pydantic import ValidationError

from serving import router_auth, router_body
from serving.openai_api import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_prompt,
    check_common,
    completion_prompt,
    resolve_max_tokens,
    validation_error,
)

log = logging.getLogger(__name__)


async def read_body(request, limit: int, timeout_s: float | None = None, max_values: int | None = None) -> bytearray:
    """The request's body (one buffer, never copied), or a 413 past `limit` bytes: refused on its
    Content-Length before reading, and while reading (a chunked body states none); a 408 when the
    whole body has not arrived within `timeout_s` (a client that sends half a body and waits holds
    a connection and a buffer forever otherwise); a 400 as soon as the JSON text holds more than
    `max_values` separators (`router_body.ValueCounter`), before it is read whole or parsed."""
    too_large = lambda: APIError(413, f"request body larger than {limit} bytes", code="request_too_large")
    counter = router_body.ValueCounter() if max_values is not None else None
    length = request.headers.get("content-length", "").strip()
    if length.isdigit() and (len(length) > 18 or int(length) > limit):  # 18 digits: int() never balks
        raise too_large()
    body, n = bytearray(), 0  # one buffer: no list of chunks joined into a second copy

    async def read():
        nonlocal n
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise too_large()
            if counter is not None and counter.feed(chunk) > max_values:
                raise APIError(
                    400,
                    f"the body holds more than {max_values} JSON values; no request that fits this model's "
                    "context needs that many",
                    code="too_many_values",
                )
            body.extend(chunk)

    try:
        await asyncio.wait_for(read(), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(
            408, f"the request body did not arrive within {timeout_s:g} s ({n} bytes read)", code="request_timeout"
        ) from None
    return body


@dataclasses.dataclass
class Parsed:
    """A validated /v1 request: the pydantic request, its prompt ids, the completion budget, its
    images (base64 RGB bytes, or None) and its cache salt (`router_auth.cache_salt`)."""

    req: object
    prompt: list[int]
    max_tokens: int
    images_b64: list[str] | None
    salt: str | None


def max_token_bytes(tok) -> int | None:
    """The most bytes a regular token of `tok` stands for: text of n characters is then at least
    n / max_token_bytes tokens.  None where that bound does not hold (a tokenizer that normalizes
    text before encoding may drop characters)."""
    inner = getattr(tok, "_tok", None)  # a Hugging Face tokenizer's core
    if inner is not None and getattr(inner, "normalizer", None) is not None:
        return None
    try:
        return max(len(tok.token_bytes(i)) for i in range(tok.vocab_size) if not tok.is_special(i))
    except Exception as e:  # noqa: BLE001 - no bound: every prompt is tokenized before its length is known
        log.warning("no longest-token bound for %s (%r): long prompts are tokenized to be refused", tok.name, e)
        return None


class Intake:
    """Validation and tokenization of /v1 bodies for one served model: `model_cfg` and `tok` (its
    config and tokenizer), `names` (the model ids clients may send, `model_name` first), `media`
    (the image fetcher, `cache.media`), `max_context` (called per request: the smallest context
    the workers report, which changes as they come up)."""

    def __init__(self, cfg, model_cfg, tok, media, names: tuple[str, ...], max_context: Callable[[], int]):
        self.cfg, self.model_cfg, self.tok, self.media = cfg, model_cfg, tok, media
        self.model_name, self.aliases = names[0], set(names)
        self.context = max_context
        self.max_token_bytes = max_token_bytes(tok)

    @property
    def max_values(self) -> int:
        """The most JSON values (separators) a /v1 body may hold: a prompt of ids costs a token per
        value and a message at least one, so 4 per context token (plus room for the fields and
        their small lists) is past anything that fits the context."""
        return 4 * self.context() + 4096

    def parse(self, kind: str, raw, tenant: str = router_auth.ANONYMOUS) -> Parsed:
        """A /v1 body of `tenant` (`router_auth`) validated and tokenized, or APIError: `validate`
        then `build`.  Blocking (CPU); the app runs the two on threads."""
        return self.build(kind, self.validate(kind, raw), tenant)

    def validate(self, kind: str, raw):
        """The body's validated request (JSON, the request's model, checks that need no tokenizer,
        a prompt too long for the context whatever it tokenizes to), or APIError."""
        obj = router_body.loads(raw)
        if not isinstance(obj, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        try:
            req = (ChatCompletionRequest if kind == "chat" else CompletionRequest).model_validate(obj)
        except ValidationError as e:
            raise validation_error(e) from None
        del obj
        if req.model not in self.aliases:
            raise APIError(
                404,
                f"The model '{req.model}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )
        check_common(req, self.model_cfg.vocab_size)
        self._check_prompt_fits(req)
        return req

    def build(self, kind: str, req, tenant: str = router_auth.ANONYMOUS) -> Parsed:
        """A validated request's prompt ids and images (fetched and decoded through the media cache
        as its tenant's salt) and completion budget, or APIError."""
        salt = router_auth.cache_salt(tenant, req.cache_salt)
        try:
            if kind == "chat":
                vit = self.model_cfg.vit
                prompt, images = chat_prompt(
                    req,
                    max_images=self.cfg.max_images,
                    tokens_per_image=vit.tokens_per_image if vit else 0,
                    image_size=vit.image_size if vit else 0,
                    fetcher=self.media,
                    tenant=salt,  # the media cache's L1 / L2 namespace
                    tok=self.tok,
                )
                requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            else:
                prompt, images = completion_prompt(req, vocab_size=self.model_cfg.vocab_size, tok=self.tok), []
                requested = req.max_tokens
        except UnicodeEncodeError as e:  # a lone surrogate (valid JSON, not valid UTF-8)
            raise APIError(
                400, f"text that is not valid Unicode: {e.reason} at {e.start}", code="invalid_text"
            ) from None
        max_tokens = resolve_max_tokens(requested, len(prompt), self.context(), self.cfg.default_max_tokens)
        images_b64 = [base64.b64encode(im.tobytes()).decode() for im in images] or None
        return Parsed(req, prompt, max_tokens, images_b64, salt)

    def _check_prompt_fits(self, req) -> None:
        """A 400 (as `resolve_max_tokens` gives) for a prompt that cannot fit the context whatever it
        tokenizes to: more token ids than the context, or more characters than the context's
        tokens could cover at the tokenizer's longest token (`max_token_bytes`; a UTF-8
        character is at least a byte).  Costs nothing like tokenizing a 30 MB text would."""
        if isinstance(req, ChatCompletionRequest):
            param = "messages"
            chars = sum(
                len(m.content) if isinstance(m.content, str) else sum(len(getattr(p, "text", "")) for p in m.content)
                for m in req.messages
                if m.content is not None
            )
            least = -(-chars // self.max_token_bytes) if self.max_token_bytes else 0
        else:
            param, p = "prompt", req.prompt
            if isinstance(p, str) or (len(p) == 1 and isinstance(p[0], str)):
                chars = len(p if isinstance(p, str) else p[0])
                least = -(-chars // self.max_token_bytes) if self.max_token_bytes else 0
            else:
                least = len(p) if p and isinstance(p[0], int) else 0
        context = self.context()
        if least >= context:
            raise APIError(
                400,
                f"This model's maximum context length is {context} tokens; the prompt has at least "
                f"{least} tokens, leaving no room for a completion",
                param=param,
                code="context_length_exceeded",
            )
