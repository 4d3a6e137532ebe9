"""`k3_slice` (Kimi-K3's layer shapes, 16 layers, 384 experts) under the production
layouts on 8 CPU devices: its TP8/EP8 prefill and DP8/EP8 decode compile, and every collective of
the compiled programs is the one `sharding.plan` predicts, byte for byte.  Only compiled (the
weights, 601 GB in bf16, are never allocated): the runs themselves need eight H200s.  One
period of four layers ([KDA x3, MLA], the first with the dense FFN) stands for the sixteen: the
plan and the programs are per layer.  The collectives are read from the program as lowered, before
XLA:CPU's own passes, which widen bf16 collectives to f32 on this backend (the GPU's NCCL moves
bf16); each program is also compiled for the 8 devices."""

import collections

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from kimik3 import config, model
from sharding import plan
from sharding.decode import PagedDecode
from sharding.mesh import MeshShape, decode_mesh, prefill_mesh
from sharding.prefill import ShardedPrefill
from sharding.rank_pools import pool_sharding
from sharding.rules import param_specs
from tests.sharding.conftest import hlo_bytes, hlo_collectives

CFG = config.k3_slice().replace(n_layers=4)


def _abstract(tree, specs, mesh):
    return jax.tree_util.tree_map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, s)), tree, specs
    )


def _planned_equals_compiled(hlo: str, shape: MeshShape, batch: int, seq: int):
    found = hlo_collectives(hlo)
    planned = plan.collectives(CFG, shape, batch, seq, "bfloat16", "dense")
    assert collections.Counter((c.kind, c.bytes, c.group) for c in planned) == collections.Counter(
        (k, hlo_bytes(k, s, g), g) for k, s, g in found
    )
    return found


def test_tp8_ep8_prefill_of_an_8k_prompt_issues_the_planned_collectives(devices):
    mesh = prefill_mesh(8, 8, devices=devices, cfg=CFG)
    sp = ShardedPrefill(CFG, mesh, dispatch="dense", kernels="reference")
    params = model.abstract_params(CFG, "bfloat16")
    params = _abstract(params, param_specs(params, sp.rules), mesh)
    tokens = jax.ShapeDtypeStruct((1, 8192), jnp.int32)
    lowered = sp._jitted.lower(params, tokens, None, None)
    lowered.compile()
    hlo = lowered.as_text(dialect="hlo")
    found = _planned_equals_compiled(hlo, MeshShape("prefill", 8, 8), 1, 8192)
    assert {k for k, _, _ in found} == {"all-gather", "reduce-scatter", "all-to-all"}


def test_dp8_ep8_decode_over_the_ranks_pools_issues_only_the_planned_all_to_alls(devices):
    """B64 per rank (512 rows) at 8k context: each rank's own pages and KDA slots, the pools
    split over the mesh; the MoE's all-to-alls are the step's only collectives."""
    mesh = decode_mesh(8, 8, devices=devices, cfg=CFG)
    step = PagedDecode(CFG, mesh, dispatch="dense", kernels="reference")
    per_rank, page, pages_each = 64, 128, 8192 // 128
    params = model.abstract_params(CFG, "bfloat16")
    params = _abstract(params, param_specs(params, step.rules), mesh)
    one = jax.eval_shape(lambda: model.init_paged_cache(CFG, per_rank * pages_each + 1, per_rank + 1, page))
    pools = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct((8 * x.shape[0], *x.shape[1:]), x.dtype, sharding=pool_sharding(mesh)), one
    )
    rows = 8 * per_rank
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
    lowered = step._jitted.lower(params, pools, i32(rows, 1), i32(rows, pages_each), i32(rows), i32(rows))
    lowered.compile()
    hlo = lowered.as_text(dialect="hlo")
    found = _planned_equals_compiled(hlo, MeshShape("decode", 8, 8), rows, 1)
    assert {k for k, _, _ in found} == {"all-to-all"}
