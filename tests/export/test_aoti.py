"""AOTInductor packages of both examples' steps (two compiles for the whole suite, shared by every test here).

- the LLM decode step (``examples/llm_serving.py``'s model on a ``PagedKVCache``): greedy tokens equal eager's over
  several decode steps, caches within fp32 tolerance;
- the streaming chunk step (``examples/streaming_video.py``'s blocks on ``kvops.export.streaming_update``): one package
  runs the whole stream (appends, denoising rewrites, context passes, eviction after the sink) and matches eager;
- both packages load and run in a fresh interpreter that never imports kvops (nothing must be imported first).

Exported with default settings: under AOTInductor compilation ``kvops.paged_attention`` selects its composite CPU
kernel (``kvops.native.use_native``), so the package calls no kvops op, not even the native kernel's.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap
import unittest


import torch
from torch._inductor import aoti_compile_and_package, aoti_load_package


from tests.export.test_export_models import DecodeStep, LLMSession, StreamSession


def setUpModule():
    global TMP, LLM_PACKAGE, STREAM_PACKAGE
    TMP = tempfile.TemporaryDirectory()
    session = LLMSession()
    ep = torch.export.export(DecodeStep(session.model), session.decode_inputs())
    LLM_PACKAGE = aoti_compile_and_package(ep, package_path=os.path.join(TMP.name, "decode.pt2"))
    stream = StreamSession()
    ep = torch.export.export(stream.step, stream.example_inputs())
    STREAM_PACKAGE = aoti_compile_and_package(ep, package_path=os.path.join(TMP.name, "stream.pt2"))


def tearDownModule():
    TMP.cleanup()


class TestDecodePackage(unittest.TestCase):
    def test_decode_steps_match_eager(self):
        package = aoti_load_package(LLM_PACKAGE)
        eager, compiled = LLMSession(), LLMSession()
        for _ in range(6):
            args = eager.decode_inputs()
            with torch.no_grad():
                expected = DecodeStep(eager.model)(*args)[0]
            got = package(*compiled.decode_inputs())[0]
            self.assertTrue(torch.equal(got, expected), (got, expected))
            eager.accept(expected)
            compiled.accept(got)
            for a, b in zip(compiled.cache.k_caches + compiled.cache.v_caches,
                            eager.cache.k_caches + eager.cache.v_caches):
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


class TestStreamPackage(unittest.TestCase):
    def test_whole_stream_matches_eager(self):
        package = aoti_load_package(STREAM_PACKAGE)
        session = StreamSession()
        outs, k, v = session.run(package, replay=True)  # caches == eager updates of the package's K/V, bit for bit
        eager_outs, eager_k, eager_v = session.run(session.step)
        self.assertEqual(len(outs), 18)  # 6 chunks x (2 denoising steps + context pass); chunks 4 and 5 evict
        for got, expected in zip(outs, eager_outs):
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
        for got, expected in zip(k + v, eager_k + eager_v):
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    def test_bad_position_raises_and_writes_nothing(self):
        """The package keeps the step's position checks as device-side asserts in its generated code (the argument
        and the fix, without the values an ExportedProgram gives, see lowering/inductor_checks.py) and writes nothing,
        without kvops."""
        package = aoti_load_package(STREAM_PACKAGE)
        x, k, v, cursors, _ = StreamSession().example_inputs()
        with self.assertRaisesRegex(RuntimeError, r"current_chunk_start is past cursors\[0\] \(global_end\)"):
            package(x, k, v, cursors, torch.tensor(8))  # a gap: positions [0, 8) never written
        self.assertFalse(any(c.any() for c in k + v))


class TestLoadWithoutKvops(unittest.TestCase):
    def test_packages_run_in_a_process_that_never_imports_kvops(self):
        llm, stream = LLMSession(), StreamSession()
        inputs = {"llm": llm.decode_inputs(), "stream": stream.example_inputs()}
        path = pathlib.Path(TMP.name) / "inputs.pt"
        torch.save(inputs, path)
        script = textwrap.dedent(f"""
            import sys, torch
            from torch._inductor import aoti_load_package
            torch.set_num_threads({torch.get_num_threads()})  # the parent's: a parallel reduction splits by threads
            inputs = torch.load({str(path)!r})
            out = {{"llm": aoti_load_package({LLM_PACKAGE!r})(*inputs["llm"]),
                   "stream": aoti_load_package({STREAM_PACKAGE!r})(*inputs["stream"])}}
            assert "kvops" not in sys.modules, "kvops was imported"
            torch.save((out, inputs), {str(path)!r})
        """)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env,
                              cwd=TMP.name)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        out, after = torch.load(path)
        expected = {"llm": aoti_load_package(LLM_PACKAGE)(*inputs["llm"]),
                    "stream": aoti_load_package(STREAM_PACKAGE)(*inputs["stream"])}
        for key in ("llm", "stream"):
            for got, want in zip(out[key], expected[key]):
                self.assertTrue(torch.equal(got, want), key)
            for got, want in zip(torch.utils._pytree.tree_leaves(after[key]),
                                 torch.utils._pytree.tree_leaves(inputs[key])):
                self.assertTrue(torch.equal(got, want), key)  # the same in-place cache writes in both processes


if __name__ == "__main__":
    unittest.main()
