"""Functional (non-mutating) variants of the kvops cache-write ops, for paths that cannot express mutation.

``kvops::cache_write_functional``, ``kvops::cache_roll_functional`` and ``kvops::paged_cache_write_functional`` take
the arguments of their mutating op (same names, same defaults, same validator) and return ``(new_k_cache,
new_v_cache)``: copies of the caches with the write applied; the inputs are not touched. Their schemas are in
``kvops/_library.py``: the mutating op's arguments without the ``(a!)`` annotations, ``-> (Tensor, Tensor)``
(tests/project/test_schemas.py keeps them equal, so an argument added to a mutating op must be added to its variant too).

Who uses them: the ONNX export (``kvops.lowering.onnx.functionalize`` rewrites the ``auto_functionalized_v2`` nodes
that ``ExportedProgram.run_decompositions()`` produces into these ops, which the ONNX translations are keyed on) and
TensorRT's converters (``lowering/tensorrt.py``). In eager code prefer the mutating ops: these copy both caches.
"""

from __future__ import annotations

import operator

import torch

from .. import _library  # noqa: F401  (defines the schemas)
from .. import ops as _ops  # noqa: F401  (registers the mutating kernels and fake rules)

MUTATING = ("cache_write", "cache_roll", "paged_cache_write")
_lib = torch.library.Library("kvops", "FRAGMENT")


def _mutable_names(op: torch._ops.OpOverload) -> list[str]:
    return [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]


def _make_impl(name: str):
    op = getattr(torch.ops.kvops, name).default
    names = [a.name for a in op._schema.arguments]
    k_name, v_name = _mutable_names(op)

    def impl(*args, **kwargs):
        bound = dict(zip(names, args), **kwargs)
        k_new = bound[k_name].clone()
        v_new = bound[v_name].clone() if bound[v_name] is not None else None
        bound[k_name], bound[v_name] = k_new, v_new
        op(**bound)  # the mutating op: its validator and kernel (or its fake rule, under tracing)
        return k_new, v_new

    return impl


for _name in MUTATING:
    _impl = _make_impl(_name)
    _lib.impl(f"{_name}_functional", _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"kvops::{_name}_functional", _impl, lib=_lib)

FUNCTIONAL = {
    getattr(torch.ops.kvops, n).default: getattr(torch.ops.kvops, f"{n}_functional").default for n in MUTATING
}
"""Mutating op overload -> its functional variant."""


def cache_write_functional(key, value, k_cache, v_cache, start, cache_head_start=None):
    """:func:`kvops.cache_write` without mutation: returns ``(new_k_cache, new_v_cache)``, copies ``[B, S, H, D]``
    of the caches with rows ``[start, start + T)`` written. Same arguments and errors as :func:`kvops.cache_write`."""
    return torch.ops.kvops.cache_write_functional(key, value, k_cache, v_cache, start, cache_head_start)


def cache_roll_functional(k_cache, v_cache, src, dst, num_tokens, cache_head_start=None, num_heads=None):
    """:func:`kvops.cache_roll` without mutation: returns ``(new_k_cache, new_v_cache)``. Same arguments and errors."""
    return torch.ops.kvops.cache_roll_functional(k_cache, v_cache, src, dst, num_tokens, cache_head_start, num_heads)


def paged_cache_write_functional(key, value, k_cache, v_cache, slot_mapping, cache_head_start=None, k_scale=None,
                                 v_scale=None):
    """:func:`kvops.paged_cache_write` without mutation: returns ``(new_k_cache, new_v_cache)``, copies
    ``[P, block_size, H_kv, D]`` with the slots written (negative slots skipped). Same arguments and errors."""
    return torch.ops.kvops.paged_cache_write_functional(key, value, k_cache, v_cache, slot_mapping,
                                                        cache_head_start, k_scale, v_scale)


def _view_kind(kwargs: dict, name: str) -> str | None:
    """How ``auto_functionalized_v2`` recorded arg ``name`` relative to its base (see torch's auto_functionalize)."""
    for key, kind in (("_alias", "alias"), ("_slice_dim", "slice"), ("_storage_offset", "as_strided")):
        if f"_{name}{key}" in kwargs:
            return kind
    return None


def functionalize(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """``ep.run_decompositions()`` with every kvops cache write turned into its functional variant.

    torch 2.13's ``torch.export`` keeps a mutating custom op as an in-place node; ``run_decompositions()`` turns it
    into ``torch.ops.higher_order.auto_functionalized_v2(op, **kwargs, _all_bases=[...])`` whose outputs
    ``(None, *new_bases)`` feed the graph signature's ``USER_INPUT_MUTATION`` outputs. ``torch.onnx.export`` in torch
    2.13 cannot translate that node at all (its first argument, the OpOverload, is mistaken for a graph value:
    ``KeyError: <bound method OpOverload.name ...>``), whatever the ``custom_translation_table``. This pass replaces
    each such node for a kvops write by one call of ``kvops::<op>_functional`` (arguments passed by name) and points
    the node's consumers at its two outputs, so the program keeps its signature (the mutated caches are still
    outputs).

    Caches must be graph inputs (or aliases of them). A cache recorded as a slice of its base is written back with
    ``aten.slice_scatter``; a cache that is a strided view of a larger allocation (e.g. K and V as ``kv[:, :, 0]``
    and ``kv[:, :, 1]`` of one buffer) raises ``ValueError``: pass K and V as separate tensors to export for ONNX.
    Other ``auto_functionalized_v2`` nodes are left alone.
    """
    ep = ep.run_decompositions()
    graph = ep.graph
    hop = torch.ops.higher_order.auto_functionalized_v2
    renamed: dict[str, str] = {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not hop or node.args[0] not in FUNCTIONAL:
            continue
        op = node.args[0]
        kwargs = dict(node.kwargs)
        bases = kwargs.pop("_all_bases")
        mutable = _mutable_names(op)
        fake_mode = torch._guards.detect_fake_mode([b.meta["val"] for b in bases])
        with graph.inserting_before(node):
            views = {}
            for name in mutable:
                index = kwargs.pop(f"_{name}_base_index")
                kind = _view_kind(kwargs, name)
                if index is None:
                    views[name] = (None, None, None)
                    continue
                base = bases[index]
                if kind is None or kind == "alias":
                    kwargs.pop(f"_{name}_alias", None)
                    views[name] = (base, index, None)
                elif kind == "slice":
                    dim, start, end = (kwargs.pop(f"_{name}_slice_{k}") for k in ("dim", "start", "end"))
                    view = graph.call_function(torch.ops.aten.slice.Tensor, (base, dim, start, end))
                    with fake_mode:
                        view.meta["val"] = torch.ops.aten.slice.Tensor(base.meta["val"], dim, start, end)
                    views[name] = (view, index, (dim, start, end))
                else:
                    raise ValueError(
                        f"kvops.export.functionalize: {op.name()} argument {name} is a strided view of a larger "
                        f"tensor (size {tuple(kwargs[f'_{name}_size'])}, stride {tuple(kwargs[f'_{name}_stride'])}), "
                        f"e.g. K and V as views of one [.., 2, H, D] allocation. Pass k_cache and v_cache as separate "
                        f"tensors to export without mutation."
                    )
            call_kwargs = {k: v for k, v in kwargs.items() if not k.startswith("_")}
            for name in mutable:
                call_kwargs[name] = views[name][0]
            functional = FUNCTIONAL[op]
            new = graph.call_function(functional, (), call_kwargs)
            with fake_mode:
                new.meta["val"] = functional(**{k: (v.meta["val"] if isinstance(v, torch.fx.Node) else v)
                                                for k, v in call_kwargs.items()})
            new_bases = list(bases)
            for i, name in enumerate(mutable):
                view, index, slice_args = views[name]
                if view is None:
                    continue
                out = graph.call_function(operator.getitem, (new, i))
                out.meta["val"] = new.meta["val"][i]
                if slice_args is not None:
                    scattered = graph.call_function(
                        torch.ops.aten.slice_scatter.default, (new_bases[index], out, *slice_args)
                    )
                    with fake_mode:
                        scattered.meta["val"] = torch.ops.aten.slice_scatter.default(
                            new_bases[index].meta["val"], out.meta["val"], *slice_args
                        )
                    out = scattered
                new_bases[index] = out
        for user in list(node.users):  # getitem(node, 1 + i) is the i-th base after the write
            replacement = new_bases[user.args[1] - 1]
            renamed[user.name] = replacement.name
            user.replace_all_uses_with(replacement)
            graph.erase_node(user)
        graph.erase_node(node)
    for spec in ep.graph_signature.output_specs:  # the signature names the nodes it returns
        if getattr(spec.arg, "name", None) in renamed:
            spec.arg.name = renamed[spec.arg.name]
    graph.eliminate_dead_code()
    ep.graph_module.recompile()
    return ep
