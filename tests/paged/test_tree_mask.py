"""Custom masks among the new keys of ``kvops.paged_attention`` (docs/tree-mask.md, docs/semantics.md §4.2): the
format helpers (``kvops.custom_mask``), against numpy's packbits and FlashInfer's documented examples."""

import numpy as np
import torch
from expecttest import TestCase

from kvops.custom_mask import dense_custom_mask, mask_indptr, packbits, segment_packbits, tree_depths, tree_mask
from kvops.reference.custom_mask import custom_mask_offsets, new_key_visible

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
