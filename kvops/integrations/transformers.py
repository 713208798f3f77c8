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

Supported masks: causal and sliding-window causal masks with (left) padding, as ``generate()`` builds them. Custom
4-D masks, bidirectional or packed-sequence masks are not representable by (``start``, ``length``) and raise.

Continuous batching (``generate_batch``): transformers 5.23's ``ContinuousBatchingManager.switch_to_cb_friendly_attn``
accepts only ``"paged|eager"``, ``"sdpa"`` or a flash implementation and raises ``ValueError`` for any other name, so a
custom attention function cannot be plugged into its ``PagedAttentionCache``; it is not supported.

Tested versions: see the ``transformers`` extra in ``pyproject.toml``.
"""

from __future__ import annotations

import torch

from .._extras import require

require("transformers", "kvops.integrations.transformers", "transformers")

from transformers import AttentionInterface  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface

import kvops

from ._hf_cache import KvopsPagedCache, KvopsPagedLayer, KvopsSlidingLayer, KvopsStaticCache, KvopsStaticLayer

NAME = "kvops"

__all__ = [
    "NAME",
    "kvops_attention_forward",
    "kvops_mask",
    "KvopsStaticCache",
    "KvopsStaticLayer",
    "KvopsSlidingLayer",
    "KvopsPagedCache",
    "KvopsPagedLayer",
]


def kvops_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, mask_function=None,
               attention_mask: torch.Tensor | None = None, device: torch.device | str = "cpu",
               **kwargs) -> torch.Tensor:
    """Mask function registered as ``"kvops"``: per-sequence visible key range (``start``, ``length``).

    Args (as transformers passes them to every mask function, ``masking_utils.create_causal_mask``):
        batch_size: ``B``. q_length: ``T`` new tokens. kv_length: rows of the K/V the cache will return.
        q_offset: global position of the first query (int, SymInt or 0-d tensor).
        kv_offset: global position of the first returned K/V row (int, SymInt or 0-d tensor; sliding layers).
        attention_mask: optional 2-D padding mask ``[B, >= kv_offset + kv_length]`` (bool/int, 1 = real token);
            padding must be *leading* (left padding, as ``generate()`` uses) or trailing; holes are not supported.

    Returns ``[2, B, 1, 1]`` int32 (4-D so transformers passes it through as a prepared mask): row 0
    ``start = max(0, pad_b - kv_offset)`` (first visible returned row), row 1
    ``length = max(0, q_offset + T - kv_offset - start)`` (rows from ``start`` through the last query). Causality,
    sliding windows, softcap and sinks are applied by the attention function from the module's own arguments.
    """
    if attention_mask is None:
        pad = torch.zeros(batch_size, dtype=torch.int64, device=device)
    else:
        pad = (attention_mask.to(device).long().cumsum(-1) == 0).sum(-1)  # leading zeros per row
    start = (pad - kv_offset).clamp_min(0)
    length = (torch.zeros_like(pad) + (q_offset + q_length - kv_offset) - start).clamp_min(0)
    # 4-D, so that transformers treats it as an already prepared mask (generate() builds masks ahead of the forward)
    return torch.stack([start, length]).to(torch.int32).view(2, batch_size, 1, 1)


def _block_stride(x: torch.Tensor) -> int | None:
    """``r`` such that token ``(b, s)`` of ``x [B, S, H, D]`` sits ``b * r + s`` row strides from the start, or None."""
    b, s = x.shape[:2]
    sb, ss = x.stride()[:2]
    if b == 1:
        return s
    return sb // ss if ss > 0 and sb % ss == 0 else None


def _token_views(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``k``, ``v [B, S, H, D]`` as ``[P, 1, H, D]`` token blocks, token ``(b, s)`` at block ``b * r + s``; returns
    ``(k_tok, v_tok, r)``. Views (``as_strided``, no copy) when K and V share one ``r`` (contiguous HND or NHD storage,
    as every cache returns); otherwise reshaped copies (``r = S``)."""
    r = _block_stride(k)
    if r is None or r != _block_stride(v):
        return k.reshape(-1, 1, *k.shape[2:]), v.reshape(-1, 1, *v.shape[2:]), k.shape[1]
    views = [x.as_strided(((x.shape[0] - 1) * r + x.shape[1], 1, *x.shape[2:]), (x.stride(1), *x.stride()[1:]))
             for x in (k, v)]
    return views[0], views[1], r


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
    if attention_mask is not None and (attention_mask.dtype != torch.int32 or attention_mask.shape[0] != 2
                                       or attention_mask.shape[2:] != (1, 1)):
        raise ValueError(
            f"kvops attention: got an attention mask of shape {tuple(attention_mask.shape)} and dtype "
            f"{attention_mask.dtype}; it needs the [2, batch, 1, 1] int32 metadata built by kvops_mask (registered as "
            f"'kvops' in AttentionMaskInterface). Custom 4-D masks are not supported: pass a 2-D padding mask."
        )
    batch, num_heads, t, d = query.shape
    device = query.device
    paged = key.dim() == 5  # a KvopsPagedLayer: joint storage [P, block_size, 2, H_kv, D] and its block table
    if paged:
        block_table, (p, block_size) = value, key.shape[:2]
        tokens = key.view(p * block_size, 1, *key.shape[2:])  # the (P, block_size) dims of the storage merge
        k_tok, v_tok = tokens[:, :, 0], tokens[:, :, 1]
        capacity = block_table.shape[1] * block_size
    else:
        k_tok, v_tok, r = _token_views(key.transpose(1, 2), value.transpose(1, 2))
        capacity = key.shape[2]
    if attention_mask is None:
        start = torch.zeros(batch, dtype=torch.int64, device=device)
        length = torch.full((batch,), capacity, dtype=torch.int32, device=device)
    else:
        start, length = attention_mask[0, :, 0, 0].long(), attention_mask[1, :, 0, 0]
    j = (start[:, None] + torch.arange(capacity, device=device)).clamp_max(capacity - 1)  # [B, S] row of entry j
    if paged:
        table = block_table.gather(1, j // block_size).long() * block_size + j % block_size
    else:
        table = torch.arange(batch, device=device)[:, None] * r + j
    out = kvops.paged_attention(
        query.transpose(1, 2).reshape(batch * t, num_heads, d), k_tok, v_tok,
        torch.arange(batch + 1, dtype=torch.int32, device=device) * t, length, table.to(torch.int32), t,
        scale=scaling, causal=getattr(module, "is_causal", True),
        window_left=-1 if sliding_window is None else sliding_window - 1, softcap=softcap or 0.0,
        sinks=None if s_aux is None else s_aux.float(),
    )
    return out.view(batch, t, num_heads, out.shape[-1]), None


AttentionInterface.register(NAME, kvops_attention_forward)
AttentionMaskInterface.register(NAME, kvops_mask)
