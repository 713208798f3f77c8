"""benchmarks/gpu_check.py without a GPU: the command the lent GPU machine runs (``PYTHONPATH=. python3
benchmarks/gpu_check.py --out OUT``) runs its CPU stages, reports every CUDA stage as skipped and leaves its results
under ``--out``; the GPU stages' own checks (tools/gpu_stages.py) run on CPU where they can, so they do not rot
between the rare sessions that are lent a GPU (docs/gpu.md)."""

import itertools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import unittest

import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tools import gpu_oracle, gpu_stages  # noqa: E402


@unittest.skipIf(torch.cuda.is_available(), "the CPU path (a GPU machine runs the CUDA stages instead)")
class TestGpuCheckCpuPath(unittest.TestCase):
    def test_no_install_command_on_cpu(self):
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVOPS_NATIVE")}
        env["PYTHONPATH"] = "."
        with tempfile.TemporaryDirectory() as out:
            p = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--out", out], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=600)
            self.assertEqual(p.returncode, 0, p.stdout[-3000:] + p.stderr[-3000:])
            files = sorted(os.listdir(out))
            result = json.loads((pathlib.Path(out) / "results.json").read_text())
            summary = (pathlib.Path(out) / "summary.txt").read_text()
            log = (pathlib.Path(out) / "log.txt").read_text()
        self.assertEqual(files, ["log.txt", "results.json", "summary.txt"])
        status = {r["stage"]: r["status"] for r in result["stages"]}
        self.assertEqual(status.pop("environment"), "ok")
        self.assertEqual(status.pop("oracle self-check (CPU)"), "ok")
        self.assertEqual(set(status.values()), {"skipped"}, status)
        self.assertGreaterEqual(len(status), 10)
        self.assertEqual(result["facts"]["torch"], torch.__version__)
        for stage in ("oracle: Triton kernels vs fp64 (CUDA)", "CUDA graphs: compiled decode step",
                      "fusion: projection->RoPE->paged write", "timings: attention vs SDPA"):
            self.assertIn(stage, summary)
        self.assertIn("[ok] oracle self-check (CPU)", log)  # stages printed as they finish, into the log too
        self.assertNotIn("kvops_native", p.stdout + p.stderr)


class TestGpuStagesOnCpu(unittest.TestCase):
    def test_fusion_check_sees_one_kernel(self):
        # the same projection -> RoPE -> paged write, compiled for CPU: one C++ kernel, no kvops call
        detail = gpu_stages.fusion_code(None, device="cpu")
        self.assertTrue(detail.startswith("1 generated kernel(s)"), detail)
        self.assertIn("0 kvops call(s), cache == eager: True", detail)

    def test_cudagraph_check_fails_when_cudagraphs_are_skipped(self):
        # on CPU, Inductor skips CUDA graphs (counted in cudagraph_skips): the stage must say so, not pass
        with self.assertRaisesRegex(AssertionError, r"^1 cudagraph skip\(s\)"):
            gpu_stages.cudagraph_decode(None, device="cpu", steps=2, layers=1)

    def test_oracle_cases_cover_every_axis(self):
        cases = list(gpu_oracle.cases())
        attn = [c for c in cases if c[0] == "attention"]
        self.assertEqual({c[1] for c in attn}, {"fp16", "bf16", "fp32", "fp8"})
        self.assertEqual({c[2] for c in attn}, {64, 128, 256})
        self.assertEqual({c[3] for c in attn}, {1, 4, 7, 8})
        self.assertEqual({c[4] for c in attn}, {1, 16, 64})
        self.assertEqual({c[5] for c in attn}, {"NHD", "HND"})
        self.assertEqual({c[6] for c in attn}, {"decode", "prefill"})
        self.assertEqual({f for c in attn for f in c[7]}, {"window", "softcap", "sinks", *gpu_oracle.FEATURES})
        self.assertEqual({c[0] for c in cases}, {"attention", "paged_write", "rotary_write", "transfer", "cache_write",
                                                 "packed", "mla", "mla_write"})
        self.assertEqual({c[1] for c in cases if c[0] == "packed"}, {"int8", "fp8", "int4", "int2"})
        mla = [c for c in cases if c[0] == "mla"]
        self.assertEqual({(c[1], c[3]) for c in mla}, set(itertools.product(("fp16", "bf16", "fp32", "fp8"),
                                                                            ("decode", "prefill"))))
        # interleaved: the first 16 cases already call every family
        self.assertEqual({c[0] for c in cases[:16]}, {c[0] for c in cases})

    def test_mla_cases_pass_on_cpu(self):
        # the MLA families on kvops' CPU kernels: the oracle and the comparisons agree with the semantics
        for case in (("mla", "fp32", 16, "prefill"), ("mla", "fp8", 1, "decode"), ("mla_write", "bf16", 16, "neox")):
            ok, detail = gpu_oracle.run_case(case, "cpu", seed=7)
            self.assertTrue(ok, (case, detail))

    def test_oracle_fails_a_wrong_kernel(self):
        # the attention check must catch a kernel that is off by a little (an fp32 output shifted by 1e-3)
        import kvops

        real = kvops.paged_attention

        def shifted(*args, **kwargs):
            out, lse = real(*args, **kwargs)
            return out + 1e-3, lse

        kvops.paged_attention = shifted
        try:
            ok, _ = gpu_oracle.check_attention("cpu", "fp32", 64, 4, 16, "NHD", "decode", (), seed=0)
        finally:
            kvops.paged_attention = real
        self.assertFalse(ok)
        self.assertTrue(gpu_oracle.check_attention("cpu", "fp32", 64, 4, 16, "NHD", "decode", (), seed=0)[0])


if __name__ == "__main__":
    unittest.main()
