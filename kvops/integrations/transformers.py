"""Hugging Face transformers integration: ``attn_implementation="kvops"`` and Cache classes on kvops' caches.

Usage (the three lines)::

    import kvops.integrations.transformers as kvops_hf              # registers "kvops" with transformers
    model.set_attn_implementation("kvops")                           # or attn_implementation="kvops" at load
    out = model.generate(**inputs, past_key_values=kvops_hf.KvopsStaticCache(model.config, max_cache_len=256))

How it plugs in (docs/semantics.md §10; transformers' own interfaces, no monkey-patching, no module-level state):

- :func:`kvops_attention_forward` is registered in ``AttentionInterface`` under ``"kvops"``; every attention call is
  one ``kvops.paged_attention`` (GQA without repeating K/V, causal, sliding window, softcap, attention sinks).
- :func:`kvops_mask` is registered in ``AttentionMaskInterface`` under the same name, so the "mask" transformers hands
  the attention function is per-sequence metadata instead of a ``[B, 1, T, S]`` tensor: an int32 tensor of
  (``start``, ``length``) — the first visible key row in the K/V the cache returns (after left padding) and the number
  of key rows from there up to the last query. It is computed on the device from what transformers passes every mask
  function (2-D padding mask, ``q_offset``, ``kv_offset``), so it travels with the call. It is 4-D (``[2, B, 1, 1]``)
  because transformers passes 4-D masks through unchanged (``generate()`` prepares masks before the forward).
- The K/V the cache returns are read in place through a ``block_size = 1`` view (``[P, 1, H_kv, D]``, an
  ``as_strided`` view of the cache's storage, no copy) and a per-step token table ``[B, S]`` int32, so left padding
  and sliding-window offsets are just a shifted table.
- Paged caches (:class:`KvopsPagedCache`): transformers hands an attention function neither the cache nor unknown
  ``generate()`` kwargs (``_validate_model_kwargs`` rejects them), so the block table travels with what the cache
  returns: the layer's ``update`` returns ``(kv, block_table)`` -- its joint K/V storage ``[P, block_size, 2, H_kv,
  D]`` (5-D, so any other attention function fails loudly instead of misreading it) and the ``[B, max_blocks]``
  int32 block table in the "value" slot.

Supported masks: causal and sliding-window causal masks with (left) padding, as ``generate()`` builds them, and
packed sequences (several sequences in one row, ``position_ids`` restarting at 0, no mask, no cache: each query sees
its own sequence only, a range per query). Any other mask function transformers passes (bidirectional, chunked,
blockwise, overlays) is evaluated eagerly and raises ``ValueError`` unless every query sees one contiguous range
ending at itself; custom 4-D masks raise. ``output_attentions=True`` logs a warning (no maps), as sdpa does.

Continuous batching (``generate_batch``): transformers 5.23's ``ContinuousBatchingManager.switch_to_cb_friendly_attn``
accepts only ``"paged|eager"``, ``"sdpa"`` or a flash implementation and raises ``ValueError`` for any other name, so a
custom attention function cannot be plugged into its ``PagedAttentionCache``; it is not supported.

Tested versions: see the ``transformers`` extra in ``pyproject.toml``.
"""

from __future__ import annotations

import importlib

import torch

from .._extras import require

require("transformers", "kvops.integrations.transformers", "transformers")

from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function  # noqa: E402
from transformers.utils import logging  # noqa: E402

import kvops

_pa = importlib.import_module("kvops.ops.paged_attention")  # the op's module (_direct, _implementation)

from ._hf_cache import KvopsPagedCache, KvopsPagedLayer, KvopsSlidingLayer, KvopsStaticCache, KvopsStaticLayer
from ._hf_checks import check_asked_depth, check_padding
from ._hf_export import ExportableDecodeStep


def _native_out(*args):
    """The output of kvops::_paged_attention_native's CPU kernel (arguments as the op takes them, without features)
    as an eager call on ``_direct``'s terms runs it: without the dispatcher, and no LSE tensor
    (``kvops.native.eager_entry``), where the build has it."""
    if kvops.native.eager_entry is not None:
        return kvops.native.eager_entry(*args, False)
    return torch.ops.kvops._paged_attention_native.default(*args)[0]


NAME = "kvops"
logger = logging.get_logger(__name__)

__all__ = [
    "NAME",
    "kvops_attention_forward",
    "kvops_mask",
    "KvopsStaticCache",
    "KvopsStaticLayer",
    "KvopsSlidingLayer",
    "KvopsPagedCache",
    "KvopsPagedLayer",
    "ExportableDecodeStep",
]


def _closure(fn, name: str):
    """Free variable ``name`` of a transformers mask-function closure."""
    return fn.__closure__[fn.__code__.co_freevars.index(name)].cell_contents


def _parts(fn) -> tuple:
    """The mask functions intersected by ``fn`` (``masking_utils.and_masks``), or ``(fn,)``."""
    if getattr(fn, "__qualname__", "") == "and_masks.<locals>.and_mask":
        return tuple(f for part in _closure(fn, "mask_functions") for f in _parts(part))
    return (fn,)


_CAUSAL_PARTS = ("causal_mask_function", "sliding_window_overlay.<locals>.inner_mask")


def _mask_kind(mask_function) -> tuple[str, torch.Tensor | None]:
    """``("causal", None)`` for transformers' causal / sliding-window causal masks (the window is the attention
    module's ``sliding_window``), ``("packed", segment_ids [B, T])`` for the packed-sequence form of those, else
    ``("other", None)``."""
    if mask_function is None:
        return "causal", None
    parts = _parts(mask_function)
    names = [getattr(f, "__qualname__", "") for f in parts]
    if all(n in _CAUSAL_PARTS for n in names) and _CAUSAL_PARTS[0] in names:
        return "causal", None
    if len(parts) == 2 and names == ["packed_sequence_mask_function.<locals>.inner_mask",
                                     "remap_positions_for_packed_sequence.<locals>.inner_mask"]:
        if _mask_kind(_closure(parts[1], "mask_function"))[0] == "causal":
            return "packed", _closure(parts[0], "packed_sequence_mask")
    return "other", None


_NOT_REPRESENTABLE = (
    "kvops attention: the mask function transformers passed (e.g. bidirectional, chunked or blockwise attention, or "
    "an or/and_mask_function overlay) lets some query see keys that are not one contiguous range ending at its own "
    "position; kvops attention supports causal and sliding-window causal masks with padding and packed sequences. "
    "Use attn_implementation='sdpa' or 'eager' for this model."
)


def _per_query_ranges(mask_function, batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask,
                      device) -> torch.Tensor:
    """Any other mask function, evaluated on the ``[B, T, S]`` grid and turned into per-query (``start``,
    ``length``); every query must see one contiguous range of rows ending at its own row: else ``ValueError``
    (eager) or a ``torch._assert_async`` failure (``RuntimeError`` on CPU) in compiled and exported graphs."""
    b = torch.arange(batch_size, device=device)[:, None, None, None]
    q = (torch.arange(q_length, device=device) + q_offset)[None, None, :, None]
    kv = (torch.arange(kv_length, device=device) + kv_offset)[None, None, None, :]
    allowed = mask_function(b, torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device), q, kv)
    allowed = allowed.expand(batch_size, 1, q_length, kv_length)[:, 0]
    if attention_mask is not None:  # padding, read at the returned rows' positions (False past the mask's end)
        pad = attention_mask.to(device).bool()
        cols = kv[0, 0]  # [1, S]
        real = pad.gather(1, cols.clamp(0, pad.shape[-1] - 1).expand(batch_size, -1)) & (cols < pad.shape[-1])
        allowed = allowed & real[:, None, :]
    length = allowed.sum(-1)
    start = torch.where(length > 0, allowed.int().argmax(-1), 0)
    rows = torch.arange(kv_length, device=device)
    ranges = (rows >= start[..., None]) & (rows < (start + length)[..., None])
    ok = (ranges == allowed).all() & ((length == 0) | (start + length - 1 == q[0, 0, :, 0] - kv_offset)).all()
    if torch.compiler.is_compiling():
        torch._assert_async(ok, _NOT_REPRESENTABLE)
    elif not ok:
        raise ValueError(_NOT_REPRESENTABLE)
    return torch.stack([start, length]).to(torch.int32).view(2, batch_size, q_length, 1)


def kvops_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
               attention_mask: torch.Tensor | None = None, device: torch.device | str = "cpu",
               **kwargs) -> torch.Tensor:
    """Mask function registered as ``"kvops"``: the visible key range (``start``, ``length``) of each sequence, or of
    each query.

    Args (as transformers passes them to every mask function, ``masking_utils.create_causal_mask``):
        batch_size: ``B``. q_length: ``T`` new tokens. kv_length: rows of the K/V the cache will return.
        q_offset: global position of the first query (int, SymInt or 0-d tensor).
        kv_offset: global position of the first returned K/V row (int, SymInt or 0-d tensor; sliding layers).
        mask_function: transformers' mask pattern. Causal and sliding-window causal (the window is applied by the
            attention from the module's ``sliding_window``) give per-sequence metadata; packed sequences
            (``position_ids`` restarting, no mask, no cache) give per-query ranges inside each packed sequence;
            any other pattern (and, while compiling, every pattern but plain causal: closures cannot be inspected
            there) is evaluated on the ``[B, T, S]`` grid and must give every query one contiguous range ending at
            its own row.
        attention_mask: optional 2-D padding mask ``[B, >= kv_offset + kv_length]`` (bool/int, 1 = real token);
            padding must be *leading* (left padding, as ``generate()`` uses) or trailing; holes are not supported.

    Returns int32 ``[2, B, 1, 1]`` (one range per sequence; 4-D so transformers passes it through as a prepared
    mask): row 0 ``start = max(0, pad_b - kv_offset)`` (first visible returned row), row 1 ``length = max(0, q_offset
    + T - kv_offset - start)`` (rows from ``start`` through the last query). Or ``[2, B, T, 1]``: a range per query
    (``length`` rows from ``start`` through the query's own row). Causality, sliding windows, softcap and sinks are
    applied by the attention function from the module's own arguments.

    Raises:
        ValueError: a mask pattern that is not representable (see ``mask_function``); in compiled and exported
            graphs the same check is a ``torch._assert_async`` (``RuntimeError`` on CPU, a device assert on CUDA).
    """
    check_asked_depth(kwargs.get("config"), kv_length)  # a cache reused by a deeper model: before any write
    if torch.compiler.is_compiling():  # closures cannot be inspected while tracing: anything else takes the grid
        kind, segments = ("causal" if mask_function in (None, causal_mask_function) else "other"), None
    else:
        kind, segments = _mask_kind(mask_function)
    if kind == "other":
        return _per_query_ranges(mask_function, batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask,
                                 device)
    if kind == "packed":  # segments [B, T] (T == kv_length, no cache): each query sees its segment's start..itself
        segments = segments.to(device)
        t = torch.arange(q_length, device=device)
        first = torch.ones_like(segments, dtype=torch.bool)
        first[:, 1:] = segments[:, 1:] != segments[:, :-1]
        start = torch.where(first, t, 0).cummax(-1).values
        return torch.stack([start, t + 1 - start]).to(torch.int32).view(2, batch_size, q_length, 1)
    check_padding(attention_mask, q_offset, q_length)
    if (isinstance(kv_offset, int) and torch.device(device).type == "cpu" and not torch.compiler.is_compiling()
            and _unpadded(attention_mask)):  # eager CPU, no padding (each decode step of an unpadded batch): the
        length = max(0, int(q_offset) + q_length - kv_offset)  # same metadata as below from host ints, one op
        return torch.tensor([[0] * batch_size, [length] * batch_size], dtype=torch.int32).view(2, batch_size, 1, 1)
    if attention_mask is None:
        pad = torch.zeros(batch_size, dtype=torch.int64, device=device)
    else:
        pad = (attention_mask.to(device).long().cumsum(-1) == 0).sum(-1)  # leading zeros per row
    start = (pad - kv_offset).clamp_min(0)
    length = (torch.zeros_like(pad) + (q_offset + q_length - kv_offset) - start).clamp_min(0)
    # 4-D, so that transformers treats it as an already prepared mask (generate() builds masks ahead of the forward)
    return torch.stack([start, length]).to(torch.int32).view(2, batch_size, 1, 1)


def _unpadded(attention_mask) -> bool:
    """Eager: no padding mask, or a CPU one with every position real (``all()`` is a cheap host read there)."""
    if attention_mask is None:
        return True
    return type(attention_mask) is torch.Tensor and attention_mask.is_cpu and bool(attention_mask.all())


def _block_stride(x: torch.Tensor) -> int | None:
    """``r`` such that token ``(b, s)`` of ``x [B, S, H, D]`` sits ``b * r + s`` row strides from the start, or None."""
    b, s = x.shape[:2]
    sb, ss = x.stride()[:2]
    if b == 1:
        return s
    return sb // ss if ss > 0 and sb % ss == 0 else None


def _token_views(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """:func:`_views_of` ``(key.transpose(1, 2), value.transpose(1, 2))``, kept on ``key`` in eager mode: a static
    cache returns the same ``key``/``value`` objects every step, so later calls only compare the metadata the views
    depend on (identity of ``value``, shapes, strides and addresses)."""
    if torch.compiler.is_compiling() or type(key) is not torch.Tensor:
        return _views_of(key.transpose(1, 2), value.transpose(1, 2))
    sig = (key.shape, key.stride(), key.data_ptr(), value.shape, value.stride(), value.data_ptr())
    memo = getattr(key, "_kvops_token_views", None)
    if memo is not None and memo[0] is value and memo[1] == sig:
        return memo[2]
    out = _views_of(key.transpose(1, 2), value.transpose(1, 2))
    if out[0]._base is not None:  # views of the cache's storage (copies are per call)
        key._kvops_token_views = (value, sig, out)
    return out


def _views_of(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``k``, ``v [B, S, H, D]`` as ``[P, 1, H, D]`` token blocks, token ``(b, s)`` at block ``b * r + s``; returns
    ``(k_tok, v_tok, r)``. Views (``as_strided``, no copy) when K and V share one ``r`` (contiguous HND or NHD storage,
    as every cache returns); otherwise reshaped copies (``r = S``)."""
    r = _block_stride(k)
    if r is None or r != _block_stride(v):
        return k.reshape(-1, 1, *k.shape[2:]), v.reshape(-1, 1, *v.shape[2:]), k.shape[1]
    views = [x.as_strided(((x.shape[0] - 1) * r + x.shape[1], 1, *x.shape[2:]), (x.stride(1), *x.stride()[1:]))
             for x in (k, v)]
    return views[0], views[1], r


def _build_metadata(attention_mask, batch, capacity, block_table, stride, seqs, q_len, device):
    """``(cu_seqlens_q [seqs + 1], seq_lens [seqs], block_table [seqs, capacity])`` int32 for
    ``kvops.paged_attention`` over the token views (``block_table is None``: token ``(b, s)`` at block ``b * stride +
    s``) or the paged storage (``stride`` = ``block_size``)."""
    if attention_mask is None:
        start = torch.zeros(batch, 1, dtype=torch.int64, device=device)
        length = torch.full((batch,), capacity, dtype=torch.int32, device=device)
    else:
        start, length = attention_mask[0, :, :, 0].long(), attention_mask[1, :, :, 0].reshape(-1)
    j = (start[..., None] + torch.arange(capacity, device=device)).clamp_max(capacity - 1)  # [B, T_m, S] rows
    if block_table is not None:
        table = block_table[:, None].expand(-1, j.shape[1], -1).gather(2, j // stride).long() * stride + j % stride
    else:
        table = torch.arange(batch, device=device)[:, None, None] * stride + j
    cu_seqlens = torch.arange(seqs + 1, dtype=torch.int32, device=device) * q_len
    return cu_seqlens, length, table.view(seqs, capacity).int()


_TABLES: dict = {}  # eager token-view metadata by (first visible rows, geometry): constant across decode steps


def _metadata(attention_mask, *args):
    """:func:`_build_metadata`, computed once per forward in eager mode: every layer of a kind gets the same mask
    tensor from :func:`kvops_mask` and reads caches of the same geometry, so the result is kept on the mask tensor,
    keyed on the geometry, the block table's identity and the mask's version counter (an in-place change of the
    mask recomputes it). For token views with one range per sequence, ``cu_seqlens_q`` and the token table depend
    only on the first visible rows and the geometry, so they are reused across forwards (a decode step reads the
    rows as one host list and takes ``seq_lens`` as a view of the mask). Traced (``torch.compile``/
    ``torch.export``): always computed (Inductor fuses it)."""
    if attention_mask is None or torch.compiler.is_compiling() or type(attention_mask) is not torch.Tensor:
        return _build_metadata(attention_mask, *args)
    batch, capacity, block_table, stride, seqs, q_len, device = args
    inference = attention_mask.is_inference()  # no version counter (torch.inference_mode): not kept on the mask
    key = (None if inference else attention_mask._version, batch, capacity, stride, seqs, q_len, device)
    memo = None if inference else getattr(attention_mask, "_kvops_metadata", None)
    if memo is not None and memo[0] == key and memo[1] is block_table:
        return memo[2]
    if block_table is None and attention_mask.shape[2] == 1 and attention_mask.is_cpu:
        start = tuple(attention_mask[0].view(-1).tolist())
        tables = _TABLES.get((start, *key[1:]))
        if tables is None:
            cu_seqlens, _, table = _build_metadata(attention_mask, *args)
            if len(_TABLES) >= 8:  # (a DynamicCache grows its capacity every step: no unbounded growth)
                _TABLES.clear()
            tables = _TABLES[(start, *key[1:])] = (cu_seqlens, table)
        out = (tables[0], attention_mask[1].view(-1), tables[1])
    else:
        out = _build_metadata(attention_mask, *args)
    if not inference:
        attention_mask._kvops_metadata = (key, block_table, out)
    return out


def kvops_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                            sliding_window: int | None = None, softcap: float | None = None,
                            s_aux: torch.Tensor | None = None, **kwargs):
    """Attention function registered as ``"kvops"``: one ``kvops.paged_attention`` call per layer.

    Args (transformers' attention-function interface, ``AttentionInterface``):
        module: the attention module (``layer_idx``, ``is_causal``).
        query: ``[B, H_q, T, D]``. key, value: ``[B, H_kv, S, D]`` / ``[B, H_kv, S, D_v]`` as the cache returned them
            (any transformers cache, or :class:`KvopsStaticCache`); for :class:`KvopsPagedCache` the layer's joint
            storage ``[P, block_size, 2, H_kv, D]`` and its block table ``[B, max_blocks]`` int32.
        attention_mask: the int32 metadata ``[2, B, 1, 1]`` of :func:`kvops_mask` (``None``: no padding, all rows
            visible).
        scaling: softmax scale (default ``D ** -0.5``). dropout: must be 0 (inference only).
        sliding_window: ``W`` (Mistral, Gemma-2, gpt-oss sliding layers): a query at ``p`` sees keys ``> p - W``.
        softcap: ``c``: scores ``c * tanh(s / c)`` before masking (Gemma-2). s_aux: per-query-head sink logits
            ``[H_q]`` (gpt-oss), added to the softmax denominator.

    Returns ``(out [B, T, H_q, D_v], None)`` in query's dtype.

    Raises:
        ValueError: dropout > 0; a custom 4-D mask; GQA and dtype errors of ``kvops.paged_attention``.
    """
    if dropout:
        raise ValueError(f"kvops attention: dropout={dropout} is not supported (inference only); call model.eval().")
    if kwargs.get("output_attentions", False):
        logger.warning_once("`kvops` attention does not support `output_attentions=True` (it returns no attention "
                            "maps). Please set your attention to `eager` if you want any of these features.")
    batch, num_heads, t, d = query.shape
    if attention_mask is not None and (attention_mask.dtype != torch.int32 or attention_mask.shape[0] != 2
                                       or attention_mask.shape[2] not in (1, t) or attention_mask.shape[3] != 1):
        raise ValueError(
            f"kvops attention: got an attention mask of shape {tuple(attention_mask.shape)} and dtype "
            f"{attention_mask.dtype}; it needs the [2, batch, 1, 1] int32 metadata built by kvops_mask (registered as "
            f"'kvops' in AttentionMaskInterface). Custom 4-D masks are not supported: pass a 2-D padding mask."
        )
    device = query.device
    paged = key.dim() == 5  # a KvopsPagedLayer: joint storage [P, block_size, 2, H_kv, D] and its block table
    kv_heads = key.shape[3] if paged else key.shape[1] if key.dim() == 4 else None
    if kv_heads and num_heads % kv_heads:
        raise ValueError(
            f"kvops attention: query has {num_heads} heads and key/value {kv_heads} KV heads; the query heads must "
            f"be a multiple of num_kv_heads (GQA: query head h reads KV head h // (num_heads // num_kv_heads)). "
            f"Check the model config's num_attention_heads / num_key_value_heads."
        )  # a KvopsPagedLayer: joint storage [P, block_size, 2, H_kv, D] and its block table
    if paged:
        block_table, (p, block_size) = value, key.shape[:2]
        tokens = key.view(p * block_size, 1, *key.shape[2:])  # the (P, block_size) dims of the storage merge
        k_tok, v_tok = tokens[:, :, 0], tokens[:, :, 1]
        capacity = block_table.shape[1] * block_size
    else:
        k_tok, v_tok, r = _token_views(key, value)
        capacity = key.shape[2]
    per_query = attention_mask is not None and attention_mask.shape[2] > 1  # a range per query: B * T sequences
    seqs, q_len = (batch * t, 1) if per_query else (batch, t)
    cu_seqlens, length, table = _metadata(attention_mask, batch, capacity, block_table if paged else None,
                                          block_size if paged else r, seqs, q_len, device)
    args = (query.transpose(1, 2).reshape(batch * t, num_heads, d), k_tok, v_tok, cu_seqlens, length, table, q_len)
    kw = dict(scale=scaling, causal=getattr(module, "is_causal", True),
              window_left=-1 if sliding_window is None else sliding_window - 1, softcap=softcap or 0.0,
              sinks=None if s_aux is None else s_aux.float())
    if _pa._direct((*args[:6], kw["sinks"])):  # eager, plain CPU tensors: the op's body (validator + native kernel)
        # without the wrapper's value-contract pass: the metadata is built here, in range by construction
        scalars = (kw["scale"], kw["causal"], kw["window_left"], kw["softcap"])
        checked = getattr(k_tok, "_kvops_checked", None)  # the validator's verdict for these very tensors
        if (checked is not None and checked[0] is v_tok and checked[1] is cu_seqlens and checked[2] is table
                and checked[3] is kw["sinks"] and checked[4] == (args[0].shape, args[0].dtype, q_len, *scalars)):
            out = _native_out(*args, checked[5], *scalars[1:], kw["sinks"], None, None)
        else:
            sm_scale = _pa.check_paged_attention(*args, *scalars, kw["sinks"], None, None, "NHD")[0]
            out = _native_out(*args, sm_scale, *scalars[1:], kw["sinks"], None, None)
            if k_tok._base is not None:  # a view of the cache (kept across steps), not a per-call copy
                k_tok._kvops_checked = (v_tok, cu_seqlens, table, kw["sinks"],
                                        (args[0].shape, args[0].dtype, q_len, *scalars), sm_scale)
    else:
        out = kvops.paged_attention(*args, **kw)
    return out.view(batch, t, num_heads, out.shape[-1]), None


AttentionInterface.register(NAME, kvops_attention_forward)
AttentionMaskInterface.register(NAME, kvops_mask)
