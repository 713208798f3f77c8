"""transformers integration: ``attn_implementation="kvops"`` with transformers' and kvops' caches on tiny random models.

Models are built from configs with random weights (no downloads), 2 layers, hidden 64-128, keeping each family's
attention features: Llama (GQA 2:1), Qwen2 (GQA 7:1, 14 query / 2 KV heads), Mistral (sliding window 6), Gemma-2
(softcap 50, alternating sliding window 6 / global), gpt-oss (attention sinks, alternating sliding window 6). The
reference is the stock ``sdpa`` implementation where the family supports it, else ``eager`` (transformers disables
sdpa for Gemma-2's softcap and gpt-oss's sinks). Prompts of different lengths are left-padded in one batch, 20 new
tokens are generated greedily; windows of 6 are crossed by the 9-token prompt and by decode.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers",
                                   reason="transformers is not installed (pip install kvops[transformers])")

import kvops.integrations.transformers as kvops_hf  # noqa: E402
from transformers import DynamicCache  # noqa: E402

NEW_TOKENS = 20
PROMPT = 9
COMMON = dict(vocab_size=96, num_hidden_layers=2, max_position_embeddings=128, intermediate_size=128)


def _configs():
    from transformers import Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

    out = {
        "llama": (LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, **COMMON), "sdpa"),
        "qwen2": (Qwen2Config(hidden_size=112, num_attention_heads=14, num_key_value_heads=2, **COMMON), "sdpa"),
        "mistral": (MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, sliding_window=6,
                                  **COMMON), "sdpa"),
        "gemma2": (Gemma2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                sliding_window=6, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"],
                                **COMMON), "eager"),
    }
    try:
        from transformers import GptOssConfig
    except ImportError:  # older transformers without gpt-oss
        return out
    out["gpt_oss"] = (GptOssConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   sliding_window=6, num_local_experts=2, num_experts_per_tok=1,
                                   layer_types=["sliding_attention", "full_attention"], **COMMON), "eager")
    return out


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: one intra-op thread (on a shared 2-core machine, thread oversubscription makes every 64x64 GEMM
    cost milliseconds); restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CONFIGS = _configs()
FAMILIES = list(CONFIGS)
_models: dict = {}


def model_for(family: str, dtype=torch.float32):
    if (family, dtype) not in _models:
        from transformers import AutoModelForCausalLM

        config, _ = CONFIGS[family]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).to(dtype).eval()
        model.generation_config.eos_token_id = None  # always NEW_TOKENS tokens, no EOS suppression or stopping
        if family == "gpt_oss":  # random sinks large enough to matter
            for layer in model.model.layers:
                torch.nn.init.normal_(layer.self_attn.sinks, std=2.0)
        _models[family, dtype] = model
    return _models[family, dtype]


def prompts(batch: int = 2):
    """Prompts of lengths 9 and 6, left-padded to 9 (as ``generate()`` expects)."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, COMMON["vocab_size"], (batch, PROMPT), generator=g)
    mask = torch.ones_like(ids)
    mask[1:, : PROMPT - 6] = 0
    return ids, mask


def make_cache(kind: str, config):
    if kind == "dynamic":
        return DynamicCache(config=config)
    if kind == "hf_static":  # transformers' own StaticCache (its sliding layers return concatenated K/V in prefill)
        from transformers import StaticCache

        return StaticCache(config=config, max_cache_len=PROMPT + NEW_TOKENS)
    if kind == "static":
        return kvops_hf.KvopsStaticCache(config, max_cache_len=PROMPT + NEW_TOKENS)
    return kvops_hf.KvopsPagedCache(config, max_cache_len=PROMPT + NEW_TOKENS, block_size=4)


def generate(model, impl: str, cache=None):
    ids, mask = prompts()
    model.set_attn_implementation(impl)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                             do_sample=False, past_key_values=cache, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


_refs: dict = {}


def reference(family: str):
    if family not in _refs:
        _refs[family] = generate(model_for(family), CONFIGS[family][1])
    return _refs[family]


@pytest.mark.parametrize("cache", ["dynamic", "hf_static", "static", "paged"])
@pytest.mark.parametrize("family", FAMILIES)
def test_generate_matches_stock(family, cache):
    """Greedy tokens identical to stock attention over 20 new tokens; logits within fp32 tolerance."""
    model = model_for(family)
    ref_tokens, ref_logits = reference(family)
    tokens, logits = generate(model, "kvops", make_cache(cache, model.config))
    assert torch.equal(tokens, ref_tokens)
    assert tokens.shape[1] == PROMPT + NEW_TOKENS
    torch.testing.assert_close(logits, ref_logits, atol=2e-5, rtol=1e-5)


def test_bf16_logits_within_tolerance():
    """bf16 (Llama, kvops static cache vs stock sdpa): prefill and decode logits within bf16 tolerance."""
    model = model_for("llama", torch.bfloat16)
    ids, mask = prompts()
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        ref = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation("kvops")
        out = model(input_ids=ids, attention_mask=mask,
                    past_key_values=make_cache("static", model.config)).logits
    real = mask.bool()  # padded query rows are garbage in every implementation
    torch.testing.assert_close(out[real].float(), ref[real].float(), atol=3e-2, rtol=3e-2)


def test_set_attn_implementation_and_from_config():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(CONFIGS["llama"][0], attn_implementation="kvops")
    assert model.config._attn_implementation == "kvops"
    model.set_attn_implementation("sdpa")
    model.set_attn_implementation("kvops")
    assert model.config._attn_implementation == "kvops"


def test_custom_4d_mask_is_rejected():
    model = model_for("llama")
    model.set_attn_implementation("kvops")
    ids, _ = prompts()
    mask4d = torch.ones(2, 1, PROMPT, PROMPT, dtype=torch.bool).tril()
    with pytest.raises(ValueError, match=r"kvops attention: got an attention mask of shape \(2, 1, 9, 9\) and dtype "
                                         r"torch.bool; it needs the \[2, batch, 1, 1\] int32 metadata"):
        model(input_ids=ids, attention_mask=mask4d)


def test_paged_cache_overflow_is_an_error():
    model = model_for("llama")
    model.set_attn_implementation("kvops")
    ids, mask = prompts()
    cache = kvops_hf.KvopsPagedCache(model.config, max_cache_len=PROMPT - 1, block_size=4)
    with pytest.raises(ValueError) as info:
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    assert str(info.value) == (
        "KvopsPagedCache: writing 9 tokens at positions [0, 9) exceeds max_cache_len=8, the tokens each sequence holds "
        "(prompt + generated). Allocate the cache with max_cache_len >= the prompt length + max_new_tokens of the "
        "whole generate() call (this step alone needs 9).")


def test_static_cache_generating_past_max_cache_len_names_it():
    """Before: ``Invalid kvops.cache_write write range: local=[11, 12), kv_cache_size=11`` (the op, not the cache's
    argument). The step that does not fit raises before any layer writes."""
    model = model_for("llama")
    model.set_attn_implementation("kvops")
    ids, mask = prompts()
    cache = kvops_hf.KvopsStaticCache(model.config, max_cache_len=PROMPT + 2)
    snapshots = []

    def keep(*_):  # the caches after each forward (prefill, then decode steps 1 and 2)
        snapshots.append([layer.k.clone() for layer in cache.layers])

    handle = model.register_forward_hook(keep)
    try:
        with torch.no_grad(), pytest.raises(ValueError) as info:
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
                           past_key_values=cache, pad_token_id=0)
    finally:
        handle.remove()
    assert str(info.value) == (
        "KvopsStaticCache: writing 1 token at positions [11, 12) exceeds max_cache_len=11, the tokens each sequence "
        "holds (prompt + generated). Allocate the cache with max_cache_len >= the prompt length + max_new_tokens of "
        "the whole generate() call (this step alone needs 12).")
    assert len(snapshots) == 3 and all(torch.equal(a, layer.k) for a, layer in zip(snapshots[-1], cache.layers))


def test_import_kvops_does_not_import_transformers():
    """No module of kvops outside kvops/integrations imports transformers or kvops.integrations (a static check of
    every import statement: cheaper than a fresh interpreter, and it also covers modules imported lazily)."""
    import ast
    import pathlib

    root = pathlib.Path(kvops_hf.__file__).resolve().parents[1]
    offenders = []
    for path in [*root.rglob("*.py"), *(root.parent / "lowering").rglob("*.py")]:
        if "integrations" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names
                          if n.split(".")[0] == "transformers" or "integrations" in n]
    assert not offenders, offenders


def test_eager_metadata_kept_per_mask_and_recomputed_after_in_place_change():
    """Eager attention builds the paged-attention metadata once per mask tensor (every layer of a forward shares
    it); an in-place change of the mask, or K/V of another geometry, recomputes it: outputs equal those of a
    fresh copy of the mask."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 1, 8, generator=g)
    k, v = torch.randn(2, 2, 12, 8, generator=g), torch.randn(2, 2, 12, 8, generator=g)
    module = torch.nn.Module()
    mask = kvops_hf.kvops_mask(2, 1, 12, q_offset=10, attention_mask=torch.tensor([[0] * 3 + [1] * 9] * 2))

    def attend(m, key=k, value=v):
        return kvops_hf.kvops_attention_forward(module, q, key, value, m)[0]

    first = attend(mask)
    assert hasattr(mask, "_kvops_metadata")
    torch.testing.assert_close(attend(mask), first, rtol=0, atol=0)
    mask[0] = 0  # no padding any more: every row visible
    torch.testing.assert_close(attend(mask), attend(mask.clone()), rtol=0, atol=0)
    assert not torch.equal(attend(mask), first)
    k6, v6 = k[:, :, :11].clone(), v[:, :, :11].clone()  # another capacity with the same mask
    torch.testing.assert_close(attend(mask, k6, v6), attend(mask.clone(), k6, v6), rtol=0, atol=0)


def test_eager_fast_paths_agree_with_the_general_ones():
    """The eager shortcuts of a decode step give what the general code gives: the unpadded mask built from host ints
    equals the tensor formula (int and 0-d tensor ``q_offset``), the token tables reused across forwards are those of
    the current padding, and the static layer's direct row copy writes the rows paged_cache_write writes."""
    for q_offset in (10, torch.tensor(10)):
        fast = kvops_hf.kvops_mask(3, 1, 12, q_offset=q_offset, attention_mask=torch.ones(3, 12, dtype=torch.bool))
        assert fast.dtype == torch.int32 and fast.shape == (2, 3, 1, 1)
        assert fast.view(2, 3).tolist() == [[0, 0, 0], [11, 11, 11]]
    assert kvops_hf.kvops_mask(2, 1, 12, q_offset=10).view(2, 2).tolist() == [[0, 0], [11, 11]]
    for pad in ([0, 0], [3, 1], [0, 0]):  # tables cached by padding: a new padding never reuses another's table
        mask = kvops_hf.kvops_mask(2, 1, 12, q_offset=10,
                                   attention_mask=torch.tensor([[0] * p + [1] * (12 - p) for p in pad]))
        got = kvops_hf._metadata(mask, 2, 12, None, 12, 2, 1, torch.device("cpu"))
        want = kvops_hf._build_metadata(mask, 2, 12, None, 12, 2, 1, torch.device("cpu"))
        for a, b in zip(got, want):
            assert torch.equal(a, b), pad
    config = _configs()["llama"][0]
    cache = kvops_hf.KvopsStaticCache(config, max_cache_len=8)
    head_dim = config.hidden_size // config.num_attention_heads
    cache.early_initialization(2, config.num_key_value_heads, head_dim, torch.float32, "cpu")
    layer = cache.layers[0]
    layer.cumulative_length.fill_(3)
    shape = (2, config.num_key_value_heads, 2, head_dim)
    k, v = torch.randn(shape), torch.randn(shape)
    keys, values = layer.update(k, v)
    assert torch.equal(keys[:, :, 3:5], k) and torch.equal(values[:, :, 3:5], v) and int(layer.cumulative_length) == 5
    assert not keys[:, :, 5:].any() and not keys[:, :, :3].any()


def test_attention_revalidates_when_the_query_changes():
    """The validator's verdict is reused only for the same K/V views, metadata and query geometry: a query with a
    head count that is not a multiple of the KV heads still raises after a good call on the same cache views."""
    g = torch.Generator().manual_seed(5)
    k, v = torch.randn(1, 2, 12, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g)
    mask = kvops_hf.kvops_mask(1, 1, 12, q_offset=11)
    module = torch.nn.Module()
    good = kvops_hf.kvops_attention_forward(module, torch.randn(1, 4, 1, 8, generator=g), k, v, mask)[0]
    assert good.shape == (1, 1, 4, 8)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        kvops_hf.kvops_attention_forward(module, torch.randn(1, 3, 1, 8, generator=g), k, v, mask)


@pytest.mark.parametrize("cache", ["dynamic", "static", "paged"])
def test_generate_under_inference_mode(cache):
    """``generate()`` under ``torch.inference_mode()`` (inference tensors have no version counter and their views no
    ``_base``) gives the tokens it gives under ``torch.no_grad``."""
    model = model_for("llama")
    ids, mask = prompts()
    model.set_attn_implementation("kvops")
    outs = []
    for ctx in (torch.no_grad, torch.inference_mode):
        with ctx():
            outs.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False,
                                       past_key_values=make_cache(cache, model.config), pad_token_id=0))
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], reference("llama")[0])


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_layer_update_with_states_the_storage_does_not_take_raises_and_changes_nothing(kind):
    """States of another batch size, head count, head_dim, rank or dtype than the storage (e.g. a cache reused after
    reset() for a bigger batch) raise a ValueError naming them, before anything is written: before, a batch-2 key
    into a batch-1 cache dropped a row silently, a 3-D key was written transposed, and wrong head counts raised
    torch's reshape error."""
    config = CONFIGS["llama"][0]
    cache = make_cache(kind, config)
    head_dim = config.hidden_size // config.num_attention_heads
    h = config.num_key_value_heads
    good = torch.randn(1, h, 4, head_dim)
    model = model_for("llama")
    model.set_attn_implementation("kvops")
    with torch.no_grad():  # a first forward allocates the storage for batch 1
        model(input_ids=torch.randint(3, 50, (1, 4)), past_key_values=cache)
    layer = cache.layers[0]
    before = (int(layer.cumulative_length), layer.k.clone(), layer.v.clone())
    bad = {"batch": torch.randn(2, h, 1, head_dim), "heads": torch.randn(1, h + 1, 1, head_dim),
           "head_dim": torch.randn(1, h, 1, head_dim // 2), "rank": torch.randn(h, 1, head_dim),
           "dtype": good[:, :, :1].to(torch.bfloat16)}
    for what, key in bad.items():
        with pytest.raises(ValueError) as e:
            layer.update(key, key)
        assert int(layer.cumulative_length) == before[0], what
        assert torch.equal(layer.k, before[1]) and torch.equal(layer.v, before[2]), what
    name = "KvopsStaticCache" if kind == "static" else "KvopsPagedCache"
    assert str(e.value) == (
        f"{name}: key_states has shape (1, {h}, 1, {head_dim}), dtype torch.bfloat16, device cpu; this cache was "
        f"allocated at its first forward for [batch_size=1, num_kv_heads={h}, T, head_dim={head_dim}] torch.float32 "
        f"states on cpu (key and value with the same T). Create a new {name} for this model, batch size or dtype "
        f"(reset() keeps the allocation)."
    )
