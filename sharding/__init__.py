"""Meshes, logical-axis sharding rules, and the sharded prefill/decode layers.

README
======

Production layout: prefill runs the hybrid attention tensor-parallel over heads,
the MoE expert-parallel, and keeps the residual stream sequence-parallel between
them; decode runs attention data-parallel over requests (each rank owns its
requests' MLA latent rows and KDA state, nothing replicated) with the same
expert-parallel MoE.

* `sharding.rules`: logical axes (batch, seq, heads, experts, embed, latent, ...)
  per param (`PARAM_AXES`, by name) and cache leaf (`CACHE_AXES`), and the two
  tables `PREFILL_RULES` / `DECODE_RULES` mapping them to the mesh axes
  ``(replica, expert)``; `shard_params` / `shard_cache` place trees by them.
* `sharding.mesh`: `prefill_mesh(tp, ep)` and `decode_mesh(dp, ep)` over any
  device list; ``ep`` divides ``tp`` (``dp``), experts are copied over the
  ``tp / ep`` replica groups.  Errors name the axis (``tp=4 does not divide
  kda_heads=2``, ``dp=4 needs exactly 4 devices; got 8``).
* `sharding.prefill.ShardedPrefill`: one `jax.shard_map` over the whole model.
  Per layer: RMSNorm on the token shard -> all-gather of the sequence -> KDA or
  MLA on the rank's heads (the model's own Flax modules applied to the head
  shard) -> reduce-scatter (`psum_scatter`) of the o_proj partial sums over
  tokens -> residual -> RMSNorm -> dense MLP or the expert-parallel LatentMoE.
* `sharding.decode.ShardedDecode`: the same layer loop with attention on each
  rank's own requests and no collective outside the MoE.
* `sharding.layers.moe_ep`: route (fp32, all experts) -> down-project -> all-to-all
  dispatch to the ranks holding the chosen experts -> grouped expert GEMMs ->
  all-to-all back -> weighted combine -> LatentMoE's RMSNorm on the complete
  routed sum -> up-project; shared experts on full width.  Dispatch "ragged"
  (`ragged_all_to_all`, GPU) or "dense" (fixed-capacity `all_to_all` of
  ``[ep, tokens * top_k, L]`` buffers, nothing dropped; CPU, where XLA has no
  ragged all-to-all); "auto" picks by backend.
* `sharding.decode.PagedDecode` with `sharding.rank_pools`: DP decode as the serving
  engine runs it (`serving.Engine(mesh=(prefill_mesh | None, decode_mesh))`): each rank
  owns its requests' pages, KDA slots and snapshots on its own device; the ranks' pools
  are viewed as one array split over the mesh (no copy) and each rank's step reads and
  writes its own shard in place.  No collective but the MoE all-to-alls.
* `sharding.paged.PagedStep`: a sharded prefill step over one rank's paged pools: gather
  the request's latent pages and KDA slot into the contiguous cache, run on the prefill
  mesh, write the new latent rows into its pages and the KDA rows into its slot (device
  to device: the KV lands on the rank that decodes it).
* `sharding.plan`: ``kimik3 plan --config kimi_k3 --prefill tp8,ep8 --decode
  dp16,ep16``: weights per rank by quantization format, KV / KDA state per
  request, buffers, and every collective per layer with its bytes (the same
  `collectives` function the tests check against the compiled HLO).
* `sharding.bench`: on a multi-GPU machine, ragged vs dense exactness and
  1-GPU vs n-GPU throughput of the `small` model.

P/D across meshes: prefill on one mesh, then ``ShardedDecode.place_cache(cache)``
reshards the (heads-split) prefill cache to the (requests-split) decode mesh.

```python
from sharding.mesh import prefill_mesh, decode_mesh
from sharding.prefill import ShardedPrefill
from sharding.decode import ShardedDecode

pre = ShardedPrefill(cfg, prefill_mesh(4, 2, jax.devices()[:4], cfg=cfg))
logits, cache = pre(pre.place_params(params), prompts, pre.place_cache(model.init_cache(cfg, B, 4096)))
dec = ShardedDecode(cfg, decode_mesh(4, 4, jax.devices()[4:], cfg=cfg))
cache, p = dec.place_cache(cache), dec.place_params(params)
logits, cache = dec(p, next_tokens, cache)
```

The serving engine on meshes (a P/D pair, each pool on its own mesh):

```python
from serving.disagg import DisaggregatedServer
from serving.engine import Engine

pre = Engine(params, cfg, role="prefill", num_pages=4096, mesh=prefill_mesh(2, 2, jax.devices()[:2], cfg=cfg))
dec = Engine(params, cfg, role="decode", num_pages=4096, mesh=decode_mesh(4, 2, jax.devices()[2:6], cfg=cfg))
server = DisaggregatedServer(pre, dec, "direct")
# colocated: Engine(params, cfg, num_pages=4096, mesh=(prefill_mesh(...), decode_mesh(...)))
```

Tests (tests/sharding, 8 CPU devices via ``jax_num_cpu_devices``) check the
sharded model against `kimik3.model.forward` in fp32 and the greedy tokens
against the oracle.
"""
