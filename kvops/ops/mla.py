"""MLA latent cache (DeepSeek-V2/V3's multi-head latent attention): ``kvops::mla_cache_write`` and
``kvops::mla_attention``.

The cache is ``[P, block_size, kv_lora_rank + rope_dim]``: per token one latent row ``[kv_c | k_pe]`` shared by every
query head (vLLM's ``concat_and_cache_mla`` layout, FlashMLA's ``kvcache`` with ``h_kv = 1``). Attention runs in the
absorbed form (DeepSeek-V2 §2.1.2's "absorb W_UK into W_Q and W_UV into W_O"; FlashMLA's ``flash_mla_with_kvcache``,
FlashInfer's ``BatchMLAPagedAttentionWrapper``): queries ``[T_q, H, kv_lora_rank + rope_dim]`` score against whole
latent rows, values are the rows' first ``kv_lora_rank`` columns. docs/mla.md.

Schemas: ``kvops/_library.py``. Validators: ``kvops/_checks/mla.py``. CPU kernels: ``kvops/cpu/mla.py``. fp64
oracle (tests): ``kvops/reference/mla.py``. CUDA kernels: ``kvops/triton/mla.py``. Inductor lowering of the write:
``lowering/inductor_mla.py``. A device's kernels are registered with :func:`register_kernels`, a module
with ``mla_cache_write`` and ``mla_attention`` taking the CPU kernels' arguments (validated; ``sm_scale`` resolved).
"""

from __future__ import annotations

import torch

from .. import _library  # noqa: F401  (defines the schemas)
from .._checks import values
from .._checks.common import int64_error
from .._checks.forms import python_float
from .._checks.mla import ATTN_OP, WRITE_OP, check_mla_attention, check_mla_cache_write, require_scale_tensor
from ..cpu import mla as cpu
from ..triton import HAS_TRITON


def _paged_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """The ``[P, block_size, 1, W]`` view the shared value checks read (a non-3-D cache: as is, their skip case)."""
    return kv_cache.unsqueeze(2) if kv_cache.dim() == 3 else kv_cache


def mla_cache_write(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    rotary_interleaved: bool = False,
) -> None:
    """Write each token's latent row ``[kv_c | k_pe]`` into a paged MLA cache at its slot, in place.

    vLLM's ``concat_and_cache_mla``: token ``i`` with slot ``x = slot_mapping[i]`` lands in block ``x // block_size``,
    row ``x % block_size``: columns ``[0, kv_lora_rank)`` get ``kv_c[i]``, ``[kv_lora_rank, W)`` get ``k_pe[i]``. A
    **negative slot is skipped** (padding). With ``positions``/``rotary_cos``/``rotary_sin``, ``k_pe`` is first rotated
    as ``kvops.rotary_paged_cache_write`` rotates a key (FlashAttention's ``rotary_cos``/``rotary_sin`` semantics:
    the first ``rotary_dim`` dims at ``positions[i]``, GPT-NeoX pairs or, with ``rotary_interleaved=True``, GPT-J
    pairs; fp32 math rounded once to ``k_pe``'s dtype, before fp8 quantization). DeepSeek-V3 checkpoints store their
    rope weights permuted for interleaved pairs (transformers' ``rope_interleave=True``).

    Args:
        kv_c: ``[N', kv_lora_rank]`` (rows ``>= N`` ignored): the compressed KV (after ``kv_a_layernorm``).
        k_pe: ``[N', rope_dim]``, ``kv_c``'s dtype: the rotary key part.
        kv_cache: ``[P, block_size, kv_lora_rank + rope_dim]`` (any strides), ``kv_c``'s dtype or
            ``float8_e4m3fn``; mutated in place, never copied.
        slot_mapping: ``[N]`` int32/int64, ``block * block_size + row`` or negative (skip).
        kv_scale: float32 scalar tensor (``[]`` or ``[1]``), required for (and only for) an fp8 cache, which stores
            ``x / kv_scale`` (fp32 division) saturated to ``±448``, rounded to nearest even (vLLM's convention).
        positions: ``[>= N]`` int32/int64 rotary positions in ``[0, seqlen_ro)`` (a value contract, docs/semantics.md
            §7, checked per the value-check mode before anything is written). rotary_cos, rotary_sin:
            ``[seqlen_ro, rotary_dim / 2]``, ``k_pe``'s dtype, ``rotary_dim <= rope_dim``. All three or none.
        rotary_interleaved: GPT-J pairs ``(2j, 2j + 1)`` (default: GPT-NeoX pairs ``(j, j + rotary_dim / 2)``).

    Raises:
        ValueError: ranks; ``block_size`` or width 0; ``kv_lora_rank + rope_dim`` not the cache's width; dtypes
            (``k_pe`` vs ``kv_c``, ``kv_c`` vs a non-fp8 cache); devices; ``slot_mapping`` not 1-D int32/int64 or
            longer than ``kv_c``/``k_pe``; an fp8 cache without ``kv_scale``, a scale for another cache, a scale not
            a float32 scalar tensor (a Python float included); rotary arguments given in part, tables not 2-D of one shape and ``k_pe``'s dtype,
            ``rotary_dim`` 0 or ``> rope_dim``, ``positions`` not 1-D int32/int64 with ``>= N`` entries; a cache
            with a stride-0 dim. Raised by the fake rule too (trace time under ``torch.compile``/``torch.export``).
        RuntimeError: a slot ``>= P * block_size`` or a position outside the tables (value contracts, default
            ``"eager"`` mode: eager calls, before anything is written; ``"async"``: ``torch._assert_async``, the
            whole batch skipped for a bad slot). The CPU kernel also refuses both (``IndexError``, nothing written)
            in every mode.

    Duplicate non-negative slots in one call: which token lands is unspecified. ``kv_c``/``k_pe`` may alias the
    cache: they are read before anything is written.
    """
    require_scale_tensor(WRITE_OP, kv_scale)  # before dispatch: the schema takes a Tensor
    try:  # value contracts, docs/semantics.md §7
        slot_mapping = values.check_paged_write(slot_mapping, _paged_view(kv_cache), "NHD", op=WRITE_OP)
        if positions is not None and rotary_cos is not None:
            values.check_rotary_positions(positions, slot_mapping.shape[0], rotary_cos, WRITE_OP)
    except RuntimeError:  # a metadata error explains it better: it goes first
        check_mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping, kv_scale, positions, rotary_cos, rotary_sin,
                              rotary_interleaved)
        raise
    torch.ops.kvops.mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping, kv_scale, positions, rotary_cos, rotary_sin,
                                    rotary_interleaved)


def mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_seqlen_q: int,
    kv_lora_rank: int,
    scale: float | None = None,
    causal: bool = True,
    kv_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA attention in the absorbed form over a paged latent cache: varlen decode and chunked prefill in one batch.

    Sequence ``b`` owns query rows ``[cu_seqlens_q[b], cu_seqlens_q[b+1])`` and latent rows ``[0, seq_lens[b])``,
    position ``j`` in block ``block_table[b, j // block_size]``, row ``j % block_size`` (``kvops.paged_attention``'s
    metadata). Every query head ``h`` scores ``q[t, h] · row_j`` over the whole row (``kv_lora_rank + rope_dim``) and
    reads ``row_j[:kv_lora_rank]`` as its value: FlashMLA's ``flash_mla_with_kvcache(q, kvcache, block_table,
    cache_seqlens, head_dim_v=kv_lora_rank, ...)``, one latent head (MQA).

    Args:
        q: ``[T_q, H, kv_lora_rank + rope_dim]`` float32/bfloat16/float16 (any strides): per head, the nope query
            absorbed through ``W_UK`` (``q_nope @ W_UK``, ``kv_lora_rank`` columns), then the rotated rope query.
        kv_cache: ``[P, block_size, kv_lora_rank + rope_dim]``, q's dtype or ``float8_e4m3fn`` (with ``kv_scale``).
        cu_seqlens_q: ``[B + 1]`` int32. seq_lens: ``[B]`` int32, each sequence's rows including its new ones.
        block_table: ``[B, max_blocks]`` int32; entries past ``ceil(seq_len / block_size)`` are never read.
        max_seqlen_q: ``>= max_b q_len`` (decode: 1).
        kv_lora_rank: the value columns (e.g. 512 for DeepSeek-V3); ``rope_dim = W - kv_lora_rank``.
        scale: softmax scale on ``q · row`` (default ``W ** -0.5``; DeepSeek passes ``(qk_nope_head_dim +
            qk_rope_head_dim) ** -0.5``, times its YaRN ``mscale ** 2`` where used).
        causal: bottom-right aligned: query ``i`` of a sequence sits at position ``seq_len - q_len + i`` and sees
            positions ``<=`` its own; ``False``: every query sees ``[0, seq_len)``.
        kv_scale: float32 scalar tensor for an fp8 cache (reads ``stored * kv_scale``); only then.

    Returns:
        ``(out [T_q, H, kv_lora_rank]`` in q's dtype (fp32 accumulation; multiply by ``W_UV`` then ``o_proj`` for
        the model's output), ``lse [H, T_q]`` float32 natural log)``, ``kvops.paged_attention``'s LSE layout. A query
        with no visible key (``seq_len == 0``, a causal position below 0, rows past ``cu_seqlens_q[-1]``) gets
        ``out = 0`` and ``lse = -inf``.

    Raises:
        ValueError: ranks; dtypes (q not fp32/bf16/fp16, a non-fp8 cache not q's dtype); q's last dim not the cache's
            width; ``kv_lora_rank`` outside ``[1, W]``; ``block_size`` or width 0; index tensors not int32 or of the
            wrong rank, or inconsistent in ``B``; devices; ``max_seqlen_q < 1`` with tokens; a NaN/infinite ``scale``;
            the fp8 ``kv_scale`` rule (a Python float ``kv_scale`` included). Raised by the fake rule too.
        RuntimeError: ``kvops.paged_attention``'s value contracts (docs/semantics.md §7) under this op's name:
            ``cu_seqlens_q`` not non-decreasing from 0 or past ``T_q``, a ``q_len > max_seqlen_q``, ``seq_lens[b]``
            outside ``[0, max_blocks * block_size]``, a used ``block_table`` entry outside ``[0, P)``.
    """
    bad = int64_error(ATTN_OP, {"max_seqlen_q": max_seqlen_q, "kv_lora_rank": kv_lora_rank})
    if bad is not None:
        raise bad
    require_scale_tensor(ATTN_OP, kv_scale)  # before dispatch: the schema takes a Tensor
    scale = python_float(ATTN_OP, "scale", scale)  # a NumPy scalar: a float
    try:  # value contracts, docs/semantics.md §7
        values.check_paged_attention(q, _paged_view(kv_cache), cu_seqlens_q, seq_lens, block_table, max_seqlen_q,
                                     "NHD", op=ATTN_OP)
    except RuntimeError:  # a metadata error explains the bad values: it goes first
        check_mla_attention(q, kv_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, kv_lora_rank, scale,
                            causal, kv_scale)
        raise
    return torch.ops.kvops.mla_attention(q, kv_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, kv_lora_rank,
                                         scale, causal, kv_scale)


# --- fake rules: the contracts at trace time -------------------------------------------------------------------
@torch.library.register_fake("kvops::mla_cache_write")
def _mla_cache_write_fake(kv_c, k_pe, kv_cache, slot_mapping, kv_scale=None, positions=None, rotary_cos=None,
                          rotary_sin=None, rotary_interleaved=False):
    check_mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping, kv_scale, positions, rotary_cos, rotary_sin,
                          rotary_interleaved)


@torch.library.register_fake("kvops::mla_attention")
def _mla_attention_fake(q, kv_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, kv_lora_rank, scale=None,
                        causal=True, kv_scale=None):
    check_mla_attention(q, kv_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, kv_lora_rank, scale, causal,
                        kv_scale)
    t_q, num_heads = q.shape[0], q.shape[1]
    return q.new_empty((t_q, num_heads, kv_lora_rank)), q.new_empty((num_heads, t_q), dtype=torch.float32)


# --- kernels ----------------------------------------------------------------------------------------------------
def register_kernels(device: str, kernels) -> None:
    """Register ``kernels.mla_cache_write`` / ``kernels.mla_attention`` (``kvops/cpu/mla.py``'s signatures) for
    ``device``, behind the validators."""

    @torch.library.impl("kvops::mla_cache_write", device)
    def _write(kv_c, k_pe, kv_cache, slot_mapping, kv_scale=None, positions=None, rotary_cos=None, rotary_sin=None,
               rotary_interleaved=False):
        check_mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping, kv_scale, positions, rotary_cos, rotary_sin,
                              rotary_interleaved)
        kernels.mla_cache_write(kv_c, k_pe, kv_cache, slot_mapping, kv_scale, positions, rotary_cos, rotary_sin,
                                rotary_interleaved)

    @torch.library.impl("kvops::mla_attention", device)
    def _attention(q, kv_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, kv_lora_rank, scale=None,
                   causal=True, kv_scale=None):
        sm_scale = check_mla_attention(q, kv_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, kv_lora_rank,
                                       scale, causal, kv_scale)
        return kernels.mla_attention(q, kv_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, kv_lora_rank,
                                     sm_scale, causal, kv_scale)


register_kernels("CPU", cpu)
if HAS_TRITON:  # CUDA: kvops/triton/mla.py (docs/gpu.md, "MLA kernels")
    from ..triton import mla as _triton_mla

    register_kernels("CUDA", _triton_mla)
