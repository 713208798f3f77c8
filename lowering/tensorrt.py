"""torch-tensorrt converters for the functional kvops cache writes. NOT VERIFIED: TensorRT cannot be installed here.

torch-tensorrt 2.14 pins torch 2.14 and pulls TensorRT's libraries from NVIDIA's own index, which our machines cannot
reach; no engine has been built from this file. It is written against torch-tensorrt's converter API as found in its
source (``py/torch_tensorrt/dynamo/conversion/_ConverterRegistry.py``, ``impl/slice_scatter.py``, ``impl/select.py``)
and is imported only by :func:`kvops.lowering.register_tensorrt`, after ``import torch_tensorrt`` succeeded.

What is converted (the program first goes through ``kvops.export.functionalize``: TensorRT networks cannot express
the in-place ``auto_functionalized_v2`` form, so the writes become ``kvops::<op>_functional`` nodes whose outputs are
the new caches):

- ``cache_write_functional`` -> ``impl.slice_scatter`` on the sequence dim (and on the head dim for a head slice).
  Priority HIGH; validator: static 4-D shapes, Python-int ``start``/``cache_head_start`` (torch-tensorrt's
  slice_scatter needs constant bounds), so ``supports_dynamic_shapes=False``. torch-tensorrt's slice_scatter emits
  TensorRT's ``IKVCacheUpdateLayer`` (``add_kv_cache_update``, ``KVCacheMode.LINEAR``, output aliased to the cache
  input) exactly when that layer's constraints hold: a 4-D static cache that is a network input, static batch, and
  the write on dim 2 of ``[B, H, S_max, D]``. kvops' contiguous caches are ``[B, S, H, D]`` (sequence on dim 1), so
  for them the layer's constraints do not hold and the scatter fallback is used; the fast path needs a head-major
  cache layout, which kvops does not have.
- ``cache_roll_functional`` -> ``impl.slice.slice_op`` of the source rows + ``impl.slice_scatter`` at the
  destination (reads the input cache, so overlapping ranges are correct). Same validator.
- ``paged_cache_write_functional`` -> flattened ``[P * block_size + 1, H_kv, D]`` cache (one spare row),
  negative slots redirected to the spare row (``where``), ``index_put`` of the token rows, spare row sliced off. NHD,
  non-fp8 caches, all heads (``cache_head_start`` None or 0 with ``H_in == H_kv``); ``supports_dynamic_shapes=False``.
- ``paged_attention``: no converter (its gathers through ``block_table`` would run as generic TensorRT gathers);
  torch-tensorrt leaves the node to PyTorch (a graph partition), which is the honest state today.
"""

from __future__ import annotations

import torch
from torch.fx.node import Node

from torch_tensorrt.dynamo._SourceIR import SourceIR  # noqa: E402  (only imported when torch_tensorrt imports)
from torch_tensorrt.dynamo.conversion import impl
from torch_tensorrt.dynamo.conversion._ConverterRegistry import ConverterPriority, dynamo_tensorrt_converter

_ops = torch.ops.kvops


def _bound(node_or_target, args, kwargs) -> dict:
    """Arguments by name (the functionalize pass passes keywords; other passes may pass positions)."""
    op = node_or_target if not isinstance(node_or_target, Node) else node_or_target.target
    names = [a.name for a in op._schema.arguments]
    defaults = {a.name: a.default_value for a in op._schema.arguments if a.has_default_value()}
    return {**defaults, **dict(zip(names, args)), **kwargs}


def _static_4d(value) -> bool:
    val = value.meta.get("val") if isinstance(value, Node) else None
    return val is not None and val.dim() == 4 and all(isinstance(s, int) for s in val.shape)


def contiguous_write_supported(node: Node, settings=None) -> bool:
    """Static 4-D tensors and Python-int positions (torch-tensorrt's slice_scatter needs constant bounds)."""
    a = _bound(node, node.args, node.kwargs)
    tensors = ("key", "value", "k_cache", "v_cache") if "key" in a else ("k_cache", "v_cache")
    ints = ("start",) if "start" in a else ("src", "dst", "num_tokens")
    return all(_static_4d(a[t]) for t in tensors) and all(isinstance(a[i], int) for i in ints)


def _write_rows(ctx, target, name, cache, x, start: int, rows: int, h0: int, h_in: int, h_cache: int):
    """``cache[:, start:start+rows, h0:h0+h_in] = x`` with torch-tensorrt's slice/slice_scatter."""
    if h_in != h_cache:  # the head slice inside the row range, then the row range into the cache
        inner = impl.slice.slice_op(ctx, target, SourceIR.ATEN, f"{name}_rows", cache, 1, start, start + rows, 1)
        x = impl.slice_scatter.slice_scatter(ctx, target, SourceIR.ATEN, f"{name}_heads", inner, x, 2, h0,
                                             h0 + h_in, 1)
    return impl.slice_scatter.slice_scatter(ctx, target, SourceIR.ATEN, name, cache, x, 1, start, start + rows, 1)


@dynamo_tensorrt_converter(_ops.cache_write_functional.default, capability_validator=contiguous_write_supported,
                           priority=ConverterPriority.HIGH, supports_dynamic_shapes=False)
def convert_cache_write(ctx, target, args, kwargs, name):
    a = _bound(target, args, kwargs)
    h0, h_in, h_cache = a["cache_head_start"] or 0, a["key"].shape[2], a["k_cache"].shape[2]
    rows = a["key"].shape[1]
    return tuple(
        _write_rows(ctx, target, f"{name}_{which}", a[cache], a[x], a["start"], rows, h0, h_in, h_cache)
        for which, x, cache in (("k", "key", "k_cache"), ("v", "value", "v_cache"))
    )


@dynamo_tensorrt_converter(_ops.cache_roll_functional.default, capability_validator=contiguous_write_supported,
                           priority=ConverterPriority.HIGH, supports_dynamic_shapes=False)
def convert_cache_roll(ctx, target, args, kwargs, name):
    a = _bound(target, args, kwargs)
    src, dst, n = a["src"], a["dst"], a["num_tokens"]
    h_cache = a["k_cache"].shape[2]
    h0 = a["cache_head_start"] or 0
    h1 = h_cache if a["num_heads"] is None else h0 + a["num_heads"]
    out = []
    for which in ("k_cache", "v_cache"):
        cache = a[which]
        if n == 0 or src == dst:
            out.append(cache)
            continue
        moved = impl.slice.slice_op(ctx, target, SourceIR.ATEN, f"{name}_{which}_src", cache, 1, src, src + n, 1)
        moved = impl.slice.slice_op(ctx, target, SourceIR.ATEN, f"{name}_{which}_heads", moved, 2, h0, h1, 1)
        out.append(_write_rows(ctx, target, f"{name}_{which}", cache, moved, dst, n, h0, h1 - h0, h_cache))
    return tuple(out)


def paged_write_supported(node: Node, settings=None) -> bool:
    """NHD, non-fp8, all heads, static shapes."""
    a = _bound(node, node.args, node.kwargs)
    if a.get("kv_layout", "NHD") != "NHD" or a.get("k_scale") is not None:
        return False
    key, k_cache = a["key"].meta.get("val"), a["k_cache"].meta.get("val")
    return (
        _static_4d(a["k_cache"]) and _static_4d(a["v_cache"]) and key is not None
        and all(isinstance(s, int) for s in key.shape) and key.shape[1] == k_cache.shape[2]
        and a["cache_head_start"] in (None, 0)
    )


@dynamo_tensorrt_converter(_ops.paged_cache_write_functional.default, capability_validator=paged_write_supported,
                           priority=ConverterPriority.HIGH, supports_dynamic_shapes=False)
def convert_paged_cache_write(ctx, target, args, kwargs, name):
    a = _bound(target, args, kwargs)
    slots = a["slot_mapping"]
    n = slots.shape[0]
    out = []
    for which, x in (("k_cache", a["key"]), ("v_cache", a["value"])):
        cache = a[which]
        p, block_size, h, d = cache.shape
        num_slots = p * block_size
        flat = impl.shuffle.reshape(ctx, target, SourceIR.ATEN, f"{name}_{which}_flat", cache, (num_slots, h, d))
        spare = impl.slice.slice_op(ctx, target, SourceIR.ATEN, f"{name}_{which}_spare", flat, 0, 0, 1, 1)
        padded = impl.cat.cat(ctx, target, SourceIR.ATEN, f"{name}_{which}_padded", [flat, spare], 0)
        negative = impl.elementwise.lt(ctx, target, SourceIR.ATEN, f"{name}_{which}_neg", slots, 0)
        spare_index = torch.full((n,), num_slots, dtype=torch.int64)
        index = impl.condition.where(ctx, target, SourceIR.ATEN, f"{name}_{which}_idx", spare_index, slots, negative)
        rows = impl.slice.slice_op(ctx, target, SourceIR.ATEN, f"{name}_{which}_tokens", x, 0, 0, n, 1)
        written = impl.select.index_put_converter(ctx, target, SourceIR.ATEN, f"{name}_{which}_put", padded,
                                                  [index], rows)
        written = impl.slice.slice_op(ctx, target, SourceIR.ATEN, f"{name}_{which}_drop", written, 0, 0,
                                      num_slots, 1)
        out.append(impl.shuffle.reshape(ctx, target, SourceIR.ATEN, f"{name}_{which}", written, tuple(cache.shape)))
    return tuple(out)
