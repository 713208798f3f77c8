"""transformers' other ``generate()`` modes with ``attn_implementation="kvops"``: beam search, assisted /
prompt-lookup decoding, packed sequences, ``output_attentions``, and ``generate()``'s own compile, on the tiny random
models of ``test_hf_integration`` (no downloads), against sdpa and transformers' own caches."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (pip install kvops[transformers])")

import kvops.integrations.transformers as kvops_hf  # noqa: E402
from tests.integrations.test_hf_integration import CONFIGS, model_for, one_thread, prompts  # noqa: E402,F401

NEW = 8


def run_generate(model, impl, cache=None, ids=None, mask=None, **kwargs):
    if ids is None:
        ids, mask = prompts()
    model.set_attn_implementation(impl)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                              past_key_values=cache, pad_token_id=0, **kwargs)


@pytest.mark.parametrize("cache", ["static", "paged"])
def test_beam_search_matches_sdpa(cache):
    """3 beams over a left-padded batch of 2: tokens identical to sdpa + DynamicCache. Before: KvopsStaticCache
    returned other tokens (transformers' reorder replaced ``keys`` with copies the layer never wrote again) and
    KvopsPagedCache raised a block_table error. Block size 4 with a 9-token prompt: beams fork inside partly filled
    blocks, so the copy-on-write path runs."""
    model = model_for("llama")
    ref = run_generate(model, "sdpa", num_beams=3)
    kv = (kvops_hf.KvopsStaticCache(model.config, max_cache_len=9 + NEW) if cache == "static"
          else kvops_hf.KvopsPagedCache(model.config, max_cache_len=9 + NEW, block_size=4))
    assert torch.equal(run_generate(model, "kvops", kv, num_beams=3), ref)


def test_paged_beam_reorder_shares_full_blocks_and_copies_the_partial_one():
    """Reorder ``[0, 0, 2]`` at length 6 (block_size 4): rows 0 and 1 share row 0's full block, row 1's partial block
    is a copy of row 0's, row 1's old blocks are freed and reused; every layer's K/V rows equal the parent's."""
    model = model_for("llama")
    model.set_attn_implementation("kvops")
    kv = kvops_hf.KvopsPagedCache(model.config, max_cache_len=12, block_size=4)
    ids = torch.randint(3, 96, (3, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=kv)
    pool, before = kv.pool, [kv.pool.block_ids(s) for s in kv.rows]
    rows_before = [[layer.keys[torch.tensor(b)].reshape(-1, *layer.keys.shape[2:])[:6].clone() for b in before]
                   for layer in kv.layers]
    kv.reorder_cache(torch.tensor([0, 0, 2]))
    after = [pool.block_ids(s) for s in kv.rows]
    assert after[0] == before[0] and after[2] == before[2]
    assert after[1][0] == before[0][0] and pool.ref_count(before[0][0]) == 2  # shared full block
    assert after[1][1] not in before[0] and pool.ref_count(after[1][1]) == 1  # a private copy of the partial one
    assert torch.equal(kv.block_table, torch.tensor(after, dtype=torch.int32))
    for layer, rows in zip(kv.layers, rows_before):
        for i, parent in enumerate([0, 0, 2]):
            got = layer.keys[torch.tensor(after[i])].reshape(-1, *layer.keys.shape[2:])[:6]
            assert torch.equal(got, rows[parent])


@pytest.mark.parametrize("cache", ["static", "paged"])
def test_reorder_accepts_what_transformers_caches_accept(cache):
    """``beam_idx`` as generate() passes it (int64), as int32 (``index_select`` takes it, so transformers' caches do)
    or as a list of ints: the same K/V rows; the storage keeps its address (invalid ones:
    tests/unhappy_integrations.py)."""
    model = model_for("llama")
    model.set_attn_implementation("kvops")
    ids = torch.randint(3, 96, (3, 6), generator=torch.Generator().manual_seed(3))
    rows = []
    for beam in (torch.tensor([2, 0, 0]), torch.tensor([2, 0, 0], dtype=torch.int32), [2, 0, 0]):
        kv = (kvops_hf.KvopsStaticCache(model.config, max_cache_len=12) if cache == "static"
              else kvops_hf.KvopsPagedCache(model.config, max_cache_len=12, block_size=4))
        with torch.no_grad():
            model(input_ids=ids, past_key_values=kv)
        layer = kv.layers[1]
        before = layer.keys.data_ptr()
        kv.reorder_cache(beam)
        assert layer.keys.data_ptr() == before
        with torch.no_grad():
            rows.append(model(input_ids=ids[:, :1], past_key_values=kv).logits)
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[0], rows[2])


@pytest.mark.parametrize("cache", ["static", "paged"])
def test_prompt_lookup_decoding_matches_greedy(cache):
    """Prompt-lookup (assisted) decoding crops the cache after every rejected draft: tokens identical to sdpa's
    greedy decoding. Before: ``AttributeError: 'KvopsStaticLayer' object has no attribute 'crop'``. A repetitive
    prompt makes drafts of 3 tokens that are partly accepted."""
    model = model_for("llama")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]])
    mask = torch.ones_like(ids)
    ref = run_generate(model, "sdpa", ids=ids, mask=mask)
    kv = (kvops_hf.KvopsStaticCache(model.config, max_cache_len=11 + NEW + 3) if cache == "static"
          else kvops_hf.KvopsPagedCache(model.config, max_cache_len=11 + NEW + 3, block_size=4))
    crops = []
    original = type(kv).crop

    def crop(self, n):
        crops.append(n)
        return original(self, n)

    type(kv).crop = crop
    try:
        out = run_generate(model, "kvops", kv, ids=ids, mask=mask, prompt_lookup_num_tokens=3)
    finally:
        type(kv).crop = original
    assert torch.equal(out, ref)
    assert any(n < 0 for n in crops), crops  # some drafts were rejected (the cursor really moved back)


def test_crop_errors():
    model = model_for("mistral")  # every layer a sliding window of 6
    model.set_attn_implementation("kvops")
    kv = kvops_hf.KvopsStaticCache(model.config, max_cache_len=16)
    with torch.no_grad():
        model(input_ids=torch.randint(3, 96, (1, 5)), past_key_values=kv)
        kv.crop(-2)  # nothing evicted yet: a cursor move
        assert kv.get_seq_length() == 3
        model(input_ids=torch.randint(3, 96, (1, 5)), past_key_values=kv)
    with pytest.raises(ValueError) as info:
        kv.crop(-1)
    assert str(info.value) == (
        "KvopsStaticCache.crop(-1): a sliding-window layer (window 6) holding 8 tokens has evicted the tokens a "
        "rollback needs; assisted / prompt-lookup decoding past the window needs transformers' DynamicCache (past "
        "recording).")
    with pytest.raises(ValueError, match=r"KvopsStaticCache.crop\(2\): pass a negative number of tokens"):
        kv.crop(2)


def test_packed_sequences_do_not_attend_across_the_boundary():
    """Two sequences in one row (position_ids restarting at 0, no mask, no cache): each one's logits equal it run
    alone, as with sdpa. Before: the second sequence's logits differed by ~20 (it attended to the first)."""
    model = model_for("llama")
    g = torch.Generator().manual_seed(4)
    a, b = torch.randint(3, 96, (1, 7), generator=g), torch.randint(3, 96, (1, 5), generator=g)
    position_ids = torch.cat([torch.arange(7), torch.arange(5)])[None]
    model.set_attn_implementation("kvops")
    with torch.no_grad():
        packed = model(input_ids=torch.cat([a, b], 1), position_ids=position_ids, use_cache=False).logits
        alone = [model(input_ids=x, use_cache=False).logits for x in (a, b)]
    torch.testing.assert_close(packed, torch.cat(alone, 1), atol=2e-5, rtol=1e-5)


def test_unrepresentable_mask_function_raises():
    """A mask function kvops cannot represent (bidirectional here) raises instead of being ignored."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(CONFIGS["llama"][0])  # the shared config stays causal
    config.is_causal = False
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="kvops").eval()
    with torch.no_grad(), pytest.raises(ValueError, match="lets some query see keys that are not one contiguous"):
        model(input_ids=torch.randint(3, 96, (1, 4)), use_cache=False)


def test_output_attentions_warns_like_sdpa(caplog):
    model = model_for("llama")
    model.set_attn_implementation("kvops")
    logger = logging.getLogger("kvops.integrations.transformers")
    logger.addHandler(caplog.handler)
    try:
        with torch.no_grad():
            out = model(input_ids=torch.randint(3, 96, (1, 4)), output_attentions=True)
    finally:
        logger.removeHandler(caplog.handler)
    assert "`kvops` attention does not support `output_attentions=True`" in caplog.text
    assert all(a is None for a in out.attentions or ())


@pytest.mark.parametrize("cache", ["hf_static", "static"])
def test_generate_compile_is_one_graph(cache):
    """``generate()``'s own compile (CompileConfig, fullgraph) of the decode forward: one graph over the whole
    decode, as with transformers' StaticCache (the cursor is a tensor: no guard on a position); tokens equal
    sdpa's. Before: kvops compiled 2 graphs (a guard on the Python-int cursor, then a dynamic int)."""
    from transformers import CompileConfig, StaticCache

    model = model_for("llama")
    ref = run_generate(model, "sdpa")
    kv = (StaticCache(config=model.config, max_cache_len=9 + NEW) if cache == "hf_static"
          else kvops_hf.KvopsStaticCache(model.config, max_cache_len=9 + NEW))
    config = CompileConfig(fullgraph=True, backend="eager", mode=None)
    config._compile_all_devices = True
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    for attr in ("_compiled_call", "_last_compile_config"):
        if hasattr(model, attr):
            delattr(model, attr)
    out = run_generate(model, "sdpa" if cache == "hf_static" else "kvops", kv, compile_config=config)
    assert torch.equal(out, ref)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_padding_mask_with_a_hole_in_the_async_mode():
    """Under ``kvops.value_checks("async")`` the padding-mask contract is a ``torch._assert_async`` (no host read;
    ``RuntimeError`` on CPU) instead of the eager ``ValueError`` (tests/unhappy_integrations.py); a valid left-padded
    mask passes. Before, a hole gave logits 0.06-0.25 away from sdpa."""
    import kvops

    model = model_for("llama")
    model.set_attn_implementation("kvops")
    ids, mask = prompts()
    hole = mask.clone()
    hole[0, 4] = 0
    with torch.no_grad(), kvops.value_checks("async"):
        model(input_ids=ids, attention_mask=mask)
        with pytest.raises(RuntimeError, match="attention_mask .* has a hole"):
            model(input_ids=ids, attention_mask=hole)
        with pytest.raises(RuntimeError, match="does not cover the queries"):
            model(input_ids=ids, attention_mask=mask[:, :5])
