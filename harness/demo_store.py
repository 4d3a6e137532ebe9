"""The demo's P/D through Mooncake: a prefill and a decode engine on one Mooncake store.

`run(spec)` starts the store's services (`cache.mooncake_tier.MooncakeServices`: master,
metadata and memory server on loopback) and runs the "pd-mooncake" setup in a child process
preloaded with the loopback shim (`cache.loopback`): Mooncake's transfer engine inside the
engines' client binds every interface otherwise, and a running process cannot be changed.
The child warms up its engines and makes a short run, measures the workload, and writes its
records back.
`available()` says whether Mooncake is installed here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

from cache.loopback import loopback_env
from cache.mooncake_tier import MooncakeHostKVTier, MooncakeServices, _binary
from harness.demo_setups import DemoSpec, engine_config, load_params, request_pages, run_mode
from kimik3 import stacked
from serving.deployment_env import child_env
from serving.disagg import DisaggregatedServer
from serving.engine import Engine
from serving.metrics import RequestRecord

log = logging.getLogger(__name__)
MODE = "pd-mooncake"


def available() -> bool:
    """Mooncake's store client and its binaries are installed."""
    try:
        import mooncake.store  # noqa: F401 (optional: the store extra; present or not is the answer)

        _binary("mooncake_master")
        _binary("mooncake_client")
        return True
    except Exception:  # noqa: BLE001 - ImportError, TierError, a broken install: the demo goes without
        return False


def run(spec, timeout_s: float = 900.0):
    """(records, wall seconds, XLA programs built while measuring, the engines' step profiles:
    "prefill" / "decode" -> `metrics.StepProfile.as_dict`) of the P/D-through-Mooncake setup."""
    with MooncakeServices(segment_bytes=256 << 20) as services, tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        argv = [
            sys.executable,
            "-m",
            "harness.demo_store",
            "--spec",
            json.dumps(dataclasses.asdict(spec)),
            "--master",
            services.master_addr,
            "--metadata",
            services.metadata_url,
            "--out",
            out,
        ]
        proc = subprocess.run(argv, env=loopback_env(child_env()), capture_output=True, text=True, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"the {MODE} run failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
        with open(out) as f:
            result = json.load(f)
    return [RequestRecord(**r) for r in result["records"]], result["wall_s"], result["compiles"], result["profile"]


def _child(args) -> int:
    fields = json.loads(args.spec)
    fields["turns"] = tuple(fields["turns"])
    spec = DemoSpec(**fields)
    params, cfg = load_params(spec)
    params = stacked.serving_layout(params, cfg, scan=False)
    tier = MooncakeHostKVTier(args.master, args.metadata)  # one store client, both engines' host tier

    def engines(namespace):
        def make(s, max_pages):
            common = engine_config(s, max_pages).replace(namespace=namespace)
            return DisaggregatedServer(
                Engine(params, cfg, common.replace(role="prefill", publish_to_host=True), host=tier),
                Engine(params, cfg, common.replace(role="decode"), host=tier),
                "store",
            )

        return make

    max_pages = request_pages(spec)
    # warm-up under its own namespace (the measured run starts from an empty store, as the other
    # setups start from empty tiers): both engines' programs and moves (`Engine.warmup`, as the
    # parent's engines do; the short run alone left page moves and the export snapshot to build
    # while measuring), then a short run for the store's first connections
    warm = engines("demo-warm-up")(spec, max_pages)
    for engine in (warm.prefill, warm.decode):
        engine.warmup()
    run_mode(
        params,
        cfg,
        dataclasses.replace(spec, sessions=1, turns=(2, 2)),
        MODE,
        max_pages=max_pages,
        engines=lambda *_: warm,
    )
    t0 = time.monotonic()
    _, records, compiles, profile = run_mode(params, cfg, spec, MODE, engines=engines("demo"))
    wall = time.monotonic() - t0
    tier.close()
    with open(args.out, "w") as f:
        json.dump(
            {
                "records": [dataclasses.asdict(r) for r in records],
                "wall_s": wall,
                "compiles": compiles,
                "profile": profile,
            },
            f,
        )
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness.demo_store", description=__doc__)
    parser.add_argument("--spec", required=True, help="the DemoSpec as JSON")
    parser.add_argument("--master", required=True, help="the Mooncake master's host:port")
    parser.add_argument("--metadata", required=True, help="the Mooncake metadata server's URL")
    parser.add_argument("--out", required=True, help="where the records go (JSON)")
    return _child(parser.parse_args(argv))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
