"""Every kvops schema string, in one place.

Mutation annotations are honest: a cache an op writes is declared ``Tensor(a!)``, and nothing else is mutated.
Token positions and counts are ``SymInt`` so a loop whose positions change every step does not recompile per step;
sizes that define kernels (head counts, ``head_dim``, ``block_size``) come from tensor shapes and may specialize.

The fake rules, CPU kernels and CUDA kernels are registered next to each op's public wrapper in ``kvops/ops/``; the
C++ sources (``kvops/native/*.cpp``) register kernels only (``TORCH_LIBRARY_IMPL``), never a schema. An op whose
schema torch infers (a ``torch.library.triton_op``) is written here as a module constant named after the op in capitals
(``PAGED_ATTENTION = "(...) -> ..."``). tests/project/test_schemas.py checks every op of the ``kvops`` namespace against this
file: none may be missing, and each must read as written here.
"""

import torch

lib = torch.library.Library("kvops", "DEF")

# --- contiguous caches [B, S, H_cache, D] (kvops/ops/contiguous.py) ---------------------------------------------
lib.define(
    "cache_write(Tensor key, Tensor? value, Tensor(a!) k_cache, Tensor(b!)? v_cache, SymInt start, "
    "int? cache_head_start=None) -> ()"
)
lib.define(
    "cache_roll(Tensor(a!) k_cache, Tensor(b!)? v_cache, SymInt src, SymInt dst, SymInt num_tokens, "
    "int? cache_head_start=None, int? num_heads=None) -> ()"
)

# --- paged caches [P, block_size, H_kv, D] (kvops/ops/paged_write.py, kvops/ops/paged_attention.py) -------------
lib.define(
    "paged_cache_write(Tensor key, Tensor? value, Tensor(a!) k_cache, Tensor(b!)? v_cache, Tensor slot_mapping, "
    "int? cache_head_start=None, Tensor? k_scale=None, Tensor? v_scale=None, str kv_layout=\"NHD\") -> ()"
)
# kv_layout (both paged ops): "NHD" caches [P, block_size, H_kv, D] | "HND" caches [P, H_kv, block_size, D] (FlashInfer)
# kvops::paged_attention is a torch.library.triton_op (kvops/ops/paged_attention.py), so torch.compile on CUDA sees
# its Triton kernels; triton_op infers its schema from the function's annotations (it ignores a schema string), and
# this is that schema, kept equal by tests/paged/test_attention_features.py. The arguments after kv_layout are the fields
# of AttnFeatures (kvops/_checks/features.py), in order.
PAGED_ATTENTION = (
    "(Tensor q, Tensor k_cache, Tensor? v_cache, Tensor cu_seqlens_q, Tensor seq_lens, Tensor block_table, "
    "SymInt max_seqlen_q, float? scale=None, bool causal=True, SymInt window_left=-1, float softcap=0., "
    "Tensor? sinks=None, Tensor? k_scale=None, Tensor? v_scale=None, str kv_layout=\"NHD\", "
    "Tensor? alibi_slopes=None, SymInt window_right=-1, Tensor? cache_leftpad=None, SymInt sink_tokens=0, "
    "float? rope_theta=None, float rope_scale=1., Tensor? custom_mask=None, Tensor? packed_custom_mask=None) "
    "-> (Tensor, Tensor)"
)
# Its CPU kernel kvops::_paged_attention_native (kvops/native/paged_attention.cpp; the composite kvops/cpu kernel as
# its CompositeExplicitAutograd fallback, kvops/native/__init__.py): validated, NHD, the resolved scale; the same
# AttnFeatures fields after v_scale. Defined here at import, not by the build, so graphs that call it load in any
# process that imports kvops.
lib.define(
    "_paged_attention_native(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cu_seqlens_q, Tensor seq_lens, "
    "Tensor block_table, SymInt max_seqlen_q, float scale, bool causal, SymInt window_left, float softcap, "
    "Tensor? sinks, Tensor? k_scale, Tensor? v_scale, Tensor? alibi_slopes=None, SymInt window_right=-1, "
    "Tensor? cache_leftpad=None, SymInt sink_tokens=0, float? rope_theta=None, float rope_scale=1.0, "
    "Tensor? custom_mask=None, Tensor? packed_custom_mask=None) -> (Tensor, Tensor)"
)
# The one-pass value-contract check of eager CPU calls (kvops/_checks/values_attention.py; kernel in
# paged_attention.cpp, only called where the native build is available): True when a contract fails.
lib.define(
    "_paged_attention_values_bad(Tensor cu_seqlens_q, Tensor seq_lens, Tensor block_table, int num_tokens, "
    "int max_seqlen_q, int num_blocks, int block_size, int window_left=-1, int sink_tokens=0, "
    "Tensor? cache_leftpad=None) -> bool"
)

# --- prefill->decode KV transfer staging (kvops/ops/transfer.py; docs/semantics.md §6) -------------------------
# caches: the K caches of all layers, then their V caches (2 * L tensors [P, block_size, H_kv, D]);
# staging: [2, L, num_tokens, num_heads, D], contiguous (K layers then V layers).
lib.define(
    "paged_kv_gather(Tensor[] caches, Tensor block_table, Tensor(a!) staging, SymInt start, "
    "int cache_head_start) -> ()"
)
lib.define(
    "paged_kv_scatter(Tensor staging, Tensor(a!)[] caches, Tensor block_table, SymInt start, "
    "int cache_head_start) -> ()"
)

# --- packed (quantized) K/V (kvops/ops/packed.py; layouts: kvops.packed.packed_layout) ---------------------------
lib.define(
    "quantize_kv(Tensor x, Tensor(a!) codes, Tensor(b!) scales, Tensor(c!)? zeros, Tensor(d!)? centroids, "
    "Tensor(e!)? cluster_ids, str quant, int kmeans_iters=4) -> ()"
)
lib.define(
    "dequantize_kv(Tensor codes, Tensor scales, Tensor? zeros, Tensor? centroids, Tensor? cluster_ids, str quant, "
    "ScalarType dtype) -> Tensor"
)

# --- rotary embedding fused into the paged write (kvops/ops/rotary.py) ------------------------------------------
lib.define(
    "rotary_paged_cache_write(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
    "Tensor positions, Tensor rotary_cos, Tensor rotary_sin, bool rotary_interleaved=False, "
    "int? cache_head_start=None, Tensor? k_scale=None, Tensor? v_scale=None) -> ()"
)

# --- the streaming step's position contract (kvops/export/streaming.py) ------------------------------------------
# state: int64 [9] (current_chunk_start, global_end, local_end, write row, roll src, roll count, and three margins
# that are >= 0 when the step is valid); returns a copy after raising the contract's RuntimeError when one is < 0
# (the kernel reads the values on the host; Inductor lowers the op to device-side asserts, lowering/inductor_checks.py).
lib.define("stream_positions(Tensor state, int sink_tokens, int kv_cache_size) -> Tensor")

# --- attention over a packed window (kvops/ops/packed_attention.py; docs/semantics.md §2) -----------------------
# q [B, T, H_q, D]; k_dense/v_dense: dense segments [B, n_i, H_kv, D] / [B, n_i, H_kv, D_v]; k_packed/v_packed: the
# stored tensors of every packed segment in kvops.packed.packed_layout's order (codes, scales[, zeros[, centroids,
# cluster_ids]]: 2 per segment for int8/fp8, 3 for int4, 5 for int2), segments one after another; quant: their format
# (None when there are none); row_counts: None or int32 [total rows] (dense segments' rows, then packed ones'), how
# often each row is attended (0: skipped; PackedCausalKVCache.update's visible-row mask). Returns (out [B, T, H_q, D_v]
# in q's dtype, lse [B, H_q, T] fp32).
lib.define(
    "packed_attention(Tensor q, Tensor[] k_dense, Tensor[] v_dense, Tensor[] k_packed, Tensor[] v_packed, "
    "str? quant=None, float? scale=None, Tensor? row_counts=None) -> (Tensor, Tensor)"
)

# --- MLA latent cache [P, block_size, kv_lora_rank + rope_dim] (kvops/ops/mla.py; docs/mla.md) -----------------
# One latent "head" per token (DeepSeek-V2/V3): the compressed kv_c [T, kv_lora_rank] then k_pe [T, rope_dim].
# kv_scale: float32 per-tensor scale of a float8_e4m3fn cache (stores x / kv_scale, reads stored * kv_scale).
# mla_attention returns (out [T_q, H, kv_lora_rank] in q's dtype, lse [H, T_q] float32).
lib.define(
    "mla_cache_write(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor slot_mapping, Tensor? kv_scale=None, "
    "Tensor? positions=None, Tensor? rotary_cos=None, Tensor? rotary_sin=None, bool rotary_interleaved=False) -> ()"
)
lib.define(
    "mla_attention(Tensor q, Tensor kv_cache, Tensor cu_seqlens_q, Tensor seq_lens, Tensor block_table, "
    "SymInt max_seqlen_q, int kv_lora_rank, float? scale=None, bool causal=True, Tensor? kv_scale=None) "
    "-> (Tensor out, Tensor lse)"
)

# --- native CPU kernels' private ops (kvops/native/*.cpp register their CPU kernels when the build loads) -----------
# Called only inside the CPU kernels of the public ops, after kvops.native.available() said the build is loaded.
# _paged_write_native: kvops::paged_cache_write's CPU kernel on validated NHD caches (h0: the first cache head
# written); returns the index of the first slot that is out of range (nothing written then), or -1.
lib.define(
    "_paged_write_native(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
    "int h0, Tensor? k_scale, Tensor? v_scale) -> int"
)
# _packed_attention_native: kvops::packed_attention's CPU kernel on validated arguments (quant "" when no segment is
# packed, the resolved scale).
lib.define(
    "_packed_attention_native(Tensor q, Tensor[] k_dense, Tensor[] v_dense, Tensor[] k_packed, Tensor[] v_packed, "
    "str quant, float scale, Tensor? row_counts) -> (Tensor, Tensor)"
)

# --- functional (non-mutating) variants of the writes (kernels: kvops/export/functional.py) -------------------------
# The arguments of their mutating op without its (a!) annotations (tests/project/test_schemas.py keeps them equal); they
# return copies (new_k_cache, new_v_cache) of the caches with the write applied. Used by the ONNX export and the
# TensorRT converters (lowering/onnx.py, lowering/tensorrt.py).
lib.define(
    "cache_write_functional(Tensor key, Tensor? value, Tensor k_cache, Tensor? v_cache, SymInt start, "
    "int? cache_head_start=None) -> (Tensor, Tensor)"
)
lib.define(
    "cache_roll_functional(Tensor k_cache, Tensor? v_cache, SymInt src, SymInt dst, SymInt num_tokens, "
    "int? cache_head_start=None, int? num_heads=None) -> (Tensor, Tensor)"
)
lib.define(
    "paged_cache_write_functional(Tensor key, Tensor? value, Tensor k_cache, Tensor? v_cache, Tensor slot_mapping, "
    "int? cache_head_start=None, Tensor? k_scale=None, Tensor? v_scale=None, str kv_layout=\"NHD\") -> "
    "(Tensor, Tensor)"
)

# --- merging attention states over disjoint key sets (kvops/ops/merge.py; docs/cascade.md, docs/semantics.md §12) --
# A part: out [T, H, D_v] (float32/bfloat16/float16) and lse [H, T] float32, natural log (kvops.paged_attention's
# return_lse layout); the many-way form stacks N >= 1 parts: outs [N, T, H, D_v], lses [N, H, T]. Pure: returns
# (out [T, H, D_v] in the parts' dtype, lse [H, T] float32) and mutates nothing.
lib.define("merge_attention_states(Tensor o_a, Tensor lse_a, Tensor o_b, Tensor lse_b) -> (Tensor, Tensor)")
lib.define("merge_attention_states_many(Tensor outs, Tensor lses) -> (Tensor, Tensor)")
