"""Model-level check (examples/mla_decode.py): a DeepSeek-V3 attention block from transformers' ``DeepseekV3Config`` /
``DeepseekV3Attention`` with random weights, decoded through kvops' paged latent cache in the absorbed form, gives
transformers' own eager attention outputs within fp32 tolerance: eagerly and under ``torch.compile(fullgraph=True)``
(one graph for every decode step; the traced graph and Inductor's code), at the tiny geometry and DeepSeek-V3's (128 heads, kv_lora_rank 512, rope 64,
nope 128, v 128)."""

import pathlib
import tempfile
import unittest

import torch

from tests.example_loader import load_example, run_example_json

example = load_example("mla_decode")


class TestDeepseekV3Block(unittest.TestCase):
    def check(self, result, rtol=1e-5):
        for ours, ref in zip(result["kvops"], result["reference"]):
            self.assertGreater(float(ref.abs().max()), 1e-2)  # a real signal, not zeros on both sides
            torch.testing.assert_close(ours, ref, rtol=rtol, atol=rtol * float(ref.abs().max()))

    def test_tiny_eager(self):
        for interleave in (True, False):
            for block_size in (1, 4, 16):
                with self.subTest(rope_interleave=interleave, block_size=block_size):
                    self.check(example.run("tiny", block_size=block_size, rope_interleave=interleave))

    def test_deepseek_geometry_eager(self):
        self.check(example.run("deepseek", prompts=(7, 3), new_tokens=2, block_size=16))

    def test_tiny_compiled_one_graph(self):
        torch._dynamo.reset()
        result = example.run("tiny", new_tokens=5, compile_decode=True)
        self.assertEqual(result["graphs"], 1)
        self.check(result)

    def test_tiny_inductor(self):
        torch._dynamo.reset()
        result = example.run("tiny", new_tokens=3, compile_decode=True, inductor=True)
        self.assertEqual(result["graphs"], 1)
        self.check(result)

    def test_command_line(self):
        with tempfile.TemporaryDirectory() as d:
            result, stdout = run_example_json("mla_decode", ["--compile", "--new-tokens", "3"],
                                              pathlib.Path(d) / "r.json")
        self.assertTrue(result["match"], stdout)
        self.assertEqual(result["graphs"], 1)
        self.assertIn("latent cache 48 values per token", stdout)


if __name__ == "__main__":
    unittest.main()
