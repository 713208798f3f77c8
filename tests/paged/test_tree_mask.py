"""Custom masks among the new keys of ``kvops.paged_attention`` (docs/tree-mask.md, docs/semantics.md §4.2).

* ``TestFormats``: the format helpers (``kvops.custom_mask``) against numpy's packbits and FlashInfer's documented
  examples, and the oracle's reading of a mask.
* ``TestKernels``: the native CPU kernel (the public op) and the composite kernel against the fp64 oracle
  (``kvops/reference/attention.py``), both mask forms, a real 1 + 4 + 16 tree beside short and empty sequences, with
  windows, sink tokens, softcap, ALiBi, sinks, odd shapes; each tree node against causal attention over its own path;
  compile, export, opcheck; ``flash_attn_with_kvcache``.
* ``TestTriton``: the Triton prefill kernel in the interpreter (small shapes).
* ``TestContracts``: the trace-time errors in eager, compile and export; the length's value contract.
"""

import numpy as np
import torch
from expecttest import TestCase

import kvops
from kvops._checks.features import AttnFeatures
from kvops.custom_mask import dense_custom_mask, mask_indptr, packbits, segment_packbits, tree_depths, tree_mask
from kvops.reference.custom_mask import custom_mask_offsets, new_key_visible
from kvops.cpu.paged_attention import paged_attention as composite_kernel
from kvops.reference.attention import reference
from tests.contract import raises_everywhere

TREE = [-1, 0, 0, 0, 0] + [1 + i // 4 for i in range(16)]  # 1 + 4 + 16 nodes


def tree_and_chains():
    """Blocks of 4 sequences: the 1 + 4 + 16 tree, a causal 3 x 3, an empty one, a bidirectional 2 x 2."""
    return [tree_mask(TREE), torch.ones(3, 3, dtype=torch.bool).tril(), torch.zeros(0, 0, dtype=torch.bool),
            torch.ones(2, 2, dtype=torch.bool)]


class TestFormats(TestCase):
    def test_tree_mask_of_a_two_level_tree(self):
        m = tree_mask(TREE)
        self.assertEqual(m.shape, (21, 21))
        self.assertEqual(m.sum(1).tolist(), [1] + [2] * 4 + [3] * 16)  # itself and its ancestors
        self.assertEqual(m[7].nonzero().flatten().tolist(), [0, 1, 7])  # node 7: child of node 1
        self.assertEqual(m[20].nonzero().flatten().tolist(), [0, 4, 20])
        self.assertFalse(m[1, 2] or m[5, 6] or m[5, 2])  # siblings and cousins never see each other
        self.assertEqual(tree_depths(TREE), [0] + [1] * 4 + [2] * 16)
        self.assertTrue(torch.equal(tree_mask([-1, 0, 1, 2]), torch.ones(4, 4, dtype=torch.bool).tril()))  # a chain

    def test_tree_mask_refuses_a_parent_after_its_child(self):
        with self.assertRaises(ValueError) as cm:
            tree_mask([-1, 2, 0])
        self.assertExpectedInline(str(cm.exception), """\
tree_mask: parents[1] = 2; node 0 is the root (parent -1) and every other node's parent must be an earlier node (0 <= parent < 1): list the tree in topological order (e.g. breadth first).""")

    def test_packbits_is_numpys(self):
        g = torch.Generator().manual_seed(0)
        for n in (0, 1, 7, 8, 9, 441):
            x = torch.rand(n, generator=g) > 0.5
            for order in ("little", "big"):
                self.assertEqual(packbits(x, order).tolist(), np.packbits(x.numpy(), bitorder=order).tolist())

    def test_segment_packbits_flashinfers_example(self):
        # FlashInfer's docstring example (bitorder="big"), and the same segments little-endian
        x = torch.tensor([1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1], dtype=torch.bool)
        y, indptr = segment_packbits(x, torch.tensor([0, 4, 7, 11]), bitorder="big")
        self.assertEqual(list(map(bin, y.tolist())), ["0b10110000", "0b100000", "0b11010000"])
        self.assertEqual(indptr.tolist(), [0, 1, 2, 3])
        y, _ = segment_packbits(x, torch.tensor([0, 4, 7, 11]))
        self.assertEqual(y.tolist(), [0b1101, 0b100, 0b1011])

    def test_offsets_and_lengths(self):
        blocks = tree_and_chains()
        cu = torch.tensor([0, 21, 24, 24, 26], dtype=torch.int32)
        self.assertEqual(mask_indptr(cu).tolist(), [0, 441, 450, 450, 454])
        self.assertEqual(mask_indptr(cu, packed=True).tolist(), [0, 56, 58, 58, 59])
        self.assertEqual(custom_mask_offsets([21, 3, 0, 2], packed=True), [0, 56, 58, 58])
        flat = torch.cat([b.flatten() for b in blocks])
        packed, indptr = segment_packbits(flat, mask_indptr(cu))
        self.assertEqual(indptr.tolist(), mask_indptr(cu, packed=True).tolist())

    def test_dense_view_and_oracle_read_both_forms_alike(self):
        blocks = tree_and_chains()
        q_lens = [b.shape[0] for b in blocks]
        cu = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32)
        flat = torch.cat([b.flatten() for b in blocks])
        packed, _ = segment_packbits(flat, mask_indptr(cu))
        dense = dense_custom_mask(flat, None, cu, 21)
        self.assertTrue(torch.equal(dense, dense_custom_mask(None, packed, cu, 21)))
        for form, mask in ((False, flat.tolist()), (True, packed.tolist())):
            offsets = custom_mask_offsets(q_lens, form)
            for b, block in enumerate(blocks):
                n = q_lens[b]
                self.assertTrue(torch.equal(dense[b, :n, :n], block))
                self.assertEqual(int(dense[b].sum()), int(block.sum()))  # nothing outside the block
                got = [[new_key_visible(mask, form, offsets[b], n, i, c) for c in range(n)] for i in range(n)]
                self.assertEqual(got, block.tolist())

    def test_dense_view_compiles_without_graph_breaks(self):
        flat = torch.cat([b.flatten() for b in tree_and_chains()])
        cu = torch.tensor([0, 21, 24, 24, 26], dtype=torch.int32)
        fn = torch.compile(dense_custom_mask, fullgraph=True, backend="eager")
        self.assertTrue(torch.equal(fn(flat, None, cu, 21), dense_custom_mask(flat, None, cu, 21)))


# --- the kernels ---------------------------------------------------------------------------------------------------
def _case(q_lens, ctx, *, h_q=4, h_kv=2, d=16, d_v=None, block_size=8, dtype=torch.float32, seed=0, layout="NHD"):
    """A paged batch whose sequence ``b`` has ``ctx[b]`` cached tokens and ``q_lens[b]`` new rows, with a mask per
    sequence (the 1 + 4 + 16 tree for 21 rows, random blocks otherwise) in both forms; blocks scattered, one spare."""
    g = torch.Generator().manual_seed(seed)
    d_v = d if d_v is None else d_v
    seq = [c + n for c, n in zip(ctx, q_lens)]
    nb = max([-(-s // block_size) for s in seq] + [1]) + 1
    pages = len(q_lens) * nb + 2
    k = torch.randn(pages, block_size, h_kv, d, generator=g).to(dtype)
    v = torch.randn(pages, block_size, h_kv, d_v, generator=g).to(dtype)
    if layout == "HND":  # an HND cache seen as NHD (strides)
        k = k.transpose(1, 2).contiguous().transpose(1, 2)
        v = v.transpose(1, 2).contiguous().transpose(1, 2)
    table = torch.randperm(pages, generator=g)[:len(q_lens) * nb].view(len(q_lens), nb).int()
    cu = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), h_q, d, generator=g).to(dtype)
    blocks = [tree_mask(TREE) if n == 21 else torch.rand(n, n, generator=g) > 0.4 for n in q_lens]
    flat = torch.cat([b.flatten() for b in blocks]) if blocks else torch.zeros(0, dtype=torch.bool)
    packed, _ = segment_packbits(flat, mask_indptr(cu))
    return dict(q=q, k=k, v=v, cu=cu, lens=torch.tensor(seq, dtype=torch.int32), table=table, mask=flat,
                packed=packed, max_q=max(q_lens + [1]))


# (q_lens, cached tokens, options): the tree beside short and empty sequences, windows, softcap, sinks, ALiBi
CASES = [
    ([21, 3, 1, 0, 5], [30, 7, 0, 4, 2], {}),
    ([21], [0], {}),
    ([21, 21], [40, 5], dict(window_left=6)),
    ([9, 4], [12, 3], dict(softcap=5.0, causal=False)),
    ([7], [20], dict(window_left=4, sink_tokens=3)),
    ([1, 1, 2], [9, 0, 3], {}),
    ([6, 21], [3, 11], dict(alibi=True, sinks=True)),
    ([21, 4], [9, 3], dict(rope_theta=1e4, leftpad=True)),  # RoPE at read time counts rows from cache_leftpad
]


def _options(case, opts):
    h_q = case["q"].shape[1]
    out = dict(opts)
    if out.pop("alibi", False):
        out["alibi_slopes"] = torch.linspace(0.1, 0.5, h_q)
    if out.pop("sinks", False):
        out["sinks"] = torch.linspace(-1.0, 1.0, h_q)
    if out.pop("leftpad", False):
        out["cache_leftpad"] = torch.tensor([min(2, int(n)) for n in case["lens"]], dtype=torch.int32)
    return out


class TestKernels(TestCase):
    def check(self, got, ref, tol=2e-5):
        out, lse = got
        self.assertLess((out.double() - ref[0]).abs().max().item(), tol)
        self.assertLess((lse.double() - ref[1]).nan_to_num(0.0, 0.0, 0.0).abs().max().item(), tol)

    def test_native_and_composite_match_the_oracle_in_both_forms(self):
        for q_lens, ctx, opts in CASES:
            c = _case(q_lens, ctx)
            kw = _options(c, opts)
            ref = reference(c["q"], c["k"], c["v"], c["cu"], c["lens"], c["table"], custom_mask=c["mask"], **kw)
            for form in ("custom_mask", "packed_custom_mask"):
                mask = c["mask"] if form == "custom_mask" else c["packed"]
                with self.subTest(q_lens=q_lens, opts=opts, form=form):
                    got = kvops.paged_attention(c["q"], c["k"], c["v"], c["cu"], c["lens"], c["table"], c["max_q"],
                                                return_lse=True, **kw, **{form: mask})
                    self.check(got, ref)
                    self.check(_composite(c, kw, **{form: mask}), ref)

    def test_odd_shapes_and_dtypes(self):
        for shape, dtype, tol in ((dict(h_q=5, h_kv=1, d=80, block_size=1), torch.float32, 2e-5),
                                  (dict(h_q=4, h_kv=4, d=16, block_size=16, layout="HND"), torch.float32, 2e-5),
                                  (dict(h_q=6, h_kv=2, d=32, block_size=8), torch.bfloat16, 3e-2)):
            c = _case([21, 5], [13, 2], dtype=dtype, **shape)
            ref = reference(c["q"], c["k"], c["v"], c["cu"], c["lens"], c["table"], custom_mask=c["mask"])
            with self.subTest(shape=shape, dtype=dtype):
                got = kvops.paged_attention(c["q"], c["k"], c["v"], c["cu"], c["lens"], c["table"], c["max_q"],
                                            return_lse=True, packed_custom_mask=c["packed"])
                self.check(got, ref, tol)
                self.check(_composite(c, {}, custom_mask=c["mask"]), ref, tol)

    def test_each_tree_node_sees_exactly_its_path(self):
        """Every node of the 1 + 4 + 16 tree gets the output of plain causal attention over the cache followed by
        its own root-to-node path (the chain it would be in greedy decoding)."""
        c = _case([21], [10], h_q=4, h_kv=2, d=16, block_size=4)
        out = kvops.paged_attention(c["q"], c["k"], c["v"], c["cu"], c["lens"], c["table"], 21,
                                    custom_mask=c["mask"])
        flat_k = c["k"].view(-1, 2, 16)
        flat_v = c["v"].view(-1, 2, 16)
        rows = torch.arange(31)
        slots = c["table"][0].long()[rows // 4] * 4 + rows % 4
        for node in range(21):
            path, n = [], node
            while n >= 0:
                path.insert(0, n)
                n = TREE[n]
            keys = list(range(10)) + [10 + p for p in path]
            k = flat_k[slots[keys]].repeat_interleave(2, dim=1)
            v = flat_v[slots[keys]].repeat_interleave(2, dim=1)
            w = torch.softmax(torch.einsum("hd,khd->hk", c["q"][node].double(), k.double()) * 16 ** -0.5, -1)
            want = torch.einsum("hk,khd->hd", w, v.double())
            self.assertLess((out[node].double() - want).abs().max().item(), 2e-6, node)

    def test_mask_replaces_causal_whatever_causal_says(self):
        c = _case([5, 3], [4, 0])
        def call(**kw):
            return kvops.paged_attention(c["q"], c["k"], c["v"], c["cu"], c["lens"], c["table"], 5, **kw)

        self.assertTrue(torch.equal(call(custom_mask=c["mask"]), call(custom_mask=c["mask"], causal=False)))
        lower = torch.cat([torch.ones(n, n, dtype=torch.bool).tril().flatten() for n in (5, 3)])
        self.assertTrue(torch.allclose(call(custom_mask=lower), call(), atol=1e-6))  # the causal rule itself
        every = torch.ones(34, dtype=torch.bool)
        self.assertTrue(torch.allclose(call(custom_mask=every), call(causal=False), atol=1e-6))

    def test_compiled_and_exported_calls_take_the_mask(self):
        c = _case([21, 3], [6, 2])
        args = (c["q"], c["k"], c["v"], c["cu"], c["lens"], c["table"], c["packed"])

        def f(q, k, v, cu, lens, table, packed):
            return kvops.paged_attention(q, k, v, cu, lens, table, 21, packed_custom_mask=packed)

        want = f(*args)
        torch._dynamo.reset()
        self.assertTrue(torch.allclose(torch.compile(f, fullgraph=True)(*args), want, atol=1e-6))
        ep = torch.export.export(_Wrap(f), args, strict=False)
        self.assertTrue(torch.allclose(ep.module()(*args), want, atol=1e-6))

    def test_opcheck(self):
        c = _case([21, 2], [3, 1])
        for form, mask in (("custom_mask", c["mask"]), ("packed_custom_mask", c["packed"])):
            torch.library.opcheck(torch.ops.kvops.paged_attention.default,
                                  (c["q"], c["k"], c["v"], c["cu"], c["lens"], c["table"], 21),
                                  {form: mask})

    def test_flash_attn_with_kvcache_takes_the_mask(self):
        """Batch form: every sequence has S_q = 21 new rows (the tree), appended at cache_seqlens."""
        g = torch.Generator().manual_seed(3)
        batch, s_q, h, d, bs = 2, 21, 4, 16, 8
        kc = torch.randn(8, bs, 2, d, generator=g)
        vc = torch.randn(8, bs, 2, d, generator=g)
        table = torch.arange(8, dtype=torch.int32).view(2, 4)
        q = torch.randn(batch, s_q, h, d, generator=g)
        k_new = torch.randn(batch, s_q, 2, d, generator=g)
        v_new = torch.randn(batch, s_q, 2, d, generator=g)
        seqlens = torch.tensor([5, 9], dtype=torch.int32)
        mask = tree_mask(TREE).flatten().repeat(batch)
        kc2, vc2 = kc.clone(), vc.clone()
        out = kvops.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seqlens, block_table=table,
                                            causal=True, custom_mask=mask)
        for b in range(batch):  # the caches after the append, by hand
            for t in range(s_q):
                p = int(seqlens[b]) + t
                kc2[table[b, p // bs], p % bs] = k_new[b, t]
                vc2[table[b, p // bs], p % bs] = v_new[b, t]
        self.assertTrue(torch.equal(kc, kc2) and torch.equal(vc, vc2))
        cu = torch.tensor([0, 21, 42], dtype=torch.int32)
        ref, _ = reference(q.flatten(0, 1), kc2, vc2, cu, seqlens + s_q, table, custom_mask=mask)
        self.assertLess((out.flatten(0, 1).double() - ref).abs().max().item(), 2e-5)


class _Wrap(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


class TestContracts(TestCase):
    """docs/tree-mask.md "Checks": the trace-time errors in eager, compile and export; the length's value contract."""

    def setUp(self):
        self.c = _case([5, 3], [4, 2])

    def raises(self, exc=ValueError, **kw):
        c = self.c

        def f(q, k, v, cu, lens, table):
            return kvops.paged_attention(q, k, v, cu, lens, table, 5, **kw)

        return raises_everywhere(self, exc, f, (c["q"], c["k"], c["v"], c["cu"], c["lens"], c["table"]))

    def test_form_errors(self):
        self.assertExpectedInline(self.raises(custom_mask=torch.ones(34)), """kvops.paged_attention: custom_mask must be a 1-D bool tensor [sum_b q_len_b ** 2] (each sequence's q_len x q_len block of its new keys, row-major, concatenated in batch order), got shape (34,) and dtype torch.float32. Pass mask.to(torch.bool) (True = visible).""")
        self.assertExpectedInline(self.raises(custom_mask=torch.ones(5, 5, dtype=torch.bool)), """kvops.paged_attention: custom_mask must be a 1-D bool tensor [sum_b q_len_b ** 2] (each sequence's q_len x q_len block of its new keys, row-major, concatenated in batch order), got shape (5, 5) and dtype torch.bool. Flatten each sequence's block and concatenate them in batch order: torch.cat([block.flatten() for block in blocks]).""")
        self.assertExpectedInline(self.raises(custom_mask=torch.ones(5, dtype=torch.uint8)), """kvops.paged_attention: custom_mask must be a 1-D bool tensor [sum_b q_len_b ** 2] (each sequence's q_len x q_len block of its new keys, row-major, concatenated in batch order), got shape (5,) and dtype torch.uint8. For FlashInfer's packed bits pass packed_custom_mask.""")
        self.assertExpectedInline(self.raises(packed_custom_mask=torch.ones(5, dtype=torch.bool)), """kvops.paged_attention: packed_custom_mask must be a 1-D uint8 tensor [sum_b ceil(q_len_b ** 2 / 8)] (each sequence's mask block as little-endian bits, padded to whole bytes), got shape (5,) and dtype torch.bool. Pack a bool mask with kvops.custom_mask.segment_packbits(mask, mask_indptr(cu_seqlens_q), bitorder='little'), or pass it as custom_mask.""")
        self.assertExpectedInline(self.raises(custom_mask=self.c["mask"], packed_custom_mask=self.c["packed"]),
                                  """kvops.paged_attention: pass custom_mask (bool) or packed_custom_mask (its bits as uint8), not both (FlashInfer silently ignores custom_mask then).""")

    def test_a_mask_longer_than_any_batch_needs(self):
        # FlashInfer's q_len x kv_len form (it also covers the cached keys) is the usual cause
        full = torch.ones(5 * 9 + 3 * 5, dtype=torch.bool)
        self.assertExpectedInline(self.raises(custom_mask=full), """kvops.paged_attention: custom_mask has 60 elements, more than any batch of these queries needs: sum_b q_len_b ** 2 <= max_seqlen_q * T_q = 5 * 8 = 40. The mask covers each sequence's new keys only; FlashInfer's q_len x kv_len form also covers the cached keys: keep its last q_len columns.""")
        self.assertExpectedInline(self.raises(packed_custom_mask=torch.ones(9, dtype=torch.uint8)), """kvops.paged_attention: packed_custom_mask has 9 bytes, more than any batch of these queries needs: sum_b ceil(q_len_b ** 2 / 8) <= (max_seqlen_q * T_q + 7 * B) / 8 = (5 * 8 + 7 * 2) / 8, at most 6. The mask covers each sequence's new keys only; FlashInfer's q_len x kv_len form also covers the cached keys: keep its last q_len columns.""")

    def test_window_right_is_refused_with_a_mask(self):
        self.assertExpectedInline(self.raises(custom_mask=self.c["mask"], causal=False, window_right=2), """kvops.paged_attention: window_right=2 cannot be combined with custom_mask: it bounds the keys to the right of a query (causal=False), and with a mask every such key is a new key, which the mask decides. Drop window_right (or put the bound into the mask).""")

    def test_length_is_a_value_contract(self):
        c = self.c
        args = (c["q"], c["k"], c["v"], c["cu"], c["lens"], c["table"], 5)
        with self.assertRaises(RuntimeError) as cm:
            kvops.paged_attention(*args, custom_mask=c["mask"][:-1])
        self.assertExpectedInline(str(cm.exception), """kvops.paged_attention: custom_mask has 33 elements, expected 34 (sum_b q_len_b ** 2 elements) for the query lengths [5, 3] of cu_seqlens_q. Pass each sequence's q_len x q_len block of its new keys, flattened and concatenated (torch.cat([block.flatten() for block in blocks])); FlashInfer's q_len x kv_len form also covers the cached keys: keep its last q_len columns.""")
        with self.assertRaises(RuntimeError) as cm:
            kvops.paged_attention(*args, packed_custom_mask=c["packed"][:-1])
        self.assertExpectedInline(str(cm.exception), """kvops.paged_attention: packed_custom_mask has 5 bytes, expected 6 (sum_b ceil(q_len_b ** 2 / 8) bytes) for the query lengths [5, 3] of cu_seqlens_q. Pack the mask with kvops.custom_mask.segment_packbits(mask, mask_indptr(cu_seqlens_q), bitorder='little'): each sequence's block padded to whole bytes.""")
        with kvops.value_checks("async"), self.assertRaises(RuntimeError) as cm:  # torch._assert_async
            kvops.paged_attention(*args, custom_mask=c["mask"][:-1])
        self.assertIn("custom_mask must have sum_b q_len_b ** 2 elements", str(cm.exception))
        with kvops.value_checks("off"), self.assertRaises(RuntimeError) as cm:  # the native kernel checks it itself
            kvops.paged_attention(*args, custom_mask=c["mask"][:-1])
        self.assertIn("custom_mask has 33 elements, expected 34", str(cm.exception))
        # the composite kernel clamps its reads: a short mask gives wrong numbers, never a read out of bounds
        out, _ = _composite(c, {}, custom_mask=c["mask"][:3])
        self.assertFalse(out.isnan().any())


def _composite(c, kw, **mask):
    """The composite CPU kernel on the validated form of a call (what runs without the native build)."""
    kw = dict(kw)
    feats = AttnFeatures(**{k: kw.pop(k) for k in AttnFeatures._fields if k in kw}, **mask)
    d = c["q"].shape[2]
    return composite_kernel(c["q"], c["k"], c["v"], c["cu"], c["lens"], c["table"], c["max_q"], d ** -0.5,
                            kw.pop("causal", True), kw.pop("window_left", -1), kw.pop("softcap", 0.0),
                            kw.pop("sinks", None), None, None, feats)


class TestTriton(TestCase):
    def test_prefill_kernel_in_the_interpreter(self):
        from kvops.triton.paged_attention import paged_attention as triton_kernel

        for q_lens, ctx, opts in CASES:
            c = _case(q_lens, ctx)
            kw = _options(c, opts)
            ref = reference(c["q"], c["k"], c["v"], c["cu"], c["lens"], c["table"], custom_mask=c["mask"], **kw)
            for form in ("custom_mask", "packed_custom_mask"):
                mask = c["mask"] if form == "custom_mask" else c["packed"]
                feats = AttnFeatures(**{k: v for k, v in kw.items() if k in AttnFeatures._fields}, **{form: mask})
                with self.subTest(q_lens=q_lens, opts=opts, form=form):
                    got = triton_kernel(c["q"], c["k"], c["v"], c["cu"], c["lens"], c["table"], c["max_q"],
                                        16 ** -0.5, kw.get("causal", True), kw.get("window_left", -1),
                                        kw.get("softcap", 0.0), kw.get("sinks"), None, None, feats)
                    out, lse = got
                    self.assertLess((out.double() - ref[0]).abs().max().item(), 2e-5)
                    self.assertLess((lse.double() - ref[1]).nan_to_num(0.0, 0.0, 0.0).abs().max().item(), 2e-5)
