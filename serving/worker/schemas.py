"""What the worker's HTTP API takes and the shape of its error answers.

`GenerateBody` is a /generate or /prefill body; the ``Query*`` types are /adopt's query
parameters, bounded as the body's fields are (the sampling ranges are
`serving.sampling.SAMPLING_BOUNDS`, the OpenAI requests' too).  An error answer is
``{"error": msg, ...}`` with, where they apply, ``"param"`` (the field at fault), ``"retriable"``
(whether another worker may serve the request: the router's `classify_worker_error` reads it)
and ``"code"``.

FastAPI resolves a handler's annotations in its module's globals, so the query types are
module-level names that `serving.worker.app` imports.
"""

from __future__ import annotations

import base64
import binascii
from typing import Annotated

import numpy as np
from fastapi import Query
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from serving.engine_config import MAX_CACHE_SALT_CHARS
from serving.openai_api import INT32_LIMIT, describe_errors, error_path
from serving.sampling import SAMPLING_BOUNDS, SamplingParams

_B = SAMPLING_BOUNDS

# /adopt's query parameters, bounded as a /generate body's fields
QueryTokens = Annotated[int, Query(ge=1, lt=INT32_LIMIT)]
QueryId = Annotated[str, Query(max_length=256)]
QueryTemperature = Annotated[float, Query(allow_inf_nan=False, **_B["temperature"])]
QueryMinP = Annotated[float, Query(allow_inf_nan=False, **_B["min_p"])]
QueryTopP = Annotated[float, Query(allow_inf_nan=False, **_B["top_p"])]
QuerySeed = Annotated[int, Query(**_B["seed"])]
QueryTopK = Annotated[int, Query(**_B["top_k"])]
QueryPenalty = Annotated[float, Query(allow_inf_nan=False, **_B["presence_penalty"])]  # both penalties
QueryLogprobs = Annotated[int | None, Query(**_B["logprobs"])]


class GenerateBody(BaseModel):
    """A /generate or /prefill body: every number bounded (a value out of range, NaN or
    Infinity is a 400 naming its field)."""

    model_config = ConfigDict(extra="forbid")
    prompt: list[Annotated[StrictInt, Field(ge=0, lt=INT32_LIMIT)]] = Field(min_length=1)
    max_tokens: StrictInt = Field(ge=1, lt=INT32_LIMIT)
    stop_at_eos: StrictBool = False
    request_id: StrictStr = Field("req", max_length=256)
    export_kv: StrictBool = False  # answer with the KV itself (npz)
    hold_kv: StrictBool = False  # keep the KV for a decode worker to pull; answer with its handle
    temperature: float = Field(0.0, allow_inf_nan=False, **_B["temperature"])
    top_p: float = Field(1.0, allow_inf_nan=False, **_B["top_p"])
    seed: StrictInt = Field(0, **_B["seed"])
    top_k: StrictInt = Field(0, **_B["top_k"])
    min_p: float = Field(0.0, allow_inf_nan=False, **_B["min_p"])
    presence_penalty: float = Field(0.0, allow_inf_nan=False, **_B["presence_penalty"])
    frequency_penalty: float = Field(0.0, allow_inf_nan=False, **_B["frequency_penalty"])
    logprobs: StrictInt | None = Field(None, **_B["logprobs"])
    # the prompt's tail that is the request's own output (penalties)
    prior_output: StrictInt = Field(0, ge=0, lt=INT32_LIMIT)
    images: list[StrictStr] | None = None  # base64 RGB uint8 [S, S, 3] each, S = the ViT's input size
    cache_salt: StrictStr | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)  # the tenant's

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            self.temperature,
            self.top_p,
            self.seed,
            self.top_k,
            self.min_p,
            self.presence_penalty,
            self.frequency_penalty,
            self.logprobs,
        )


def decode_images(images_b64: list[str] | None, vit):
    """base64 RGB uint8 [S, S, C] per image -> [N, S, S, C] (None for none), or ValueError.
    `vit`: the model's vision encoder config (None: the model takes no images)."""
    if not images_b64:
        return None
    if vit is None:
        raise ValueError("this model has no vision encoder: images are not accepted")
    shape = (vit.image_size, vit.image_size, vit.channels)
    try:
        arrays = [np.frombuffer(base64.b64decode(b, validate=True), np.uint8) for b in images_b64]
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"images must be base64: {err}") from None
    if any(a.size != int(np.prod(shape)) for a in arrays):
        raise ValueError(f"each image must be {shape} uint8 values")
    return np.stack([a.reshape(shape) for a in arrays])


def error(status: int, message: str, **extra) -> JSONResponse:
    """The worker's error answer: {"error": message, **extra}."""
    return JSONResponse({"error": message, **extra}, status_code=status)


def invalid(errors: list[dict]) -> JSONResponse:
    """400 naming the fields of pydantic's `errors` (the first as "param")."""
    skip = ("body", "query")  # FastAPI's location prefixes: the field's own path is what a client sent
    msg = describe_errors(errors, skip)
    return error(400, msg, param=error_path(errors[0], skip) if errors else None, retriable=False)


def event_error(event: dict, retriable: bool) -> JSONResponse:
    """A request's error event (`serving.worker.loop.request_failure`, `engine_failure`) as the
    answer of a request that has not started streaming: its status, message, retriable flag
    (`retriable` where the event has none) and code."""
    extra = {"code": event["code"]} if "code" in event else {}
    return error(event.get("status", 500), event["error"], retriable=event.get("retriable", retriable), **extra)
