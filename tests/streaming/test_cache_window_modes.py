"""Both windows with a sink (``window_mode``) on every streaming cache, and the packed cache's first
chunk of another length, against the dense ``CausalKVCache`` (bit-exact for the dense formats, per-format tolerance
for the quantized ones)."""

import unittest

import torch

import kvops
from kvops.cache import PackedCausalKVCache, RingCausalKVCache
from kvops.export.streaming import init_cursors, streaming_update


def tokens(s, n):
    return torch.arange(s + 1, s + n + 1, dtype=torch.float32).view(1, n, 1, 1)


class TestWindowModes(unittest.TestCase):
    # cache 16, sink 4, window 8, chunks of 4 tokens 1..20; after the chunk at 16 (docs/porting.md)
    WANT = {"tail": list(range(13, 21)), "sink": [1, 2, 3, 4, 17, 18, 19, 20]}

    def test_issue_example_on_every_cache(self):
        for mode, want in self.WANT.items():
            with self.subTest(mode=mode):
                dense = kvops.CausalKVCache(torch.zeros(1, 16, 1, 1), torch.zeros(1, 16, 1, 1), sink_tokens=4,
                                            attention_window_size=8, window_mode=mode)
                ring = RingCausalKVCache(torch.zeros(1, 16, 1, 1), torch.zeros(1, 16, 1, 1), sink_tokens=4,
                                         attention_window_size=8, window_mode=mode)
                packed = PackedCausalKVCache.allocate(1, 16, 1, 1, chunk_tokens=4, quant=None, sink_tokens=4,
                                                      attention_window_size=8, window_mode=mode)
                kc, vc, cur = torch.zeros(1, 16, 1, 1), torch.zeros(1, 16, 1, 1), init_cursors()
                for s in range(0, 20, 4):
                    t = tokens(s, 4)
                    d = dense.update_and_get_attention_kv(t, t, s)
                    r = ring.update_and_get_attention_kv(t, t, s)
                    p = packed.update_and_get_attention_kv(t, t, s)
                    mask, cur = streaming_update(t, t, kc, vc, cur, torch.tensor(s), sink_tokens=4,
                                                 attention_window_size=8, window_mode=mode)
                    self.assertTrue(torch.equal(r.ordered()[0], d.k))
                    self.assertTrue(torch.equal(p.k, d.k))
                    self.assertEqual(kc.flatten()[mask].tolist(), d.k.flatten().tolist())
                self.assertEqual(d.k.flatten().int().tolist(), want)
                self.assertEqual(dense.local_end, 16)  # the sink rows are kept in both modes

    def test_tail_is_the_plain_tail_at_every_step(self):
        # Self-Forcing's slice k[:, max(0, L - W):L] after each write, sink 3, window 5, cache 9, chunks of 2
        c = kvops.CausalKVCache(torch.zeros(1, 9, 1, 1), torch.zeros(1, 9, 1, 1), sink_tokens=3,
                                attention_window_size=5, window_mode="tail")
        for s in range(0, 30, 2):
            view = c.update_and_get_attention_kv(tokens(s, 2), tokens(s, 2), s)
            self.assertTrue(torch.equal(view.k, c.k[:, max(0, c.local_end - 5):c.local_end]))

    def test_recent_window_tokens_is_the_same_in_both_modes(self):
        views = {}
        for mode in ("sink", "tail"):
            c = kvops.CausalKVCache(torch.zeros(1, 12, 1, 1), torch.zeros(1, 12, 1, 1), sink_tokens=2,
                                    attention_window_size=6, window_mode=mode)
            for s in range(0, 18, 3):
                views[mode] = c.update_and_get_attention_kv(tokens(s, 3), tokens(s, 3), s, recent_window_tokens=3)
        self.assertTrue(torch.equal(views["sink"].k, views["tail"].k))


class TestPackedFirstChunk(unittest.TestCase):
    """``first_chunk_tokens``: a 1-token first chunk, then chunks of 3, as a dense cache of the same stream."""

    def run_stream(self, quant, sink, window, mode, keep):
        tol = {None: 0.0, "int8": 0.05, "fp8": 0.3, "int4": 0.5, "int2": 1.5}[quant]
        dense = kvops.CausalKVCache(torch.zeros(1, 10, 2, 16), torch.zeros(1, 10, 2, 16), sink_tokens=sink,
                                    attention_window_size=window, window_mode=mode)
        pc = PackedCausalKVCache(batch_size=1, cache_size=10, num_kv_heads=2, head_dim=16, chunk_tokens=3,
                                 first_chunk_tokens=1, quant=quant, sink_tokens=sink, attention_window_size=window,
                                 window_mode=mode, keep_recent_chunks=keep)
        g, s = torch.Generator().manual_seed(0), 0
        for n in (1, 3, 3, 3, 3, 3, 3):
            k, v = torch.randn(1, n, 2, 16, generator=g), torch.randn(1, n, 2, 16, generator=g)
            for _ in range(2):  # append, then a rewrite (a denoising step)
                want, got = dense.update_and_get_attention_kv(k, v, s), pc.update_and_get_attention_kv(k, v, s)
                self.assertEqual(want[2:], got[2:])
                self.assertEqual(want.k.shape, got.k.shape)
                self.assertLessEqual((want.k - got.k).abs().max().item(), tol, (quant, s))
                self.assertLessEqual((want.v - got.v).abs().max().item(), tol, (quant, s))
            s += n

    def test_against_dense(self):
        for quant in (None, "int8", "int4", "fp8", "int2"):
            for sink, window, mode, keep in ((0, None, "sink", 1), (1, None, "sink", 0), (4, 7, "sink", 1),
                                             (4, 7, "tail", 0)):
                with self.subTest(quant=quant, sink=sink, window=window, mode=mode, keep=keep):
                    self.run_stream(quant, sink, window, mode, keep)

    def test_first_chunk_length_is_checked(self):
        pc = PackedCausalKVCache.allocate(1, 10, 1, 4, chunk_tokens=3, quant=None, first_chunk_tokens=1)
        with self.assertRaisesRegex(ValueError, "must have 1 token .chunk_tokens.*first_chunk_tokens=1"):
            pc.update_and_get_attention_kv(torch.zeros(1, 3, 1, 4), torch.zeros(1, 3, 1, 4), 0)
        self.assertEqual(pc.global_end, 0)
        with self.assertRaisesRegex(ValueError, r"first_chunk_tokens must be an int in \[1, chunk_tokens=3\]"):
            PackedCausalKVCache.allocate(1, 10, 1, 4, chunk_tokens=3, quant=None, first_chunk_tokens=4)


if __name__ == "__main__":
    unittest.main()
