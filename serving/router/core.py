"""`Router`: the router's parts wired together, and the path of one request through the pools.

A request runs in stages, each through the one retry loop (`serving.router.retry.Failover`):

* colocated (no prefill workers): the whole request on a decode ("both") worker;
* store handoff: the first token on a prefill worker (its engine publishes the prompt's pages
  and KDA snapshots to the shared store), the rest on a decode worker that finds the prefix there;
* direct handoff: a prefill worker holds the prompt's KV under a one-time handle, and the
  decode worker's `/adopt` pulls it from that worker (`serving.kv_handoff`); the router carries
  the handle only.

A decode worker that fails mid-stream is replaced by another that continues from the prompt and
the tokens already sent: no token is sent twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx

from cache.media import build_fetcher
from kimik3 import config
from kimik3.text import load_serving_tokenizer
from serving import internal_auth, router_auth
from serving.router import upstream
from serving.router.admission import Admission
from serving.router.app import RouterApp
from serving.router.config import RouterConfig
from serving.router.intake import Intake, Parsed
from serving.router.metrics import RouterMetrics
from serving.router.policy import PrefixAffinity, StoreProbe
from serving.router.registry import Worker, WorkerPools
from serving.router.retry import Failover, Route
from serving.sampling import TokenLogprobs

log = logging.getLogger(__name__)


class Router:
    """One router over `cfg`'s workers: its pools (`pools`, and their lists `prefill`, `decode`,
    `workers`), placement policy (`policy`), retry loop (`failover`), admission, metrics, request
    intake and media fetcher.  `client` (the HTTP client to the workers) exists between `start`
    and `stop`; `create_app` is the HTTP app whose lifespan calls both."""

    def __init__(self, cfg: RouterConfig):
        if not cfg.decode:
            raise ValueError("the router needs decode (or both-role) workers: --decode URL ...")
        if cfg.handoff not in ("auto", "store", "direct"):
            raise ValueError(f"handoff must be auto, store or direct; got {cfg.handoff!r}")
        self.cfg = cfg
        self.model_cfg = _model_config(cfg)
        self.tok = load_serving_tokenizer(cfg.tokenizer, cfg.checkpoint, self.model_cfg.vocab_size)
        self.keys = router_auth.KeyRing.from_config(cfg.api_key, cfg.api_key_file)
        # a Hugging Face directory is served under its own name (vLLM's habit); a config or our
        # own checkpoint as kimik3-<config>
        from kimik3 import hf  # JAX: loads when a Router is made, not with `import serving.router`

        hf_dir = bool(cfg.checkpoint) and hf.is_hf_dir(cfg.checkpoint)
        self.model_name = cfg.model_name or (self.model_cfg.name if hf_dir else f"kimik3-{self.model_cfg.name}")
        self.metrics = RouterMetrics(self.model_name)
        self.pools = WorkerPools(cfg, self.tok, self.metrics)
        self.prefill, self.decode, self.workers = self.pools.prefill, self.pools.decode, self.pools.all
        self.policy = PrefixAffinity(cfg, self.model_cfg, self.pools, self.metrics)
        self.affinity = self.policy.entries
        self.failover = Failover(cfg, self.metrics, self.policy.pick, self.policy.remember)
        self.admission = Admission(cfg.max_inflight, cfg.max_queue, cfg.queue_timeout_s)
        self.media = build_fetcher(
            enabled=cfg.fetch_images,
            allow_hosts=cfg.fetch_allow_hosts,
            allow_networks=cfg.fetch_allow_networks,
            timeout_s=cfg.fetch_timeout_s,
            max_bytes=cfg.fetch_max_bytes,
            l1_bytes=cfg.l1_bytes,
            l1_redis=cfg.l1_redis,
            l2_bytes=cfg.l2_bytes,
        )
        names = (self.model_name, self.model_cfg.name)
        self.intake = Intake(cfg, self.model_cfg, self.tok, self.media, names, lambda: self.max_context)
        self.aliases = self.intake.aliases
        self.max_token_bytes = self.intake.max_token_bytes
        self.client: httpx.AsyncClient | None = None
        self._health_task: asyncio.Task | None = None
        self.created = int(time.time())

    # ---- the parts' state, as callers (and tests) reach it ------------------------------------------
    @property
    def store(self) -> StoreProbe | None:
        """The shared store's probe (`PrefixAffinity.store`); None: every known prefix is GPU-only."""
        return self.policy.store

    @store.setter
    def store(self, probe: StoreProbe | None) -> None:
        self.policy.store = probe

    @property
    def sleep(self):
        """The wait between attempts (`Failover.sleep`): a coroutine function of seconds,
        `asyncio.sleep` unless a caller (a test) records the waits instead of sleeping them."""
        return self.failover.sleep

    @sleep.setter
    def sleep(self, fn) -> None:
        self.failover.sleep = fn

    @property
    def max_context(self) -> int:
        """The smallest context any worker reports; the model's own before any has answered."""
        return self.pools.max_context(self.model_cfg.max_seq_len)

    @property
    def max_values(self) -> int:
        """The most JSON values a /v1 body may hold (`Intake.max_values`)."""
        return self.intake.max_values

    # ---- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        self.client = httpx.AsyncClient(
            limits=limits,
            timeout=httpx.Timeout(self.cfg.read_timeout_s, connect=self.cfg.connect_timeout_s),
            headers=internal_auth.headers(internal_auth.token()),
        )
        if self.cfg.mooncake_master:
            try:
                self.store = await asyncio.to_thread(StoreProbe, self.cfg.mooncake_master, self.cfg.mooncake_metadata)
            except Exception as e:  # noqa: BLE001 - without the probe, affinity applies to every known prefix
                log.warning("shared store probe unavailable: %r", e)
        await self.check_health()
        self._health_task = asyncio.create_task(self._health_loop())

    async def stop(self) -> None:
        if self._health_task:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.client:
            await self.client.aclose()
        if self.store:
            self.store.close()

    def create_app(self):
        """The HTTP app (`serving.router.app.RouterApp`) serving this router."""
        return RouterApp(self).app

    # ---- workers: health, metrics, placement -----------------------------------------------------------
    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_interval_s)
            try:
                await self.check_health()
            except Exception:  # noqa: BLE001 - one failed check must not end the loop
                log.exception("health check round failed")

    async def check_health(self) -> None:
        await self.pools.check_all(self.client)

    async def _check(self, w: Worker) -> None:
        await self.pools.check(self.client, w)

    async def scrape_workers(self) -> dict[str, str | None]:
        """Every worker's /metrics text by URL (`RouterMetrics.scrape_workers`)."""
        return await self.metrics.scrape_workers(self.client, self.workers)

    async def pick(self, pool: list[Worker], tried: set[str], prompt: list[int] | None, salt=None, images_b64=None):
        """The worker of `pool` for the next attempt (`PrefixAffinity.pick`)."""
        return await self.policy.pick(pool, tried, prompt, salt, images_b64)

    def _hashes(self, prompt: list[int], salt: str | None = None, images_b64: list[str] | None = None) -> list[bytes]:
        return self.policy.hashes(prompt, salt, images_b64)

    def _remember(self, prompt: list[int], url: str, salt: str | None = None, images_b64=None) -> None:
        self.policy.remember(prompt, url, salt, images_b64)

    # ---- /v1 bodies ---------------------------------------------------------------------------------
    def parse(self, kind: str, raw, tenant: str = router_auth.ANONYMOUS) -> Parsed:
        """A /v1 body of `tenant` (`router_auth`) validated and tokenized, or APIError: `validate`
        then `build`.  Blocking (CPU); the app runs the two on threads."""
        return self.intake.parse(kind, raw, tenant)

    def validate(self, kind: str, raw):
        """The body's validated request, or APIError (`Intake.validate`)."""
        return self.intake.validate(kind, raw)

    def build(self, kind: str, req, tenant: str = router_auth.ANONYMOUS) -> Parsed:
        """A validated request's prompt, images and budget, or APIError (`Intake.build`)."""
        return self.intake.build(kind, req, tenant)

    # ---- one request through the pools ----------------------------------------------------------------
    def handoff_mode(self) -> str:
        """How KV moves from prefill to decode: `cfg.handoff`, or for "auto" the shared store when
        every prefill worker that reported has one, else directly."""
        if self.cfg.handoff != "auto":
            return self.cfg.handoff
        stores = [w.info.get("store") for w in self.prefill if "store" in w.info]
        return "store" if stores and all(stores) else "direct"

    async def _run_pool(
        self,
        pool: list[Worker],
        prompt: list[int],
        out: list[int],
        total: int,
        opts: dict,
        rid: str,
        affinity: bool,
        adopt: dict | None = None,
    ):
        """Generate until `out` holds `total` tokens (or EOS) on `pool`, failing over between workers
        (`Failover.run`; placed by prefix affinity when `affinity`).  The first attempt adopts
        `adopt`'s KV if given; later ones recompute from the prompt and `out`.  Yields ("info", ev)
        with a stage's cache counts, ("logprobs", `TokenLogprobs`) and ("token", t) per token, and
        finally ("done", event)."""
        role = pool[0].role

        async def attempt(w: Worker, first: bool):
            handed = adopt if first else None  # the handed-over KV may be half taken: later attempts recompute
            before = len(out)
            async for ev in upstream.stream(self.client, w, prompt + out, total - len(out), opts, rid, out, handed):
                if "done" in ev and role == "decode" and before == 1:  # the handoff itself, not a failover
                    self.metrics.handoffs.labels("direct" if handed is not None else "store").inc()
                yield ev

        route = Route(prompt, opts.get("cache_salt"), opts.get("images")) if affinity else None
        async for ev in self.failover.run(pool, attempt, rid=rid, out=out, route=route):
            if "done" in ev:
                yield "done", ev
                continue  # the loop ends after its done event
            if "cached_tokens" in ev:
                yield "info", ev
            if "logprob" in ev:  # the token's, just before it
                yield "logprobs", TokenLogprobs.from_json(ev)
            yield "token", ev["token"]

    async def _prefill_direct(self, prompt: list[int], rid: str, opts: dict) -> tuple[int, dict, dict]:
        """Direct handoff, prefill side, through the same retry loop as every stage: (first token,
        where a decode worker pulls the prompt's KV from {"kv_from", "kv_handle"}, cache counts
        and the first token's logprobs)."""
        body = {"prompt": prompt, "max_tokens": 1, "request_id": rid, "hold_kv": True, **opts}
        timeout = httpx.Timeout(self.cfg.prefill_timeout_s, connect=self.cfg.connect_timeout_s)

        async def attempt(w: Worker, first: bool):
            yield await upstream.prefill_hold(self.client, w, body, timeout)

        route = Route(prompt, opts.get("cache_salt"), opts.get("images"))
        async with contextlib.aclosing(self.failover.run(self.prefill, attempt, rid=rid, out=[], route=route)) as run:
            async for a in run:
                self.metrics.handoff_bytes.inc(a["kv_bytes"])
                info = {k: a[k] for k in ("cached_tokens", "cached_tokens_host", "logprobs") if k in a}
                return a["token"], {"kv_from": a["kv_from"], "kv_handle": a["kv_handle"]}, info
        raise AssertionError("the retry loop ends with an answer or an exception")

    async def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        stop_at_eos: bool,
        rid: str,
        sampling: dict | None = None,
        images_b64: list[str] | None = None,
        cache_salt: str | None = None,
    ):
        """Yields ("token", id) for every output token (after ("logprobs", `TokenLogprobs`) for it when
        `sampling` asks for logprobs), ("info", {"cached_tokens", "cached_tokens_host"})
        once the first stage's prefix-cache share is known (before its first token), and a final
        ("done", summary).
        `sampling`: `openai_api.sampling_options`'s {"temperature", "top_p", "seed", "top_k", "min_p",
        and where asked "presence_penalty", "frequency_penalty", "logprobs"} (default greedy); `images_b64`: the
        prompt's images as base64 RGB uint8 [S, S, 3] bytes (they travel with every attempt,
        and inside a direct handoff's KV); `cache_salt`: the tenant's (`router_auth.cache_salt`),
        sent to every worker and in the router's own affinity hashes."""
        opts = {"stop_at_eos": stop_at_eos, **(sampling or {}), "images": images_b64}
        if cache_salt is not None:
            opts["cache_salt"] = cache_salt
        out: list[int] = []
        summary = {"cached_tokens": 0, "cached_tokens_host": 0, "finish_reason": "length"}
        stopped = lambda: stop_at_eos and out and out[-1] == self.tok.eos_id
        adopt = None
        if self.prefill and self.handoff_mode() == "direct":
            token, adopt, first = await self._prefill_direct(prompt, rid, opts)
            out.append(token)
            lp = first.pop("logprobs", None)
            summary.update(first)
            yield "info", {k: summary[k] for k in ("cached_tokens", "cached_tokens_host")}
            if lp is not None:
                yield "logprobs", lp
            yield "token", token
            stages = [(self.decode, max_tokens, False)]
        elif self.prefill:
            stages = [(self.prefill, 1, True), (self.decode, max_tokens, False)]
        else:
            stages = [(self.decode, max_tokens, True)]
        for pool, upto, first_stage in stages:
            if len(out) >= max_tokens or stopped():
                break
            async for kind, ev in self._run_pool(pool, prompt, out, upto, opts, rid, affinity=first_stage, adopt=adopt):
                if kind in ("token", "logprobs"):
                    yield kind, ev
                elif first_stage:
                    summary["cached_tokens"] = ev.get("cached_tokens", 0)
                    summary["cached_tokens_host"] = ev.get("cached_tokens_host", 0)
                    if kind == "info":
                        yield "info", {k: summary[k] for k in ("cached_tokens", "cached_tokens_host")}
                elif kind == "info":
                    pass
                else:
                    self.metrics.handoff_cached.inc(ev.get("cached_tokens", 0))
        summary["finish_reason"] = "stop" if stopped() else "length"
        yield "done", summary


def _model_config(cfg: RouterConfig):
    """The served model's config: the checkpoint's own (a trained or quantized checkpoint), else
    the named config."""
    if cfg.checkpoint:
        from kimik3 import checkpoint  # orbax: loads only where a checkpoint is served

        return checkpoint.load_config(cfg.checkpoint)

    return config.get_config(cfg.config)
