"""Fixtures of the sharding tests: 8 CPU devices (tests/conftest.py asks for them), a tiny
config with 8 heads so tp can reach 8, and the HLO collective parser."""

import re

import jax
import numpy as np
import pytest

from kimik3 import model

N_DEVICES = 8


@pytest.fixture(scope="session")
def devices():
    devs = jax.devices()
    assert len(devs) >= N_DEVICES, (
        f"sharding tests need {N_DEVICES} devices, found {len(devs)}: tests/conftest.py must call "
        f'jax.config.update("jax_num_cpu_devices", {N_DEVICES}) before any backend starts'
    )
    return devs[:N_DEVICES]


@pytest.fixture(scope="session")
def tiny8_cfg(tiny_cfg):
    """The tiny config with 8 KDA and 8 MLA heads (head dims halved), so tp in {2, 4, 8} divides it."""
    return tiny_cfg.replace(
        kda_heads=8, kda_head_dim=8, mla_heads=8, qk_nope_dim=8, qk_rope_dim=8, v_head_dim=8, vit=None
    )


def host_init(cfg, seed: int):
    """Params of `cfg` drawn on the host (fan-in normals, norm scales 1 + 0.1 N, A_log = log U(1, 16),
    dt_bias and biases 0.1 N, a small non-zero router bias): no init compile, which on a busy
    2-core machine costs more than the tests themselves."""
    rng = np.random.default_rng(seed)

    def leaf(path, x):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        # norm scales and biases drawn around the identity (as tests/conftest.py's fixtures)
        if re.search(r"(norm|scale|norm_l|norm_v)$", name):
            return (1.0 + 0.1 * rng.standard_normal(x.shape)).astype(np.float32)
        if name.endswith("a_log_h"):
            return np.log(rng.uniform(1.0, 16.0, x.shape)).astype(np.float32)
        if name.endswith("dt_bias_hk") or name.endswith("/bias"):
            return (0.1 * rng.standard_normal(x.shape)).astype(np.float32)
        if name.endswith("router_bias_e"):
            return (0.1 * rng.standard_normal(x.shape)).astype(np.float32)
        if name == "embed_vd":
            return rng.standard_normal(x.shape).astype(np.float32)
        fan_in = x.shape[0] if not name.endswith("_hvd") else x.shape[0] * x.shape[1]
        return (rng.standard_normal(x.shape) / np.sqrt(fan_in)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(leaf, model.abstract_params(cfg, "float32"))


@pytest.fixture(scope="session")
def tiny8_params(tiny8_cfg):
    return host_init(tiny8_cfg, seed=1)


@pytest.fixture(scope="session")
def kl8_cfg(tiny8_cfg):
    """tiny8 as Kimi-Linear (`kimik3.config.kimi_linear`'s switches: the unbounded gate, no MLA
    output gate or q-LoRA, SwiGLU experts at d_model) with MLA at 1-based 2 and 4, two dense layers."""
    return tiny8_cfg.replace(
        name="kl8",
        q_lora_rank=0,
        moe_latent_dim=tiny8_cfg.d_model,
        mixer_layout=("kda", "mla", "kda", "mla"),
        dense_layers=2,
        kda_gate="softplus",
        mla_output_gate=False,
        moe_latent=False,
        ffn_activation="silu",
        norm_eps=1e-5,
        mla_norm_eps=1e-6,
        kda_norm_eps=1e-5,
    )


@pytest.fixture(scope="session")
def kl8_params(kl8_cfg):
    return host_init(kl8_cfg, seed=2)


HLO_ITEMSIZE = {"f32": 4, "s32": 4, "bf16": 2, "f16": 2, "u32": 4, "pred": 1, "s8": 1, "u8": 1}
_COLLECTIVE = re.compile(
    r"=\s*(?P<shape>\(.*?\)|\w+\[[\d,]*\](?:\{[^}]*\})?)\s+"
    r"(?P<kind>all-gather|reduce-scatter|all-to-all|all-reduce|collective-permute|"
    r"ragged-all-to-all)(?:-start)?\("
)
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_GROUP = re.compile(r"replica_groups=mesh\[(?P<sizes>[^\]]*)\]\s*\{(?P<axes>[^}]*)\}")


def hlo_collectives(hlo_text: str):
    """(kind, result shapes, group size) of every collective in compiled HLO text."""
    out = []
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        shapes = [(dt, tuple(int(s) for s in dims.split(",") if s)) for dt, dims in _ARRAY.findall(m["shape"])]
        g = _GROUP.search(line)
        group = None
        if g:
            sizes = dict((k.strip("' "), int(v)) for k, v in (kv.split("=") for kv in g["sizes"].split(",")))
            group = int(np.prod([sizes[a.strip("' ")] for a in g["axes"].split(",")]))
        out.append((m["kind"], shapes, group))
    return out


def hlo_bytes(kind: str, shapes, group: int) -> int:
    """A collective's full-buffer bytes (sharding.plan's convention): the output of an all-gather or an
    all-to-all (all tuple parts), the input (= output x group) of a reduce-scatter."""
    total = sum(int(np.prod(dims)) * HLO_ITEMSIZE[dt] for dt, dims in shapes)
    return total * group if kind == "reduce-scatter" else total
