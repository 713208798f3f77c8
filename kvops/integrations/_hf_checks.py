"""Argument checks of the transformers ``Cache`` classes (``kvops/integrations/_hf_cache.py``) and of
:class:`~kvops.integrations.transformers.ExportableDecodeStep`: each raises before anything is written or moved."""

from __future__ import annotations

import threading
import weakref

import torch

from .._checks import values

def check_room(cache: str, seen, num_tokens, max_cache_len: int) -> None:
    """``ValueError`` naming the positions, ``max_cache_len`` and the fix when ``num_tokens`` new tokens after
    ``seen`` do not fit (raised before anything is written)."""
    if seen < 0:
        raise ValueError(
            f"{cache}: the cache position {seen} is negative; positions count tokens from 0 (cache_position / "
            f"cumulative_length). Pass the position of the first new token, 0 <= position <= {max_cache_len}."
        )
    if seen + num_tokens > max_cache_len:
        raise ValueError(
            f"{cache}: writing {num_tokens} token{'s' if num_tokens != 1 else ''} at positions [{seen}, "
            f"{seen + num_tokens}) exceeds max_cache_len="
            f"{max_cache_len}, the tokens each sequence holds (prompt + generated). Allocate the cache with "
            f"max_cache_len >= the prompt length + max_new_tokens of the whole generate() call (this step alone "
            f"needs {seen + num_tokens})."
        )


def check_states(layer, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
    """``ValueError`` (raised before anything is written) unless ``key_states`` / ``value_states`` are
    ``[B, H_kv, T, D]`` / ``[B, H_kv, T, D_v]`` of the batch size, KV heads, head dims, dtype and device the layer's
    storage was allocated for at the cache's first forward."""
    want = (layer.batch_size, layer.num_heads, key_states.shape[-2] if key_states.dim() == 4 else "T")
    for name, x, d in (("key_states", key_states, layer.head_dim), ("value_states", value_states, layer.head_dim_v)):
        if (x.dim() != 4 or tuple(x.shape[:3]) != want or x.shape[3] != d or x.dtype != layer.dtype
                or x.device != layer.device):
            raise ValueError(
                f"{layer.cache_name}: {name} has shape {tuple(x.shape)}, dtype {x.dtype}, device {x.device}; this "
                f"cache was allocated at its first forward for [batch_size={layer.batch_size}, "
                f"num_kv_heads={layer.num_heads}, T, head_dim={d}] {layer.dtype} states on {layer.device} (key and "
                f"value with the same T). Create a new {layer.cache_name} for this model, batch size or dtype "
                f"(reset() keeps the allocation)."
            )


def _crop_count(cache: str, tokens_to_remove: int, seen: int) -> int:
    """Tokens a ``crop(tokens_to_remove)`` removes (transformers' convention: a negative count), or ``ValueError``."""
    if tokens_to_remove > 0:
        raise ValueError(
            f"{cache}.crop({tokens_to_remove}): pass a negative number of tokens to remove (as transformers' "
            f"DynamicCache); positive values (a final length) are not supported."
        )
    if -tokens_to_remove > seen:
        raise ValueError(f"{cache}.crop({tokens_to_remove}): the cache holds only {seen} tokens.")
    return -tokens_to_remove


def beam_indices(cache: str, beam_idx, batch: int) -> list[int]:
    """``beam_idx`` as a list of ints after checking it is a beam-search reorder of a batch of ``batch`` rows.

    Accepted (as transformers' own caches, whose ``reorder_cache`` calls ``index_select(0, beam_idx.to(device))``):
    a 1-D int64 or int32 tensor on any device (generate() passes a LongTensor on the model's device), or a list /
    tuple of Python ints. A static cache keeps its batch size, so ``len(beam_idx)`` must equal it (transformers'
    dynamic caches would shrink or grow the batch instead) and every entry must be a row ``0 <= i < batch``.
    Eager host read of ``batch`` ints (reorders run between forwards). Raises ``TypeError`` (another type or dtype)
    or ``ValueError`` (rank, length, an entry out of range), naming ``beam_idx`` and the value.
    """
    where = f"{cache}.reorder_cache"
    if isinstance(beam_idx, torch.Tensor):
        if beam_idx.dtype not in (torch.int64, torch.int32):
            raise TypeError(
                f"{where}: beam_idx must be an int64 (LongTensor) or int32 tensor of batch indices, got dtype "
                f"{beam_idx.dtype}. Pass beam_idx.long()."
            )
        if beam_idx.dim() != 1:
            raise ValueError(
                f"{where}: beam_idx must be 1-D [batch_size={batch}], got shape {tuple(beam_idx.shape)}. Pass "
                f"beam_idx.reshape(-1) (one source row per batch row)."
            )
        parents = beam_idx.tolist()
    elif isinstance(beam_idx, (list, tuple)) and all(type(i) is int for i in beam_idx):
        parents = list(beam_idx)
    else:
        raise TypeError(
            f"{where}: beam_idx must be a 1-D LongTensor (or a list of ints) of batch indices, got "
            f"{type(beam_idx).__name__} {beam_idx!r}."
        )
    if len(parents) != batch:
        raise ValueError(
            f"{where}: beam_idx={parents} has {len(parents)} entries but the cache holds batch_size={batch} rows; "
            f"a kvops cache keeps its batch: pass one parent row per row (len(beam_idx) == {batch}), or build a "
            f"cache for the new batch size."
        )
    bad = [i for i in parents if not 0 <= i < batch]
    if bad:
        raise ValueError(
            f"{where}: beam_idx={parents} holds {bad[0]}, outside the rows [0, {batch}) of the cache (negative "
            f"indices are not rows either); pass each row's parent row in [0, {batch})."
        )
    return parents


_asked = threading.local()  # (weakref to the kvops cache whose get_mask_sizes ran last in this thread, its kv_length)


def remember_mask_sizes_caller(cache, sizes) -> None:
    """Called by the kvops caches' ``get_mask_sizes`` with what it returns: transformers' ``create_causal_mask`` asks
    the cache for the mask sizes and then calls the registered mask function (``kvops_mask``) with that
    ``kv_length`` and the model's ``config``, which :func:`check_asked_depth` compares with the cache before any layer
    writes (nothing is recorded while compiling; a weak reference, so nothing is kept alive)."""
    if not torch.compiler.is_compiling():
        _asked.last = (weakref.ref(cache), sizes[0])


def check_asked_depth(config, kv_length) -> None:
    """From ``kvops_mask``: :func:`check_depth` of the cache that was just asked for the mask sizes of this very
    mask (same ``kv_length``; the record is consumed, so a stale one from a mask built by another attention
    implementation is used at most once and only if it matches)."""
    last = getattr(_asked, "last", None)
    if last is None or torch.compiler.is_compiling():
        return
    _asked.last = None
    cache = last[0]()
    if cache is None or config is None or not isinstance(kv_length, int) or last[1] != kv_length:
        return
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layers = getattr(text, "num_hidden_layers", None)
    if isinstance(layers, int):
        check_depth(cache, layers)


def check_depth(cache, num_layers: int, layer_idx: int | None = None) -> None:
    """``ValueError`` when a model of ``num_layers`` layers (or a call for layer ``layer_idx``) needs more layers
    than ``cache`` was built with (a cache reused by a deeper model)."""
    have = len(cache.layers)
    if num_layers <= have and (layer_idx is None or 0 <= layer_idx < have):
        return
    asked = (f"a model with num_hidden_layers={num_layers} needs more layers than" if layer_idx is None
             else f"layer_idx={layer_idx} is not a layer of")
    raise ValueError(
        f"{type(cache).__name__}: {asked} this cache, which holds {have} layers (from the config it was built "
        f"with){'; nothing was written' if layer_idx is None else ''}. A cache serves one model: build it from "
        f"this model's config ({type(cache).__name__}(model.config, ...))."
    )


def check_cache_position(cache: str, cache_position, num_tokens: int, max_cache_len: int) -> None:
    """:class:`ExportableDecodeStep`'s ``cache_position`` (``[T]`` or ``[1]`` integer tensor, the position of the
    first new token): ``TypeError``/``ValueError`` for another type, dtype or shape; then, before any cursor or row
    is written, ``0 <= cache_position[0]`` and ``cache_position[0] + T <= max_cache_len``: eagerly a ``ValueError``
    (:func:`check_room`, one host read); traced (``torch.compile``/``torch.export``) a ``torch._assert_async``
    (no host sync; ``RuntimeError`` on CPU, a device assert on CUDA), unless value checks are ``"off"``."""
    if not isinstance(cache_position, torch.Tensor) or cache_position.is_floating_point() or \
            cache_position.is_complex() or cache_position.dtype == torch.bool:
        what = cache_position.dtype if isinstance(cache_position, torch.Tensor) else type(cache_position).__name__
        raise TypeError(
            f"ExportableDecodeStep: cache_position must be an integer tensor ([T] or [1] int64: the position of the "
            f"first new token), got {what}. Pass torch.tensor([position])."
        )
    if cache_position.dim() != 1 or cache_position.shape[0] not in (1, num_tokens):
        raise ValueError(
            f"ExportableDecodeStep: cache_position must be [T] or [1] (T = {num_tokens} new tokens), got shape "
            f"{tuple(cache_position.shape)}. Pass torch.arange(start, start + {num_tokens}) or torch.tensor([start])."
        )
    if not torch.compiler.is_compiling():
        check_room(cache, int(cache_position[0]), num_tokens, max_cache_len)
    elif values.get_value_checks() != "off":
        p = cache_position[0]
        torch._assert_async((p >= 0) & (p + num_tokens <= max_cache_len),
                            f"ExportableDecodeStep: cache_position[0] + T (T = {num_tokens}) is outside [0, "
                            f"max_cache_len={max_cache_len}]; no cursor or row was written.")


def check_padding(attention_mask, q_offset, q_length) -> None:
    """The 2-D padding mask's contract: it covers every query (``S >= q_offset + T``) and each row is left padding,
    real tokens, right padding (``0...0 1...1 0...0``; a hole, a 0 between two 1s, cannot be expressed as one range
    per sequence). Checked in the value-check mode (``kvops.value_checks``, docs/semantics.md §7): ``"eager"``:
    ``ValueError`` (one host read), nothing while tracing; ``"async"``: ``torch._assert_async`` (no host sync);
    ``"off"``: unchecked (a hole attends the padding between)."""
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
        return
    mode = values._active(attention_mask)
    if mode is None:
        return
    real = attention_mask.bool()
    width = real.shape[-1]
    starts = (real[:, 1:] & ~real[:, :-1]).sum(-1) + real[:, 0]  # runs of real tokens per row
    if mode == "async":
        end = q_offset + q_length
        values._assert(((starts <= 1).all() & (torch.as_tensor(end, device=real.device) <= width)),
                        f"kvops attention: attention_mask [B, {width}] does not cover the queries or has a hole (a "
                        f"0 between two 1s); run with kvops.value_checks('eager') to see which.")
        return
    end = int(q_offset) + q_length
    if width < end:
        raise ValueError(
            f"kvops attention: attention_mask has {width} columns but the queries reach position {end - 1} "
            f"(q_offset {end - q_length} + {q_length} new tokens); pass a 2-D padding mask of at least {end} columns "
            f"covering the prompt and every generated token (as generate() extends it)."
        )
    holes = (starts > 1).nonzero()
    if len(holes):
        b = int(holes[0, 0])
        row = real[b].int().tolist()
        first, last = row.index(1), width - 1 - row[::-1].index(1)
        gap = row.index(0, first)
        raise ValueError(
            f"kvops attention: attention_mask row {b} has a hole: padding (0) at position {gap} between real tokens "
            f"(1) at positions {first} and {last}. kvops attention supports left and right padding only (each row "
            f"0...0 1...1 0...0, as generate() builds it); move the padding to the left, or use "
            f"attn_implementation='sdpa' or 'eager' for such masks."
        )
