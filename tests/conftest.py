"""Shared fixtures: the tiny config and its fp32 params, built once per session."""

import os
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache per test run, never the user's ~/.cache: made by the first
# process (pytest's controller; xdist's workers and every process a test starts -- CLI runs,
# serving workers, notebooks, benchmark scripts -- inherit it), so each program compiles once a
# run instead of once per process.  Tests about the cache itself set their own directory
# (tests/kimik3/test_compile_cache.py).  Cache entries are keyed by the program's HLO and the
# compiler's version and options: a hit is the same executable.
_OWN_CACHE = "KIMIK3_TEST_COMPILE_CACHE" not in os.environ
if _OWN_CACHE:
    os.environ["KIMIK3_TEST_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="kimik3-test-xla-")
RUN_CACHE = os.environ["KIMIK3_TEST_COMPILE_CACHE"]
os.environ["KIMIK3_COMPILE_CACHE"] = RUN_CACHE
# and for processes that never call compile_cache.enable (the notebooks' kernels): JAX reads these
os.environ["JAX_COMPILATION_CACHE_DIR"] = RUN_CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"
# On the CPU the suite's time is mostly XLA:CPU compiling thousands of small programs that then run
# a few times: LLVM's optimizations cost more than they save there (tests/kimik3/test_paged_cache.py
# and test_generate.py: 142 -> 110 s).  Every process the tests start inherits it; a GPU run
# (JAX_PLATFORMS=cuda, tests/gpu) keeps XLA's defaults.
_FAST_COMPILE = {"xla_backend_optimization_level": "0", "xla_llvm_disable_expensive_passes": "true"}
if os.environ["JAX_PLATFORMS"] == "cpu":  # a flag already in XLA_FLAGS wins
    _flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = " ".join(
        [_flags] + [f"--{k}={v}" for k, v in _FAST_COMPILE.items() if f"--{k}=" not in _flags]
    ).strip()

import jax

# Sharding tests need several devices; on CPU they are host-platform devices.  Set before any
# backend initializes (single-device tests still run on device 0).
jax.config.update("jax_num_cpu_devices", 8)

import re

import jax.numpy as jnp
import numpy as np
import pytest

from kimik3 import compile_cache, config, model

compile_cache.enable(RUN_CACHE)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: minutes of CPU for what faster tests cover too; runs with KIMIK3_SLOW=1")


def pytest_collection_modifyitems(config, items):
    """Slow tests run with KIMIK3_SLOW=1 (or when chosen by -m slow); the default suite stays
    within CI's 20 minutes on 2 cores."""
    if os.environ.get("KIMIK3_SLOW") == "1" or "slow" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="slow: set KIMIK3_SLOW=1 to run it")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# Every compiled XLA:CPU program keeps ~3 memory mappings (its JIT code) for as long as a jit cache
# holds it, and an xdist worker compiles thousands over the suite: enough to reach the kernel's
# vm.max_map_count (65530), after which XLA's next mmap fails inside a compile or a
# compile-cache write (SIGSEGV / SIGABRT, a different test each run).  .ci/run raises the limit
# where it may; past half of whatever the limit is, the caches are cleared between tests (the
# programs a later test needs again recompile, or load from the run's persistent cache).  A clear
# also drops the programs of engines that fixtures warmed, so it stays the exception: a test
# never counts programs compiled before it started.
def _map_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


MAX_MAPS = _map_limit() // 2


def _mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:  # not Linux
        return 0


@pytest.fixture(autouse=True)
def _bounded_memory_mappings():
    yield
    if _mappings() > MAX_MAPS:
        import gc

        jax.clear_caches()
        gc.collect()


def pytest_sessionfinish(session):
    """The process that made the run's cache removes it (xdist's workers finish first)."""
    if _OWN_CACHE and not hasattr(session.config, "workerinput"):
        import shutil

        shutil.rmtree(RUN_CACHE, ignore_errors=True)


def _once_per_run(tmp_path_factory, name: str, build, load):
    """build(dir) where the run's first process asks for `name`, load(dir) in every later ask:
    under xdist the workers share the run's base temp directory, and a lock there makes one
    worker build while another waits and then loads (same bytes: a checkpoint round trip), so
    the suite trains once instead of once per worker."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    out = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "done").exists():
            return load(str(out))
        value = build(str(out))
        (out / "done").write_text("")
        return value


def require_licence_corpus() -> None:
    """Skip where Debian's licence texts (/usr/share/common-licenses, the corpus `trained_tiny` and
    `trained_draft` train on) are missing; a failure instead where KIMIK3_REQUIRE_CORPUS or
    KIMIK3_REQUIRE_REFERENCE is set (as in CI), so the tests built on them cannot pass by not
    running."""
    from kimik3 import corpus

    try:
        corpus.find_sources("licenses")
    except FileNotFoundError as e:
        if os.environ.get("KIMIK3_REQUIRE_CORPUS") or os.environ.get("KIMIK3_REQUIRE_REFERENCE"):
            pytest.fail(
                f"the licence corpus is required (KIMIK3_REQUIRE_CORPUS / KIMIK3_REQUIRE_REFERENCE): {e}", pytrace=False
            )
        pytest.skip("no /usr/share/common-licenses (not a Debian system)")


@pytest.fixture(scope="session")
def trained_tiny(tmp_path_factory):
    """(TrainConfig, result, params): `tiny` trained for 60 steps on the Debian licence texts, once
    a run (tests/kimik3/test_train.py, test_eagle.py and the speculative serving tests share it;
    xdist's ``--dist loadgroup`` would put its users on one worker, but here (pytest 9.2, xdist
    3.8) grouped tests still spread over the workers (checked), so the workers share it on disk:
    `_once_per_run`)."""
    import json

    from kimik3 import checkpoint, train

    require_licence_corpus()
    tc_at = lambda out: train.TrainConfig(
        config="tiny",
        steps=60,
        batch=8,
        seq_len=64,
        lr=3e-3,
        warmup_steps=6,
        eval_every=30,
        eval_batches=4,
        corpus="licenses",
        out=out,
        progress=False,
    )

    def load(out):
        with open(os.path.join(out, "train.json")) as f:
            result = json.load(f)
        return tc_at(out), result, checkpoint.restore(os.path.join(out, "checkpoint"))[0]

    return _once_per_run(tmp_path_factory, "trained_tiny", lambda out: (tc_at(out), *train.train(tc_at(out))), load)


@pytest.fixture(scope="session")  # not module: xdist may interleave other modules' tests and rebuild it
def trained_draft(trained_tiny, tmp_path_factory):
    """(params, train-eagle result, draft, out dir): an EAGLE-3 draft for `trained_tiny`, 60 steps on
    its continuations of the licence texts (out/draft loads with `eagle_train.load_draft`); once a
    run, as `trained_tiny`."""
    import json

    from kimik3 import eagle_train

    _, _, params = trained_tiny

    def build(out):
        dc = eagle_train.DraftTrainConfig(
            steps=60, batch=8, seq_len=64, prompt_len=16, pool=32, corpus="licenses", out=out, progress=False
        )
        result, draft = eagle_train.train_draft(params, config.tiny(), dc)
        return params, result, draft, out

    def load(out):
        with open(os.path.join(out, "eagle_train.json")) as f:
            result = json.load(f)
        return params, result, eagle_train.load_draft(os.path.join(out, "draft"), config.tiny(), params)[0], out

    return _once_per_run(tmp_path_factory, "trained_draft", build, load)


@pytest.fixture(scope="session")
def tiny_cfg():
    return config.tiny()


# Leaves the model initializes to the identity (norm scales 1, biases 0).  Fixtures draw them at
# random instead, so a wrong axis, an omitted weight or a mis-sliced shard of them changes the
# numbers every oracle and sharded comparison checks.
SCALE_LEAF = re.compile(r"(scale|_norm|norm_v|norm_l)$")
BIAS_LEAF = re.compile(r"(/bias|dt_bias_hk)$")


def perturb_identity_leaves(params, seed: int):
    """Norm scales ~ 1 + 0.1 N(0, 1), biases ~ 0.1 N(0, 1); every other leaf as it was."""
    rng = np.random.default_rng(seed)

    def leaf(path, x):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        if SCALE_LEAF.search(name):
            return jnp.asarray(1.0 + 0.1 * rng.standard_normal(x.shape), x.dtype)
        if BIAS_LEAF.search(name):
            return jnp.asarray(0.1 * rng.standard_normal(x.shape), x.dtype)
        return x

    return jax.tree_util.tree_map_with_path(leaf, params)


@pytest.fixture(scope="session")
def tiny_params(tiny_cfg):
    params = perturb_identity_leaves(model.init_params(tiny_cfg, jax.random.PRNGKey(0), "float32"), seed=7)
    # A non-zero selection bias, so tests see it steer selection and not weights.
    for i in range(1, tiny_cfg.n_layers):
        bias = jax.random.normal(jax.random.PRNGKey(100 + i), (tiny_cfg.n_routed_experts,)) * 0.1
        params[f"layer_{i}"]["moe"]["router_bias_e"] = bias
    return params


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def start_mooncake(segment_bytes: int):
    """Started `MooncakeServices` (master, metadata and memory server on 127.0.0.1), or a skip
    where Mooncake is not installed (an error where KIMIK3_REQUIRE_MOONCAKE is set, as in CI)."""
    from cache.mooncake_tier import MooncakeServices, TierError

    try:
        return MooncakeServices(segment_bytes=segment_bytes).start()
    except TierError as e:
        if os.environ.get("KIMIK3_REQUIRE_MOONCAKE"):
            raise
        pytest.skip(f"Mooncake unavailable: {e}")


@pytest.fixture(scope="session")
def mooncake_services():
    """A real mooncake_master + memory server on 127.0.0.1 for the session (skip only outside CI)."""
    services = start_mooncake(256 << 20)
    yield services
    services.stop()
