"""Offline inference: text in, text out, on one engine in this process, with the server's defaults.

    import kimik3

    llm = kimik3.LLM("tiny")  # a preset (random weights), a checkpoint or a Hugging Face directory
    outs = llm.generate(["Hello", "Once upon"], kimik3.SamplingParams(temperature=0, max_tokens=16))
    print(outs[0].text, outs[0].finish_reason)
    print(llm.chat([{"role": "user", "content": "Hi"}])[0].text)
    for piece in llm.stream("Once upon", kimik3.SamplingParams(max_tokens=16)):
        ...

Every request takes the server's path where the server has one, through the same functions:
the model, weights and tokenizer are loaded as `kimik3 worker` loads them (`serving.worker`), a
prompt becomes ids as the router makes them (`serving.openai_api.completion_prompt` and
`chat_prompt`, the tokenizer's chat template), sampling parameters are checked and mapped as the
router maps a request's (`check_common`, `sampling_options`: temperature 1 and top_p 1 when unset,
a fresh seed when none is given), the completion budget is the router's (`resolve_max_tokens`:
256 tokens unless `max_tokens` says otherwise, within the context), and the text is cut at stop
strings and stop token ids as the router cuts it (`serving.stop`).  So with temperature 0 a
prompt gets the tokens and text `kimik3 launch` would answer, which are the oracle's
(`kimik3.generate.generate`).

`generate` submits every prompt to the engine at once and steps it until all are done (the
scheduler batches them); `stream` steps it while the caller iterates.  An `LLM` is not
thread-safe: call it from one thread.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import operator
import os
from typing import Iterator, Sequence

import numpy as np

from kimik3 import config
from kimik3.text import load_serving_tokenizer
from serving.engine_config import EngineConfig
from serving.sampling import SamplingParams as EngineSampling
from serving.sampling import TokenLogprobs
from serving.stop import StopMatcher

log = logging.getLogger(__name__)

__all__ = ["LLM", "CompletionOutput", "SamplingParams"]

ENGINE_OPTIONS = frozenset(f.name for f in dataclasses.fields(EngineConfig))


def _invalid(err: Exception) -> ValueError:
    """A ValueError carrying what an `APIError` or a pydantic `ValidationError` says (the field it names)."""
    # optional: pydantic (the serve extra), which SamplingParams needs only once made
    from pydantic import ValidationError

    from serving.openai_api import APIError, validation_error

    if isinstance(err, ValidationError):
        err = validation_error(err)
    if isinstance(err, APIError):
        return ValueError(err.message)
    return ValueError(str(err))


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """vLLM's sampling fields, with the OpenAI server's defaults and bounds.

    temperature (default 1; 0 is greedy: the oracle's tokens), top_p (1), top_k (0 or -1: off),
    min_p (0: off), presence_penalty / frequency_penalty (vLLM's rule, over the output), seed
    (None: a fresh one per request, as the router draws it), max_tokens (None: the server's
    default budget of 256, within the context), stop (a string or up to 4; the text ends before
    the first), stop_token_ids (the text ends before such a token, which `token_ids` keeps),
    ignore_eos (go past the end-of-sequence token), logprobs (None: none; k <= 20: each token's
    logprob and the k most probable).  A value the server would refuse is a ValueError naming
    its field, here at construction (stop token ids against the vocabulary when a request is
    made)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None

    def __post_init__(self):
        if self.stop is not None and not isinstance(self.stop, str):
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.request("completion", {"prompt": [0]})  # the router's bounds, before any engine sees it

    def request(self, kind: str, body: dict, model: str = "kimik3", vocab_size: int | None = None):
        """The router's validated request of `kind` ("chat" or "completion") for `body` (its
        "messages" or "prompt") with these parameters (`ChatCompletionRequest` or
        `CompletionRequest`, checked by `check_common`), or ValueError naming the field."""
        # optional: pydantic (the serve extra), as in `_invalid`
        from pydantic import ValidationError

        from serving.openai_api import APIError, ChatCompletionRequest, CompletionRequest, check_common

        fields = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "max_tokens": self.max_tokens,
            "stop": self.stop if self.stop is None or isinstance(self.stop, str) else list(self.stop),
            "stop_token_ids": None if self.stop_token_ids is None else list(self.stop_token_ids),
            "ignore_eos": self.ignore_eos,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }
        if self.logprobs is not None:
            fields.update(
                {"logprobs": True, "top_logprobs": self.logprobs} if kind == "chat" else {"logprobs": self.logprobs}
            )
        schema = ChatCompletionRequest if kind == "chat" else CompletionRequest
        try:
            req = schema.model_validate({"model": model, **body, **fields})
            check_common(req, vocab_size)
        except (ValidationError, APIError) as err:
            raise _invalid(err) from None
        return req


@dataclasses.dataclass(frozen=True)
class CompletionOutput:
    """One request's result.

    prompt: the text given (a chat: the rendered conversation, special tokens by name; None for
    a prompt of ids); prompt_token_ids: what the engine ran; text: the completion, cut before a
    stop string or stop token (what the server answers as the choice's text); token_ids: every
    token generated, the end-of-sequence or stop token that ended it included (the server's
    `token_ids`); finish_reason: "stop" (end of sequence, a stop string or stop token) or
    "length"; logprobs: per token its `serving.sampling.TokenLogprobs` when the parameters asked
    for logprobs, else None; cached_tokens: prompt tokens served from the prefix cache."""

    prompt: str | None
    prompt_token_ids: tuple[int, ...]
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str
    logprobs: tuple[TokenLogprobs | None, ...] | None
    cached_tokens: int


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A request as the router hands it to a worker, plus what the router keeps to render the text."""

    prompt: str | None
    ids: list[int]
    images: np.ndarray | None
    max_tokens: int
    sampling: EngineSampling
    stop_at_eos: bool
    stops: list[str]
    stop_ids: frozenset[int]
    logprobs: bool


class _Text:
    """A request's tokens to its text as the router renders them
    (`serving.router.streaming.RequestStream._events`): an incremental detokenizer, stop strings
    held back until settled, a stop token's own text left out."""

    def __init__(self, tok, stops: list[str], stop_ids: frozenset[int]):
        self.decoder = tok.detokenizer()
        self.matcher = StopMatcher(stops)
        self.stop_ids = stop_ids
        self.text = ""
        self.tokens: list[int] = []
        self.logprobs: list = []
        self.finish: str | None = None

    def feed(self, token: int, logprobs) -> str:
        """The text `token` releases; `finish` becomes "stop" at a stop token or string."""
        self.tokens.append(token)
        self.logprobs.append(logprobs)
        if token in self.stop_ids:
            piece, self.finish = self.matcher.flush() + self.decoder.flush(), "stop"
        else:
            piece, stopped = self.matcher.feed(self.decoder.feed(token))
            if stopped:
                self.finish = "stop"
        self.text += piece
        return piece

    def end(self, reason: str) -> str:
        """The text held back when the generation ended by itself with `reason`."""
        piece, stopped = self.matcher.feed(self.decoder.flush())
        piece += self.matcher.flush()
        self.finish = "stop" if stopped else reason
        self.text += piece
        return piece


class _Live:
    """A submitted request: its engine record and its text so far."""

    def __init__(self, llm: "LLM", prep: _Prepared):
        self.llm, self.prep = llm, prep
        self.text = _Text(llm.tokenizer, prep.stops, prep.stop_ids)
        self.req = llm.engine.submit(
            prep.ids, prep.max_tokens, stop_at_eos=prep.stop_at_eos, sampling=prep.sampling, images=prep.images
        )

    @property
    def finished(self) -> bool:
        return self.text.finish is not None

    def advance(self) -> list[str]:
        """Take the tokens the engine produced since the last call: their text pieces.  A stop
        ends the request in the engine (its slot and pages go back at once), as the router's
        closed stream does.  RuntimeError when the engine failed the request."""
        req, pieces = self.req, []
        while not self.finished and len(self.text.tokens) < len(req.output):
            i = len(self.text.tokens)
            pieces.append(self.text.feed(int(req.output[i]), req.logprobs[i] if i < len(req.logprobs) else None))
            if self.finished and not req.done:
                self.llm.engine.cancel(req.request_id)
        if not self.finished and req.done and len(self.text.tokens) == len(req.output):
            if req.error:
                raise RuntimeError(f"request {req.request_id} failed in the engine: {req.error}")
            eos = self.llm.engine.config.eos_id
            pieces.append(
                self.text.end("stop" if req.stop_at_eos and req.output and req.output[-1] == eos else "length")
            )
        return [p for p in pieces if p]

    def cancel(self) -> None:
        if not self.req.done:
            self.llm.engine.cancel(self.req.request_id)

    def output(self) -> CompletionOutput:
        t = self.text
        return CompletionOutput(
            prompt=self.prep.prompt,
            prompt_token_ids=tuple(self.prep.ids),
            text=t.text,
            token_ids=tuple(t.tokens),
            finish_reason=t.finish,
            logprobs=tuple(t.logprobs) if self.prep.logprobs else None,
            cached_tokens=self.req.cached_tokens,
        )


def _worker_defaults() -> argparse.Namespace:
    """`kimik3 worker`'s options as it starts without any (what `kimik3 launch` gives it on a CPU)."""
    from serving import worker  # the HTTP stack: loads where an LLM is built

    parser = argparse.ArgumentParser(add_help=False)
    worker.add_arguments(parser)
    return parser.parse_args(["--port", "0"])


def _model_config(model: str):
    """(ModelConfig, checkpoint directory or None) of a preset name or a directory, read without its weights."""
    from kimik3 import checkpoint  # JAX and orbax: load with a model, not with kimik3.SamplingParams

    if os.path.isdir(model):
        return checkpoint.load_config(model), model
    if model in config.PRESETS:
        return config.get_config(model), None
    raise ValueError(
        f"model {model!r} is neither a directory (a kimik3 or Hugging Face checkpoint) nor a preset "
        f"of kimik3.config ({', '.join(sorted(config.PRESETS))})"
    )


def _load_params(cfg, checkpoint_dir: str | None, seed: int, dtype: str | None, manifest: str | None):
    """(params, cfg, dtype) as a worker loads them (`serving.worker.load_weights`): a checkpoint's
    weights (a quantized one as `manifest`) cast to `dtype` (default: as stored), or a preset's
    random weights from `seed` in `dtype` (default: the config's)."""
    from serving import worker  # the HTTP stack: loads where an LLM is built

    return worker.load_weights(cfg, checkpoint_dir, seed, dtype, manifest)


class LLM:
    """One engine serving one model in this process (see the module's docstring).

    model: a preset of `kimik3.config` ("tiny", "small", ...: random weights from `seed`), a
    `kimik3 train` checkpoint directory (quantized ones with `manifest`), or a Hugging Face model
    directory (Kimi-Linear).  tokenizer: `kimik3.text.load_tokenizer`'s spec (default: the
    checkpoint directory's own tokenizer, else the byte tokenizer).  dtype: the params' (default:
    the checkpoint's, or the preset's).  warmup: compile every step shape before the first request
    (`Engine.warmup`, as a worker does; default: compile the shapes requests need as they come).
    engine_options: `serving.engine_config.EngineConfig` fields; the rest are the worker's
    defaults (a pool of 256 pages, 8 slots, its page and KDA-block sizes for the config).  An
    unknown option, or a value EngineConfig refuses, is a ValueError naming it, before any
    weight is read."""

    def __init__(
        self,
        model: str | os.PathLike,
        *,
        tokenizer: str | None = None,
        seed: int = 0,
        dtype: str | None = None,
        manifest: str | None = None,
        warmup: bool = False,
        **engine_options,
    ):
        # JAX, the engine and the HTTP stack load here, not with kimik3.SamplingParams
        from kimik3 import hf
        from serving import worker
        from serving.engine import Engine

        model = os.fspath(model)
        unknown = sorted(set(engine_options) - ENGINE_OPTIONS)
        if unknown:
            raise ValueError(
                f"unknown engine option{'s' * (len(unknown) > 1)} {', '.join(unknown)}: the options are "
                f"EngineConfig's fields ({', '.join(sorted(ENGINE_OPTIONS))})"
            )
        if engine_options.get("role", "both") != "both":
            raise ValueError(
                f"role must be 'both' offline (one engine runs whole requests); got {engine_options['role']!r}"
            )
        if engine_options.get("draft_tokens", 0):
            raise ValueError("draft_tokens: speculative decoding needs an EAGLE-3 draft, which LLM does not load")
        if manifest is not None and not os.path.isdir(model):
            raise ValueError("manifest names the quantized weights of a checkpoint: pass its directory as model")
        cfg, checkpoint_dir = _model_config(model)
        self.tokenizer = load_serving_tokenizer(tokenizer, checkpoint_dir, cfg.vocab_size)
        args = _worker_defaults()
        page, block = worker.default_cache_geometry(cfg.name)
        opts = {
            "num_pages": worker.pool_pages(args, cfg, None, page),
            "num_slots": args.num_slots,
            "page_tokens": page,
            "kda_block_tokens": block,
            "prefill_chunk_tokens": args.prefill_chunk_tokens,
            "kernels": args.kernels,
            "eos_id": self.tokenizer.eos_id,
        }
        opts.update(engine_options)
        opts.setdefault("num_snapshots", 4 * opts["num_slots"])
        opts.setdefault("max_pages_per_request", min(-(-cfg.max_seq_len // opts["page_tokens"]), opts["num_pages"] - 1))
        try:
            engine_config = EngineConfig(**opts)
        except TypeError as err:  # a value of the wrong kind where EngineConfig compares it
            raise ValueError(f"engine options {', '.join(sorted(engine_options))}: {err}") from None
        params, self.config, self.dtype = _load_params(cfg, checkpoint_dir, seed, dtype, manifest)
        self.engine = Engine(params, self.config, engine_config)
        # the name the router serves the model under (its requests name it; here only for their schema)
        self.model_name = (
            self.config.name if checkpoint_dir and hf.is_hf_dir(checkpoint_dir) else f"kimik3-{self.config.name}"
        )
        # the worker's max_context: prompt + completion of one request
        usable = min(self.engine.max_pages, self.engine.manager.page_pool.num_blocks - 1)
        self.max_context = min(self.config.max_seq_len, usable * self.engine.page_tokens)
        if warmup:
            self.engine.warmup(sampled=True)
        log.info("LLM %s ready (%s, %s)", self.model_name, self.dtype, engine_config)

    # ---- requests as the router makes them -------------------------------------------------------------
    def _prepare(self, kind: str, item, sp: SamplingParams | None) -> _Prepared:
        # optional: pydantic and the HTTP stack (the serve extra), loaded since the LLM was built
        from serving.openai_api import APIError, chat_prompt, completion_prompt, logprobs_count, resolve_max_tokens
        from serving.openai_api import sampling_options, stop_strings
        from serving.router import RouterConfig

        sp = SamplingParams() if sp is None else sp
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling_params must be a kimik3.SamplingParams; got {type(sp).__name__}")
        images = None
        try:
            if kind == "chat":
                req = sp.request("chat", {"messages": item}, self.model_name, self.config.vocab_size)
                vit = self.config.vit
                ids, pixels = chat_prompt(
                    req,
                    max_images=RouterConfig.max_images,
                    tokens_per_image=vit.tokens_per_image if vit else 0,
                    image_size=vit.image_size if vit else 0,
                    tok=self.tokenizer,
                )
                images = np.stack(pixels) if pixels else None
                prompt = self.tokenizer.decode(ids, skip_special=False)
            else:
                if not isinstance(item, str):
                    try:
                        item = [operator.index(t) for t in item]
                    except TypeError:
                        raise ValueError("a prompt is a string or a sequence of token ids") from None
                req = sp.request("completion", {"prompt": item}, self.model_name, self.config.vocab_size)
                ids = completion_prompt(req, vocab_size=self.config.vocab_size, tok=self.tokenizer)
                prompt = item if isinstance(item, str) else None
            max_tokens = resolve_max_tokens(req.max_tokens, len(ids), self.max_context, RouterConfig.default_max_tokens)
        except APIError as err:
            raise _invalid(err) from None
        return _Prepared(
            prompt=prompt,
            ids=ids,
            images=images,
            max_tokens=max_tokens,
            sampling=EngineSampling(**sampling_options(req)),
            stop_at_eos=not req.ignore_eos,
            stops=stop_strings(req),
            stop_ids=frozenset(req.stop_token_ids or ()),
            logprobs=logprobs_count(req) is not None,
        )

    def _run(self, prepared: list[_Prepared], use_tqdm: bool) -> list[CompletionOutput]:
        """Submit every request, step the engine until each has finished, and their outputs in order."""
        if use_tqdm:
            from tqdm.auto import tqdm  # a widget in Jupyter
        else:  # no bar: tqdm.auto would only warn in a Jupyter without ipywidgets
            from tqdm import tqdm  # chosen per call, as above

        live: list[_Live] = []
        try:
            for p in prepared:
                live.append(_Live(self, p))
            with tqdm(total=len(live), desc="generate", unit="req", disable=not use_tqdm) as bar:
                pending = list(live)
                while pending:
                    self.engine.step()
                    for r in pending:
                        r.advance()
                    still = [r for r in pending if not r.finished]
                    bar.update(len(pending) - len(still))
                    pending = still
                    if pending and not self.engine.has_work():
                        raise RuntimeError("the engine stopped with requests unfinished")
        finally:
            for r in live:
                r.cancel()
            self.engine.pop_finished()
        return [r.output() for r in live]

    # ---- the API ----------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[CompletionOutput]:
        """Complete each prompt (a string: <|bos|> then its text, as /v1/completions encodes it; or
        a sequence of token ids), all in one engine together.  `prompts`: one prompt or a list of
        them; the result has one output per prompt, in order.  A prompt or parameter the server
        would refuse is a ValueError before anything runs."""
        if isinstance(prompts, str) or (len(prompts) and not isinstance(prompts[0], str) and _is_id(prompts[0])):
            prompts = [prompts]
        return self._run([self._prepare("completion", p, sampling_params) for p in prompts], use_tqdm)

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[CompletionOutput]:
        """Answer each conversation: OpenAI's messages ({"role", "content"}; content a string or
        parts, images as base64 `data:` URLs), rendered through the tokenizer's chat template with
        the assistant's turn opened, as /v1/chat/completions renders them.  `messages`: one
        conversation or a list of them; one output per conversation, in order."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self._run([self._prepare("chat", c, sampling_params) for c in convs], use_tqdm)

    def stream(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None):
        """Complete one prompt (as `generate`), yielding the text as it comes: the pieces join to
        the output's text, and the generator returns the `CompletionOutput` (StopIteration.value).
        Closing the generator early ends the request."""
        return self._stream(self._prepare("completion", prompt, sampling_params))

    def stream_chat(self, messages: Sequence[dict], sampling_params: SamplingParams | None = None):
        """Answer one conversation (as `chat`), yielding the text as it comes (as `stream`)."""
        return self._stream(self._prepare("chat", messages, sampling_params))

    def _stream(self, prepared: _Prepared) -> Iterator[str]:
        r = _Live(self, prepared)
        try:
            while not r.finished:
                self.engine.step()
                yield from r.advance()
                if not r.finished and not self.engine.has_work():
                    raise RuntimeError("the engine stopped with the request unfinished")
        finally:
            r.cancel()
            self.engine.pop_finished()
        return r.output()


def _is_id(x) -> bool:
    try:
        operator.index(x)
    except TypeError:
        return False
    return True
