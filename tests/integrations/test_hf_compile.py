"""transformers integration under ``torch.compile(fullgraph=True)`` and ``torch.export`` (tiny random models of
``test_hf_integration``): a compiled 20-step greedy decode loop compiles at most 2 graphs and yields the eager
tokens; a decode step exports and its exported program reproduces the eager logits."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install kvops[transformers])")

from tests.inductor_utils import code_facts  # noqa: E402
from tests.integrations.test_hf_integration import (  # noqa: E402
    COMMON,
    FAMILIES,
    NEW_TOKENS,
    make_cache,
    model_for,
    one_thread,  # noqa: F401  (autouse fixture)
    prompts,
    reference,
)


def decode(model, input_ids, attention_mask, position_ids, cache):
    return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 past_key_values=cache, use_cache=True).logits[:, -1]


def greedy(model, cache, step):
    """Eager prefill, then ``NEW_TOKENS - 1`` decode steps through ``step``; returns the generated tokens."""
    ids, mask = prompts()
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    model.set_attn_implementation("kvops")
    with torch.no_grad():
        logits = decode(model, ids, mask, pos, cache)
        out = [logits.argmax(-1)]
        for _ in range(NEW_TOKENS - 1):
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1)
            pos = pos[:, -1:] + 1
            logits = step(model, out[-1][:, None], mask, pos, cache)
            out.append(logits.argmax(-1))
    return torch.stack(out, 1)


CASES = [(family, "static") for family in FAMILIES] + [("gemma2", "paged")]


@pytest.mark.parametrize("family,cache", CASES)
def test_compiled_decode_two_graphs(family, cache):
    """fullgraph Dynamo capture of the decode step (fake rules of every kvops op included): <= 2 graphs over 19
    decode steps, tokens identical to stock attention."""
    model = model_for(family)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    tokens = greedy(model, make_cache(cache, model.config), torch.compile(decode, fullgraph=True, backend=counter))
    ref_tokens, _ = reference(family)
    assert torch.equal(tokens, ref_tokens[:, -NEW_TOKENS:])
    assert counter.frame_count <= 2, counter.frame_count


def test_inductor_fuses_rope_into_cache_write():
    """Inductor, Llama layer 0 with KvopsStaticCache: k_proj -> RoPE -> ``cache.update`` (``kvops.paged_cache_write``
    at slots from the tensor cursor) and v_proj -> write are lowered into generated kernels, no extern kvops write
    call; the caches equal eager's bit for bit."""
    from torch._inductor.utils import fresh_inductor_cache, run_and_get_code
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = model_for("llama")
    attn, rotary = model.model.layers[0].self_attn, model.model.rotary_emb
    kv_eager, kv_compiled = make_cache("static", model.config), make_cache("static", model.config)
    x = torch.randn(2, 1, model.config.hidden_size)

    def step(x, cos, sin, cache):
        shape = (*x.shape[:-1], -1, attn.head_dim)
        q = attn.q_proj(x).view(shape).transpose(1, 2)
        k = attn.k_proj(x).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        keys, _ = cache.update(k, attn.v_proj(x).view(shape).transpose(1, 2), 0)
        return q, keys.sum()

    with torch.no_grad():
        cos, sin = rotary(x, torch.full((2, 1), 4))
        for kv in (kv_eager, kv_compiled):
            kv.layers[0].lazy_initialization(x.new_zeros(2, 2, 0, attn.head_dim), x.new_zeros(2, 2, 0, attn.head_dim))
            kv.layers[0].cumulative_length.fill_(4)
        expected = step(x, cos, sin, kv_eager)
        torch._dynamo.reset()
        with fresh_inductor_cache():
            got, codes = run_and_get_code(torch.compile(step, fullgraph=True), x, cos, sin, kv_compiled)
    code = "\n".join(codes)
    torch.testing.assert_close(got, expected)
    assert torch.equal(kv_compiled.layers[0].k, kv_eager.layers[0].k)
    assert torch.equal(kv_compiled.layers[0].v, kv_eager.layers[0].v)
    assert "torch.ops.kvops.paged_cache_write" not in code and "cpp_pybinding" in code, code_facts(code)


class DecodeStep(torch.nn.Module):
    """A decode step with the cache's tensors registered as buffers (as transformers' own export recipe does); a
    sliding layer's Python-int cursor is baked in: the program serves this one position (see
    ``test_exported_decode_step_serves_every_position`` for kvops' every-position program)."""

    def __init__(self, model, cache):
        super().__init__()
        self.model, self.cache = model, cache
        for i, layer in enumerate(cache.layers):
            for name in ("k", "v", "block_table", "cumulative_length"):
                if hasattr(layer, name) and not (name == "block_table" and i > 0):
                    self.register_buffer(f"{name}{i}", getattr(layer, name), persistent=False)

    def forward(self, input_ids, attention_mask, position_ids):
        return decode(self.model, input_ids, attention_mask, position_ids, self.cache)


@pytest.mark.parametrize("family,cache", CASES)
def test_export_decode_step(family, cache):
    """``torch.export`` of one decode step after an eager prefill; the exported program's logits equal eager's."""
    model = model_for(family)
    model.set_attn_implementation("kvops")
    kv = make_cache(cache, model.config)
    ids, mask = prompts()
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        nxt = decode(model, ids, mask, pos, kv).argmax(-1)[:, None]
        args = (nxt, torch.cat([mask, mask.new_ones(2, 1)], 1), pos[:, -1:] + 1)
        eager_kv = copy.deepcopy(kv)
        expected = decode(model, *args, eager_kv)
        ep = torch.export.export(DecodeStep(model, kv), args, strict=True)
        got = ep.module()(*args)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert any("kvops.paged_attention" in o for o in ops)
    assert any("kvops.cache_write" in o or "kvops.paged_cache_write" in o for o in ops), ops


def _reference_steps(model, steps: int):
    """sdpa + DynamicCache: prefill of the left-padded prompts, then ``steps`` decode steps of fixed tokens; returns
    (prompt ids, mask, positions, decode tokens, [last-position logits per forward])."""
    from transformers import DynamicCache

    ids, mask = prompts()
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    toks = torch.randint(3, 96, (2, steps), generator=torch.Generator().manual_seed(2))
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        dc = DynamicCache(config=model.config)
        out = [decode(model, ids, mask, pos, dc)]
        m, p = mask, pos
        for i in range(steps):
            m, p = torch.cat([m, m.new_ones(2, 1)], 1), p[:, -1:] + 1
            out.append(decode(model, toks[:, i:i + 1], m, p, dc))
    return ids, mask, pos, toks, out


def _prefilled_step(model, cache_kind: str, max_len: int):
    """An ``ExportableDecodeStep`` over a kvops cache holding the prompts; the fixed ``[B, max_len]`` padding mask."""
    import kvops.integrations.transformers as kvops_hf

    ids, mask, pos, toks, ref = _reference_steps(model, 4)
    model.set_attn_implementation("kvops")
    kv = (kvops_hf.KvopsStaticCache(model.config, max_cache_len=max_len) if cache_kind == "static"
          else kvops_hf.KvopsPagedCache(model.config, max_cache_len=max_len, block_size=4))
    step = kvops_hf.ExportableDecodeStep(model, kv, batch_size=2)
    full = torch.zeros(2, max_len, dtype=torch.long)
    full[:, :mask.shape[1]] = mask
    with torch.no_grad():
        torch.testing.assert_close(step(ids, torch.tensor([0]), full, pos)[:, -1], ref[0], atol=1e-5, rtol=1e-5)
    return step, full, pos, toks, ref


def _run_steps(run, full, pos, toks, ref):
    """Decode ``toks`` one position per call through ``run`` (one program), comparing with sdpa's logits."""
    full, p = full.clone(), pos
    for i in range(toks.shape[1]):
        full[:, pos.shape[1] + i] = 1
        p = p[:, -1:] + 1
        with torch.no_grad():
            got = run(toks[:, i:i + 1], torch.tensor([pos.shape[1] + i]), full, p)[:, -1]
        torch.testing.assert_close(got, ref[i + 1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cache", ["static", "paged"])
def test_exported_decode_step_serves_every_position(cache):
    """One ``torch.export`` program of ``ExportableDecodeStep`` (the position an input: ``cache_position``) decodes 4
    successive positions with sdpa's logits. Before: the cursor was a Python int baked into the program, which served
    the traced position only and silently gave wrong logits at the next ones (max diff 12-25)."""
    step, full, pos, toks, ref = _prefilled_step(model_for("llama"), cache, 16)
    args = (toks[:, :1], torch.tensor([pos.shape[1]]), full, pos[:, -1:] + 1)
    with torch.no_grad():
        ep = torch.export.export(step, args, strict=True)
    assert not [n for n in ep.graph.nodes if "_local_scalar_dense" in str(n.target)]  # no host read of the position
    run = ep.module()
    _run_steps(run, full, pos, toks, ref)
    # a position outside [0, max_cache_len - T] fails at the program's assert, before any cursor or row is written
    # (before: -1 wrote the last row of another sequence and set every cursor to 0; 16 overwrote the cursors first)
    before = {name: b.clone() for name, b in run.named_buffers()}
    for bad in (-1, 16):
        with pytest.raises(RuntimeError, match="cache_position"), torch.no_grad():
            run(toks[:, :1], torch.tensor([bad]), full, pos[:, -1:] + 1)
        assert all(torch.equal(b, before[name]) for name, b in run.named_buffers()), bad



def test_aoti_decode_step_serves_every_position(tmp_path):
    """One AOTInductor package of ``ExportableDecodeStep`` (a 1-layer Llama, ``KvopsStaticCache``, prefilled eagerly
    before export) decodes 4 successive positions with sdpa's logits; the package carries the cache as its own
    mutable buffers. Before: the K/V views the cache returned (stored attributes, not registered buffers) were
    lifted as constants, which AOTInductor copies, so the package attended K/V frozen at export time (max diff 0.11
    from the first decode step)."""
    from torch._inductor import aoti_compile_and_package, aoti_load_package
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, **{**COMMON,
                                                                                          "num_hidden_layers": 1})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    step, full, pos, toks, ref = _prefilled_step(model, "static", 16)
    args = (toks[:, :1], torch.tensor([pos.shape[1]]), full, pos[:, -1:] + 1)
    with torch.no_grad():
        ep = torch.export.export(step, args, strict=True)
    assert not [s for s in ep.graph_signature.input_specs if s.kind.name == "CONSTANT_TENSOR"
                and s.target.endswith(("keys", "values"))], ep.graph_signature  # K/V read through the buffers
    package = aoti_load_package(aoti_compile_and_package(ep, package_path=str(tmp_path / "decode.pt2")))
    _run_steps(package, full, pos, toks, ref)



def _decode_history(kind: str) -> list[tuple[int, torch.Tensor]]:
    """One compiled decode step reused with a fresh cache of ``kind`` per (max_cache_len, dtype) of a history (eager
    prefill, 2 decode steps each); returns (graphs compiled so far, tokens) after each cache."""
    import kvops.integrations.transformers as kvops_hf
    from transformers import StaticCache

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("eager")
    step, out = torch.compile(decode, fullgraph=True, backend=counter), []
    for max_len, dtype in ((29, torch.float32), (40, torch.float32), (33, torch.bfloat16), (64, torch.float32)):
        model = model_for("llama", dtype)
        model.set_attn_implementation("kvops" if kind == "kvops" else "sdpa")
        cache = (kvops_hf.KvopsStaticCache(model.config, max_cache_len=max_len) if kind == "kvops"
                 else StaticCache(config=model.config, max_cache_len=max_len))
        ids, mask = prompts()
        pos = (mask.cumsum(-1) - 1).clamp_min(0)
        with torch.no_grad():
            toks = [decode(model, ids, mask, pos, cache).argmax(-1)]
            for _ in range(2):
                mask, pos = torch.cat([mask, mask.new_ones(2, 1)], 1), pos[:, -1:] + 1
                toks.append(step(model, toks[-1][:, None], mask, pos, cache).argmax(-1))
        out.append((counter.frame_count, torch.stack(toks, 1)))
    return out


def test_compiled_step_reused_across_max_cache_len_and_dtype():
    """A compiled decode step reused with new ``KvopsStaticCache``s of other ``max_cache_len`` values and dtypes (29,
    40 fp32; 33 bf16; 64 fp32) compiles as many graphs as transformers' StaticCache + sdpa after every cache (2, 3,
    4, 4: the new length and dtype each recompile once, as for StaticCache; no Dynamo failure; once kvops' cursor
    was a Python int guarded as ``seen == 37``, and a reused step failed in ``produce_guards`` with ``sources must
    not be empty``), with StaticCache's tokens."""
    kvops_run, hf_run = _decode_history("kvops"), _decode_history("hf_static")
    assert [n for n, _ in kvops_run] == [n for n, _ in hf_run] == [2, 3, 4, 4], (kvops_run, hf_run)
    for (_, got), (_, want) in zip(kvops_run, hf_run):
        assert torch.equal(got, want), (got, want)
