"""Unhappy-path cases of the transformers integration, the StreamingLLM paged cache and the transfer endpoints, registered into
``tests/errors/test_unhappy_caches.py``'s harness by :func:`add_cases` (same contract: the documented exception, the
needles in its message, every tensor byte and cursor unchanged).

Covered: ``KvopsStaticCache`` / ``KvopsPagedCache`` ``reorder_cache`` (beam search), ``crop``, ``update`` with a layer
the cache lacks, a deeper model reusing a cache, padding masks with a hole or too short, ``ExportableDecodeStep``
positions, ``kvops_attention_forward``'s own refusals, ``PagedKVCache.fork`` of an evicted StreamingLLM prefix, and
``KVSender``/``KVReceiver`` arguments refused before anything is sent or allocated (their malformed-message and
fault cases need processes: tests/transfer/test_transfer_malformed.py, tests/transfer/test_transfer_faults.py).
Each cache first holds a prefill of a batch of 2 (5 tokens) from a tiny random Llama (no download). Skipped
(registered as nothing) without transformers.
"""

from __future__ import annotations

import torch

import kvops
from kvops.cache.paged import OutOfBlocksError

try:
    import transformers  # noqa: F401
except ImportError:  # the integration is an extra: without it only the StreamingLLM cases run
    transformers = None

_MODELS: dict = {}


def _model(layers: int = 2):
    """A tiny random Llama (GQA 2:1, head_dim 16) with ``attn_implementation="kvops"``, one per depth."""
    if layers not in _MODELS:
        import kvops.integrations.transformers  # noqa: F401  (registers "kvops")
        from transformers import AutoModelForCausalLM, LlamaConfig

        torch.manual_seed(0)
        config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                             num_hidden_layers=layers, max_position_embeddings=128, intermediate_size=128)
        model = AutoModelForCausalLM.from_config(config).eval()
        model.set_attn_implementation("kvops")
        _MODELS[layers] = model
    return _MODELS[layers]


IDS = torch.randint(3, 90, (2, 5), generator=torch.Generator().manual_seed(0))


def _cache(kind: str, prefill: bool = True):
    import kvops.integrations.transformers as kh

    model = _model()
    cache = (kh.KvopsStaticCache(model.config, max_cache_len=16) if kind == "static"
             else kh.KvopsPagedCache(model.config, max_cache_len=16, block_size=4))
    if prefill:
        with torch.no_grad():
            model(input_ids=IDS, past_key_values=cache)
    return cache


def _state(cache):
    """Everything a kvops cache holds: its layers, and for a paged cache the block manager's lists (reached at a
    depth the snapshot walks)."""
    pool = getattr(cache, "pool", None)
    return {"cache": cache, "rows": getattr(cache, "rows", None),
            **({"free": pool._free, "refs": pool._refs, "seqs": pool._seqs} if pool is not None else {})}


def _forward(cache_kind, model_layers=2, **kw):
    def build():
        cache = _cache(cache_kind)
        model = _model(model_layers)

        def call():
            with torch.no_grad():
                model(input_ids=IDS[:, :1], past_key_values=cache, **kw)
        return _state(cache), call
    return build


def add_cases(case) -> None:
    _streaming_cases(case)
    _transfer_cases(case)
    _package_cases(case)
    if transformers is None:
        return
    for kind in ("static", "paged"):
        name = "KvopsStaticCache" if kind == "static" else "KvopsPagedCache"

        def reorder(beam, kind=kind):
            def build():
                cache = _cache(kind)
                return _state(cache), lambda: cache.reorder_cache(beam)
            return build

        case(f"hf_{kind}_reorder_negative", ValueError, f"{name}.reorder_cache", "beam_idx=[0, -1]", "holds -1",
             "[0, 2)")(reorder(torch.tensor([0, -1])))
        case(f"hf_{kind}_reorder_short", ValueError, "beam_idx=[1] has 1 entries", "batch_size=2",
             "len(beam_idx) == 2")(reorder(torch.tensor([1])))
        case(f"hf_{kind}_reorder_long", ValueError, "beam_idx=[0, 1, 0] has 3 entries", "batch_size=2")(
            reorder(torch.tensor([0, 1, 0])))
        case(f"hf_{kind}_reorder_out_of_range", ValueError, "beam_idx=[0, 5]", "holds 5")(
            reorder(torch.tensor([0, 5])))
        case(f"hf_{kind}_reorder_float", TypeError, "beam_idx", "torch.float32", "beam_idx.long()")(
            reorder(torch.tensor([0.0, 1.0])))
        case(f"hf_{kind}_reorder_2d", ValueError, "beam_idx must be 1-D", "(1, 2)")(
            reorder(torch.tensor([[0, 1]])))
        case(f"hf_{kind}_reorder_none", TypeError, "beam_idx must be a 1-D LongTensor", "NoneType")(reorder(None))
        case(f"hf_{kind}_reorder_list_of_floats", TypeError, "beam_idx", "[0.0, 1.0]")(reorder([0.0, 1.0]))
        case(f"hf_{kind}_crop_positive", ValueError, f"{name}.crop(3)", "negative number")(
            (lambda k: lambda: (lambda c: (_state(c), lambda: c.crop(3)))(_cache(k)))(kind))
        case(f"hf_{kind}_crop_past_start", ValueError, f"{name}.crop(-9)", "holds only 5 tokens")(
            (lambda k: lambda: (lambda c: (_state(c), lambda: c.crop(-9)))(_cache(k)))(kind))
        case(f"hf_{kind}_deeper_model", ValueError, "num_hidden_layers=4", "holds 2 layers", "nothing was written",
             "model.config")(_forward(kind, 4))
        case(f"hf_{kind}_update_layer_past_the_cache", ValueError, "layer_idx=2 is not a layer of this cache",
             "holds 2 layers")((lambda k: lambda: (lambda c: (_state(c), lambda: c.update(
                 torch.zeros(2, 2, 1, 16), torch.zeros(2, 2, 1, 16), 2)))(_cache(k)))(kind))
        hole = torch.ones(2, 6, dtype=torch.long)
        hole[0, 2] = 0
        case(f"hf_{kind}_mask_hole", ValueError, "attention_mask row 0 has a hole", "position 2",
             "left and right padding")(_forward(kind, attention_mask=hole))
        case(f"hf_{kind}_mask_short", ValueError, "attention_mask has 4 columns", "position 5",
             "at least 6 columns")(_forward(kind, attention_mask=torch.ones(2, 4, dtype=torch.long)))
        case(f"hf_{kind}_states_batch", ValueError, "key_states has shape (3, 2, 1, 16)", "batch_size=2")(
            (lambda k: lambda: (lambda c: (_state(c), lambda: c.layers[0].update(
                torch.zeros(3, 2, 1, 16), torch.zeros(3, 2, 1, 16))))(_cache(k)))(kind))

        def step(position, kind=kind):
            def build():
                import kvops.integrations.transformers as kh

                cache = _cache(kind)
                module = kh.ExportableDecodeStep(_model(), cache)

                def call():
                    with torch.no_grad():
                        module(IDS[:, :1], position)
                return {"module": module, **_state(cache)}, call
            return build

        case(f"hf_{kind}_export_step_negative_position", ValueError, "cache position -1 is negative",
             "cache_position")(step(torch.tensor([-1])))
        case(f"hf_{kind}_export_step_position_past_end", ValueError, "positions [16, 17)", "max_cache_len=16")(
            step(torch.tensor([16])))
        case(f"hf_{kind}_export_step_float_position", TypeError, "cache_position must be an integer tensor",
             "torch.float32")(step(torch.tensor([5.0])))
        case(f"hf_{kind}_export_step_int_position", TypeError, "cache_position must be an integer tensor",
             "got int")(step(5))
        case(f"hf_{kind}_export_step_2d_position", ValueError, "cache_position must be [T] or [1]", "(1, 1)")(
            step(torch.tensor([[5]])))

    def paged_out_of_blocks():
        """A fork's allocation fails half-way (injected: the pool runs out on the second ``extend``): the block
        manager, the rows and the table are as before (before: freed rows and forked ids stayed)."""
        cache = _cache("paged", prefill=False)
        with torch.no_grad():
            _model()(input_ids=torch.cat([IDS, IDS]), past_key_values=cache)  # batch 4
        pool, real, calls = cache.pool, cache.pool.extend, []

        def extend(seq, n):
            calls.append(seq)
            if len(calls) == 2:
                pool._raise_out_of_blocks(n // 4, f"extending sequence {seq!r} by {n} tokens")
            return real(seq, n)

        pool.extend = extend
        return _state(cache), lambda: cache.reorder_cache(torch.tensor([0, 0, 0, 1]))

    case("hf_paged_reorder_allocation_fails", OutOfBlocksError, "out of blocks", "nothing was allocated")(
        paged_out_of_blocks)

    def attention(**over):
        def build():
            import kvops.integrations.transformers as kh

            module = torch.nn.Module()
            module.is_causal = True
            args = dict(module=module, query=torch.zeros(1, 4, 1, 16), key=torch.zeros(1, 2, 3, 16),
                        value=torch.zeros(1, 2, 3, 16), attention_mask=None)
            args.update(over)
            return {k: v for k, v in args.items() if isinstance(v, torch.Tensor)}, \
                lambda: kh.kvops_attention_forward(**args)
        return build

    case("hf_attention_dropout", ValueError, "dropout=0.1", "model.eval()")(attention(dropout=0.1))
    case("hf_attention_custom_4d_mask", ValueError, "attention mask of shape (1, 1, 1, 3)", "torch.float32",
         "2-D padding mask")(attention(attention_mask=torch.zeros(1, 1, 1, 3)))
    case("hf_attention_gqa", ValueError, "query has 3 heads and key/value 2 KV heads", "multiple")(
        attention(query=torch.zeros(1, 3, 1, 16)))

    def export_sliding():
        import kvops.integrations.transformers as kh
        from transformers import MistralConfig

        config = MistralConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=96,
                               num_hidden_layers=1, sliding_window=4, intermediate_size=128)
        cache = kh.KvopsStaticCache(config, max_cache_len=8)
        return _state(cache), lambda: kh.ExportableDecodeStep(_model(), cache, batch_size=1)

    case("hf_export_step_sliding_cache", ValueError, "without sliding-window layers", "KvopsSlidingLayer")(
        export_sliding)
    case("hf_export_step_no_batch_size", ValueError, "the cache is not initialized; pass batch_size")(
        lambda: (lambda c: (_state(c), lambda: __import__("kvops.integrations.transformers", fromlist=["x"])
                            .ExportableDecodeStep(_model(), c)))(_cache("static", prefill=False)))


def _streaming_cases(case) -> None:
    """``PagedKVCache.fork`` of a StreamingLLM sequence whose window moved past evicted blocks."""

    def streaming():
        cache = kvops.PagedKVCache(16, 16, 2, 16, window_left=63, sink_tokens=4)
        cache.add_sequence(0)
        cache.prepare({0: 200})
        cache.prepare({0: 1})  # blocks 1..7 evicted (-1)
        return cache

    def fork(n):
        def build():
            cache = streaming()
            return {"free": cache._free, "refs": cache._refs, "seqs": cache._seqs}, lambda: cache.fork(0, 1, n)
        return build

    case("streaming_fork_evicted_prefix", ValueError, "PagedKVCache.fork: num_tokens=32", "blocks [1]",
         "already evicted", "num_tokens=192 or more")(fork(32))
    case("streaming_fork_evicted_window", ValueError, "num_tokens=128", "blocks [4, 5, 6, 7]")(fork(128))
    case("streaming_fork_unknown_parent", ValueError, "unknown sequence 7")(
        lambda: (lambda c: ({"seqs": c._seqs}, lambda: c.fork(7, 8)))(streaming()))
    case("streaming_fork_partial_block", ValueError, "whole blocks", "num_tokens=200")(fork(200))
    case("streaming_fork_existing_child", ValueError, "sequence 0 already exists")(
        lambda: (lambda c: ({"seqs": c._seqs}, lambda: c.fork(0, 0)))(streaming()))


def _transfer_cases(case) -> None:
    """Endpoint arguments (no process group needed: they are refused before anything is posted)."""
    import math

    from kvops.cache import PagedKVCache, RollingKVCache
    from kvops.transfer import KVReceiver, KVSender, TransferGroups

    groups = TransferGroups((0,), (1,))

    def receiver(**kw):
        cache = PagedKVCache(4, 4, 2, 8)
        return cache, KVReceiver(groups, 0, cache, 2, **kw)

    def build_receive(request_id, num_tokens=4):
        def build():
            cache, r = receiver()
            return {"free": cache._free, "seqs": cache._seqs, "ready": r.ready}, lambda: r.receive(request_id,
                                                                                                   num_tokens)
        return build

    for label, timeout in (("negative", -1), ("zero", 0), ("inf", math.inf), ("nan", math.nan), ("bool", True)):
        case(f"transfer_sender_timeout_{label}", ValueError, "timeout_s must be a finite number of seconds > 0",
             repr(timeout))(lambda t=timeout: ((), lambda: KVSender(groups, 0, [torch.zeros(4, 4, 2, 8)],
                                                                    [torch.zeros(4, 4, 2, 8)], 2, timeout_s=t)))
        case(f"transfer_receiver_timeout_{label}", ValueError, "timeout_s must be a finite number", repr(timeout))(
            lambda t=timeout: ((), lambda: receiver(timeout_s=t)))
    case("transfer_connect_timeout_negative", ValueError, "connect: timeout_s", "-1")(
        lambda: (lambda r: ((), lambda: r.connect(timeout_s=-1)))(receiver()[1]))
    case("transfer_receive_request_id_bool", ValueError, "request_id must be an int in [0, 1073741823]", "True")(
        build_receive(True))
    case("transfer_receive_request_id_negative", ValueError, "request_id must be an int", "-1")(build_receive(-1))
    case("transfer_receive_request_id_float", ValueError, "request_id must be an int", "1.0")(build_receive(1.0))
    case("transfer_receive_num_tokens_negative", ValueError, "num_tokens must be a non-negative int", "-4")(
        build_receive(5, -4))
    case("transfer_receive_num_tokens_bool", ValueError, "num_tokens must be a non-negative int", "True")(
        build_receive(5, True))
    case("transfer_send_short_block_table", ValueError, "block_table of shape (1,) covers 4 tokens",
         "num_tokens=9")(lambda: ((), lambda: KVSender(groups, 0, [torch.zeros(4, 4, 2, 8)], [torch.zeros(4, 4, 2, 8)],
                                                          2).send(5, 9, torch.zeros(1, dtype=torch.int32))))
    case("transfer_receiver_heads", ValueError, "caches hold 2 KV heads but total_kv_heads=8")(
        lambda: ((), lambda: KVReceiver(groups, 0, PagedKVCache(4, 4, 2, 8), 8)))
    case("transfer_sender_tp_rank", ValueError, "prefill tp_rank=3 is outside [0, 1)")(
        lambda: ((), lambda: KVSender(groups, 3, [torch.zeros(4, 4, 2, 8)], [torch.zeros(4, 4, 2, 8)], 2)))
    case("transfer_plan_float_heads", TypeError, "total_kv_heads must be an int", "8.0")(
        lambda: ((), lambda: __import__("kvops.transfer", fromlist=["x"]).heads_per_rank(8.0, 2)))
    case("transfer_plan_float_chunk", TypeError, "chunked_prefill_size must be an int", "100.5")(
        lambda: ((), lambda: __import__("kvops.transfer", fromlist=["x"]).staging_grid_tokens(100.5, 16)))
    case("transfer_plan_negative_start", ValueError, "start >= 0", "start=-3")(
        lambda: ((), lambda: __import__("kvops.transfer", fromlist=["x"]).compute_grid_segments(-3, 2, 0, 8)))
    case("transfer_plan_negative_bytes", ValueError, "writer_bytes needs non-negative counts", "num_tokens=-1")(
        lambda: ((), lambda: __import__("kvops.transfer", fromlist=["x"]).writer_bytes(-1, 2, 3, 4)))
    case("rolling_allocate_float_window", TypeError, "window_size must be an int", "2.5")(
        lambda: ((), lambda: RollingKVCache.allocate(1, 2.5, 2, 8)))


def _package_cases(case) -> None:
    """``examples/llm_serving.py``'s ``PackagedStep`` (a stand-in package: no AOTInductor compile) refuses inputs of
    other shapes or dtypes than it was built for before the package runs; a corrupted package: tests/export/test_llm_package.py
    (it needs a built one)."""
    import tempfile
    import types

    def build(**bad):
        from tests.example_loader import load_example

        llm = load_example("llm_serving")
        args = types.SimpleNamespace(device="cpu", dtype="float32", layers=1, vocab=256, max_batch=2, token_budget=4,
                                     max_prompt=8, max_new=4, block_size=4, impl="kvops")
        step = llm.PackagedStep(None, args, tempfile.gettempdir())  # (nothing is written there)
        calls = []
        step.package = lambda *tensors: calls.append(1)
        k, v = torch.zeros(6, 4, llm.H_KV, llm.HEAD_DIM), torch.zeros(6, 4, llm.H_KV, llm.HEAD_DIM)
        meta = {"slot_mapping": torch.zeros(4, dtype=torch.long), "cu_seqlens_q": torch.zeros(4, dtype=torch.int32),
                "seq_lens": torch.zeros(3, dtype=torch.int32), "block_table": torch.zeros(3, 2, dtype=torch.int32)}
        ids = torch.zeros(4, dtype=torch.long)
        step.signature = llm.input_signature([("input_ids", ids), ("positions", ids), ("k_caches[0]", k),
                                              ("v_caches[0]", v), *meta.items()])
        meta.update(bad)
        return {"calls": calls, "k": k, "v": v}, lambda: step(ids, ids, [k], [v], meta)

    case("package_step_block_table_shape", ValueError, "block_table is [[3, 5], 'torch.int32', 'cpu']",
         "was built for [[3, 2]")(lambda: build(block_table=torch.zeros(3, 5, dtype=torch.int32)))
    case("package_step_seq_lens_dtype", ValueError, "seq_lens", "torch.int64")(
        lambda: build(seq_lens=torch.zeros(3, dtype=torch.int64)))
