"""The loopback shim (`cache.loopback`): in a process started with its environment a
wildcard bind lands on loopback, except on the ports allowed to stay public."""

import socket
import subprocess
import sys

import pytest

from cache import loopback

PROBE = """
import socket, sys
def bound(family, addr, v6only=None):
    s = socket.socket(family, socket.SOCK_STREAM)
    if v6only is not None:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, v6only)
    s.bind((addr, int(sys.argv[1]) if addr == "0.0.0.0" and len(sys.argv) > 1 else 0))
    s.listen()
    return s, s.getsockname()[0]
v4, a = bound(socket.AF_INET, "0.0.0.0")
dual, b = bound(socket.AF_INET6, "::", 0)
v6, c = bound(socket.AF_INET6, "::", 1)
named, d = bound(socket.AF_INET, "127.0.0.1")
c4 = socket.create_connection(("127.0.0.1", dual.getsockname()[1]), timeout=5)  # v4 client, dual-stack server
print(a, b, c, d)
"""


@pytest.fixture(scope="module")
def env():
    try:
        return loopback.loopback_env()
    except loopback.LoopbackUnavailable as e:
        pytest.fail(f"the loopback shim must build where the tests run: {e}")


def _run(env, *args):
    out = subprocess.run(
        [sys.executable, "-c", PROBE, *map(str, args)], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_wildcard_binds_land_on_loopback_and_v4_clients_still_reach_a_dual_stack_listener(env):
    assert _run(env) == ["127.0.0.1", "::ffff:127.0.0.1", "::1", "127.0.0.1"]


def test_an_allowed_port_keeps_its_wildcard(env):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    allowed = loopback.loopback_env(env, allow_any_ports=(port,))
    assert _run(allowed, port)[0] == "0.0.0.0"
    assert _run(env, port)[0] == "127.0.0.1"  # the same port, not allowed


def test_without_the_shim_the_wildcard_stays():
    plain = {k: v for k, v in loopback.loopback_env().items() if k not in ("LD_PRELOAD", "MC_TCP_BIND_ADDRESS")}
    assert _run(plain)[:3] == ["0.0.0.0", "::", "::"]


def test_the_env_advertises_loopback_and_keeps_other_preloads(tmp_path):
    env = loopback.loopback_env({"LD_PRELOAD": "/x/other.so", "PATH": "/bin"})
    assert env["MC_TCP_BIND_ADDRESS"] == "127.0.0.1"
    first, rest = env["LD_PRELOAD"].split(":")
    assert first.endswith(".so") and "loopback_bind-" in first and rest == "/x/other.so"
    again = loopback.loopback_env(env)  # idempotent: one shim in the list
    assert again["LD_PRELOAD"] == env["LD_PRELOAD"] and loopback.ALLOW_ENV not in again


def test_the_command_line_runs_a_command_under_the_shim(env):
    out = subprocess.run(
        [sys.executable, "-m", "cache.loopback", "--", sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["127.0.0.1", "::ffff:127.0.0.1", "::1", "127.0.0.1"]
