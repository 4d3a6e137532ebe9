"""Kimi Delta Attention (KDA) kernels, as fla lays out a kernel family (`fla.ops.kda`):

- `naive`: the references, the math once in pure jnp (`kda_recurrent_ref`, the token loop;
  `kda_chunked_ref`, the chunked WY / UT form the kernels implement).
- `chunk`: `chunk_kda`, the chunked prefill (varlen, states exported at given positions in the
  same pass); its prepare kernels in `prepare`, what they share in `common`.
- `fused_recurrent`: `fused_recurrent_kda`, decode and speculative verify on a state pool, in place.
- `replay`: `chunk_kda_replay`, the align / partial replay baselines (for comparison only).

Every name callers use is importable from here.
"""

from pallas_kernels.kda.chunk import (
    PREPARE_IMPLS,
    TUNING,
    _chunk_kda_core,
    _chunk_prepare_call,
    _chunk_state_call,
    _loop_chunks,
    _plan_layout,
    _split_intra_call,
    _split_solve_call,
    _state_block_v,
    _tuned,
    chunk_kda,
)
from pallas_kernels.kda.common import CHUNK, SUB, _default_interpret
from pallas_kernels.kda.fused_recurrent import _fused_recurrent_core, fused_recurrent_kda
from pallas_kernels.kda.naive import (
    HIGHEST,
    export_mask,
    kda_chunk_prepare,
    kda_chunk_step,
    kda_chunked_ref,
    kda_recurrent_ref,
    kda_step,
    pad_to_chunks,
)
from pallas_kernels.kda.replay import chunk_kda_replay

__all__ = [
    "CHUNK",
    "HIGHEST",
    "PREPARE_IMPLS",
    "SUB",
    "TUNING",
    "chunk_kda",
    "chunk_kda_replay",
    "export_mask",
    "fused_recurrent_kda",
    "kda_chunk_prepare",
    "kda_chunk_step",
    "kda_chunked_ref",
    "kda_recurrent_ref",
    "kda_step",
    "pad_to_chunks",
]
