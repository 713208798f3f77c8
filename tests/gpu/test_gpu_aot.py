"""Ahead-of-time compile of kvops' Triton kernels for real NVIDIA targets, without a GPU (docs/gpu.md).

The CI subset of ``python benchmarks/gpu_check.py --aot``: the launchers' plans for light shapes of every kernel on
sm_80, sm_86 (99 KB shared memory per block) and sm_90, and each of the heaviest production tiles (head_dim 256 fp32
prefill with every flag, 128K-context decode, fp8 caches, the attention features, int4 packed attention) on one of
them, compiled to cubins; each must compile, use no local memory (no register spills) and fit the target's shared
memory. The compile runs in a subprocess because the test session runs
the kernels in the Triton interpreter (``TRITON_INTERPRET=1`` replaces ``triton.jit`` at import time).
"""

import json
import os
import pathlib
import subprocess
import sys
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]

_SCRIPT = r"""
import json, sys
from tools import aot, aot_cases
rows, refusals = aot.check(sys.argv[1].split(","), subset=True, workers=2)
print(json.dumps(dict(rows=rows, refusals=refusals, uncovered=aot_cases.flag_coverage(subset=True))))
"""


def _run_subset(targets: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    p = subprocess.run([sys.executable, "-c", _SCRIPT, targets], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    if p.returncode != 0:
        raise AssertionError(f"AOT subprocess failed ({p.returncode}):\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


class AotCompileTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.result = _run_subset("sm_80,sm_86,sm_90")

    def test_every_planned_kernel_compiles_without_spills_within_shared_memory(self):
        rows = self.result["rows"]
        fails = [f"{r['target']} {r['kernel']} {r['spec']}: {r['error']}" for r in rows if r["status"] != "ok"]
        self.assertEqual(fails, [])
        # every kernel kvops launches is in the subset, on every target
        kernels = {r["kernel"] for r in rows}
        self.assertEqual(len(kernels), 17, kernels)
        for target in ("sm_80", "sm_86", "sm_90"):
            self.assertEqual({r["kernel"] for r in rows if r["target"] == target}, kernels)
        for r in rows:
            self.assertGreater(r["regs"], 0)
            self.assertEqual(r["spills"], 0)
            self.assertGreater(r["occupancy"], 0)

    def test_fp8_caches_compile_for_sm80(self):
        # sm_80 has no e4m3 hardware: the kernels decode/encode the bits with integer ops, so fp8 compiles there
        fp8 = [r for r in self.result["rows"] if r["target"] == "sm_80" and "fp8" in r["spec"]]
        self.assertTrue({"_decode_split_kernel", "_rotary_scatter_kernel", "_segment_kernel", "_mla_attention_kernel",
                         "_mla_write_kernel"} <= {r["kernel"] for r in fp8})
        self.assertEqual([r for r in fp8 if r["status"] != "ok"], [])
        self.assertEqual(self.result["refusals"], [])

    def test_every_attention_feature_compiles(self):
        # docs/attention_features.md (and docs/tree-mask.md's masks): each feature in at least one compiled spec of each
        # kernel that takes it
        rows = self.result["rows"]
        for kernel, names in (("_prefill_kernel", ("alibi", "leftpad", "sink_tokens", "rope", "right", "mask",
                                                   "packed")),
                              ("_decode_split_kernel", ("alibi", "leftpad", "sink_tokens", "rope"))):
            for name in names:
                specs = [r for r in rows if r["kernel"] == kernel and name in r["spec"].split("flags=")[1].split(",")]
                self.assertTrue(specs, f"{kernel}: no spec with {name}")
                self.assertEqual([r["error"] for r in specs if r["status"] != "ok"], [])

    def test_mla_real_geometry(self):
        # DeepSeek's MLA (128 heads, rank 512 + rope 64; kvops/triton/mla.py): decode with and without KV splits,
        # prefill, fp8 (sm_80 included), every target of the subset
        rows = [r for r in self.result["rows"] if r["kernel"].startswith("_mla_")]
        for target in ("sm_80", "sm_86", "sm_90"):
            specs = [r["spec"] for r in rows if r["target"] == target]
            for prefix in ("mla decode bf16", "mla prefill fp8", "mla write fp8"):
                self.assertTrue(any(s.startswith(prefix) for s in specs), (target, prefix, specs))
        self.assertTrue(any("splits=auto" in r["spec"] and "ctx=131072" in r["spec"] for r in rows))
        self.assertEqual([r for r in rows if r["status"] != "ok"], [])

    def test_every_boolean_flag_is_compiled_both_ways(self):
        # a flag added to a kernel without a case in tools/aot_cases.py shows up here
        self.assertEqual(self.result["uncovered"], [])


if __name__ == "__main__":
    unittest.main()
