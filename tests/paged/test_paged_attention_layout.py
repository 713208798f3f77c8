"""kv_layout of kvops.paged_attention: an HND cache ``[P, H_kv, block_size, D]`` gives what its NHD copy gives.

The inputs come from ``tests/paged/test_paged_attention.py:make_inputs`` (NaN in every unused slot, permuted tables); the HND
caches hold the same tokens (``nhd.transpose(1, 2)`` materialized head-major, plus FlashInfer's joint
``[P, 2, H_kv, block_size, D]`` allocation), and both are checked against the fp64 reference.
"""

import expecttest
import torch

import kvops
from tests.contract import raises_everywhere
from tests.paged.test_paged_attention import FP8, _base, _call, check_close, make_inputs, ref_kwargs, reference


def to_hnd(k_cache, v_cache, joint):
    """The same cache contents head-major: separate ``[P, H, bs, D]`` tensors or views of one ``[P, 2, H, bs, D]``."""
    if joint:
        kv = torch.stack((k_cache, v_cache), 1).transpose(2, 3).contiguous()
        return kv.unbind(1)
    return k_cache.transpose(1, 2).contiguous(), v_cache.transpose(1, 2).contiguous()


class TestHNDAttention(expecttest.TestCase):
    def test_hnd_matches_reference(self):
        cases = [  # (seed, seq_lens, q_lens, block_size, H_q, H_kv, D, dtype, cache dtype, joint)
            (1, [5, 17, 40], [1, 3, 17], 16, 8, 2, 16, torch.float32, None, False),
            (2, [33, 1, 0], [1, 1, 0], 4, 10, 2, 80, torch.bfloat16, None, True),  # GQA 5:1, head_dim 80
            (3, [16, 20], [2, 1], 16, 16, 16, 8, torch.float32, None, True),  # ambiguous H_kv == block_size == 16
            (4, [9, 30], [3, 1], 8, 4, 4, 16, torch.float32, FP8, False),
        ]
        for seed, seq_lens, q_lens, bs, h_q, h_kv, d, dtype, cache_dtype, joint in cases:
            inputs = make_inputs(seed, seq_lens, q_lens, block_size=bs, h_q=h_q, h_kv=h_kv, d=d, dtype=dtype,
                                 cache_dtype=cache_dtype, sinks=seed == 1)
            ref_out, ref_lse = reference(**ref_kwargs(inputs))
            k_hnd, v_hnd = to_hnd(inputs["k_cache"], inputs["v_cache"], joint)
            out, lse = kvops.paged_attention(**{**inputs, "k_cache": k_hnd, "v_cache": v_hnd}, return_lse=True,
                                             kv_layout="HND")
            check_close(self, out, lse, ref_out, ref_lse, dtype)
            nhd_out = kvops.paged_attention(**inputs)
            torch.testing.assert_close(out, nhd_out, atol=0, rtol=0)  # same kernel on a strided view: same values

    def test_compiled_hnd(self):
        inputs = make_inputs(5, [7, 20], [2, 1], block_size=4, h_q=4, h_kv=2, d=16)
        k_hnd, v_hnd = to_hnd(inputs["k_cache"], inputs["v_cache"], joint=True)
        hnd = {**inputs, "k_cache": k_hnd, "v_cache": v_hnd}
        torch._dynamo.reset()
        out = torch.compile(lambda **kw: kvops.paged_attention(**kw, kv_layout="HND"), fullgraph=True,
                            backend="aot_eager")(**hnd)
        torch.testing.assert_close(out, kvops.paged_attention(**inputs), atol=1e-5, rtol=1e-5)


class TestLayoutErrors(expecttest.TestCase):
    def test_hnd_cache_passed_as_nhd_says_so(self):
        k, v = _base()["k_cache"], _base()["v_cache"]  # [6, 4, 2, 8]: block_size 4, H_kv 2
        inputs = _base(k_cache=k.transpose(1, 2).contiguous(), v_cache=v.transpose(1, 2).contiguous(),
                       q=torch.randn(3, 6, 8))  # HND [6, 2, 4, 8] read as NHD: H_kv 4 does not divide 6 query heads
        fn, args = _call(inputs)
        # Read as NHD, block_size 2 also makes the table too short; the metadata error goes first (default mode).
        msg = raises_everywhere(self, ValueError, fn, args)
        self.assertExpectedInline(msg, """kvops.paged_attention: The cache of shape (6, 2, 4, 8) read as kv_layout="NHD" has 4 heads, but its dim of size 2 fits the 6 query heads: it may be an HND cache [num_blocks, num_kv_heads, block_size, head_dim]; if so, pass kv_layout="HND". (Read as NHD, num_heads (6) must be a multiple of num_kv_heads (4) (GQA: query head h reads KV head h // (num_heads // num_kv_heads)).)""")

    def test_unknown_layout(self):
        fn, args = _call(_base(), kv_layout="NDH")
        self.assertExpectedInline(raises_everywhere(self, ValueError, fn, args), """kvops.paged_attention: kv_layout must be "NHD" (caches [num_blocks, block_size, num_kv_heads, head_dim]) or "HND" (caches [num_blocks, num_kv_heads, block_size, head_dim]), got 'NDH'.""")


if __name__ == "__main__":
    expecttest.run_tests() if hasattr(expecttest, "run_tests") else __import__("unittest").main()
