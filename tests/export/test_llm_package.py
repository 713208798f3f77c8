"""``examples/llm_serving.py --package DIR``: the compiled step as an AOTInductor package, built by one process and
loaded by the next (the warm start torch.compile's caches cannot give a frozen graph in torch 2.13), and
``kvops.native.native_in_aoti_packages``, under which the package calls kvops' native CPU attention.

One AOTInductor compile (a 1-layer model at the example's geometry; ~20-40 s of CPU) and two example processes."""

from __future__ import annotations

import json
import pathlib
import tempfile
import types
import unittest
import zipfile

import torch
from torch._inductor import aoti_load_package

import kvops.native
from tests.example_loader import corrupted_copy, load_example, run_example_json

llm = load_example("llm_serving")
TINY = ["--layers", "1", "--vocab", "256", "--requests", "3", "--max-prompt", "20", "--max-new", "4",
        "--repeats", "1", "--threads", "1"]


def run_example(package_dir: str, out: pathlib.Path) -> dict:
    return run_example_json("llm_serving", [*TINY, "--package", package_dir], out)[0]


class TestPackagedServing(unittest.TestCase):
    def test_built_then_loaded_tokens_identical_and_native_attention(self):
        with tempfile.TemporaryDirectory() as tmp:
            first = run_example(tmp, pathlib.Path(tmp) / "first.json")
            packages = sorted(pathlib.Path(tmp).glob("*.pt2"))
            self.assertEqual(len(packages), 1, packages)  # and no temporary left behind
            self.assertEqual(first["package"], f"built {packages[0]}")
            second = run_example(tmp, pathlib.Path(tmp) / "second.json")
            self.assertEqual(second["package"], f"loaded {packages[0]}")
            # greedy tokens of the package equal eager's, in the building and in the loading process
            self.assertTrue(first["identical"] and second["identical"])
            self.assertEqual(first["graphs_first"] + second["graphs_first"], 0)  # torch.compile never ran
            with zipfile.ZipFile(packages[0]) as z:  # the package's extern calls (proxy executor nodes)
                externs = json.loads(z.read(next(n for n in z.namelist() if n.endswith("wrapper.json"))))
            targets = [node["node"]["target"] for node in externs["nodes"]]
            self.assertEqual(targets, ["kvops::_paged_attention_native"])  # native_in_aoti_packages, one layer
            # the inputs it was built for, which every call (the first of a loading process too) is checked against
            recorded = json.loads(aoti_load_package(str(packages[0])).get_metadata()["kvops_inputs"])
            self.assertEqual(list(recorded), ["input_ids", "positions", "k_caches[0]", "v_caches[0]", "slot_mapping",
                                              "cu_seqlens_q", "seq_lens", "block_table"])
            self.assertEqual(recorded["block_table"], [[7, 2], "torch.int32", "cpu"])
            # its sha256 is recorded beside it; flipped weight bytes (stale zip CRC) are refused at load, naming the
            # file and the cure, before AOTInductor loads it (before: loaded, and gave other logits)
            self.assertEqual(llm.digest_path(packages[0]).read_text().strip(), llm.file_digest(packages[0]))
            bad = corrupted_copy(packages[0], pathlib.Path(tmp) / "bad")
            args = types.SimpleNamespace(device="cpu", dtype="float32", layers=1, vocab=256, max_batch=2,
                                         token_budget=4, max_prompt=8, max_new=4, block_size=4, impl="kvops")
            step = llm.PackagedStep(None, args, str(bad.parent))
            step.path = bad
            ids = torch.zeros(4, dtype=torch.long)
            meta = {"slot_mapping": ids, "cu_seqlens_q": ids, "seq_lens": ids, "block_table": ids}
            with self.assertRaises(SystemExit) as cm:
                step(ids, ids, [], [], meta)
            self.assertEqual(str(cm.exception), (
                f"--package: {bad} does not match the sha256 recorded in {bad.name}.sha256 when it was built: the "
                f"file was changed or corrupted; delete {bad.name} and {bad.name}.sha256 to rebuild it"))
            self.assertIsNone(step.package)
            llm.digest_path(bad).unlink()
            with self.assertRaisesRegex(SystemExit, f"{bad.name} has no readable digest record {bad.name}.sha256"):
                llm.check_package(bad)

    def test_package_name_hashes_what_the_package_bakes_in(self):
        base = {"device": "cpu", "dtype": "float32", "layers": 1, "vocab": 256, "max_batch": 6, "token_budget": 32,
                "max_prompt": 20, "max_new": 4, "block_size": 16, "impl": "kvops"}
        tmp = tempfile.TemporaryDirectory()
        self.addCleanup(tmp.cleanup)
        path = lambda **kw: llm.PackagedStep(None, types.SimpleNamespace(**{**base, **kw}), tmp.name).path  # noqa: E731
        self.assertEqual(path(), path())
        names = {path(), path(layers=2), path(token_budget=16), path(dtype="bfloat16"), path(impl="aten")}
        self.assertEqual(len(names), 5)
        threads, before = torch.get_num_threads(), path()
        try:
            torch.set_num_threads(threads + 1)  # Inductor's CPP GEMM is generated for a thread count
            self.assertNotEqual(path(), before)
        finally:
            torch.set_num_threads(threads)


class TestPackagedStepInputs(unittest.TestCase):
    def test_other_shapes_are_refused_before_the_package_runs(self):
        """The package indexes with the shapes it was built for (AOTInductor checks none at run time): a call with
        another shape, dtype or device raises ValueError naming the input, and the package is not called."""
        args = types.SimpleNamespace(device="cpu", dtype="float32", layers=1, vocab=256, max_batch=2, token_budget=4,
                                     max_prompt=8, max_new=4, block_size=4, impl="kvops")
        with tempfile.TemporaryDirectory() as tmp:
            step = llm.PackagedStep(None, args, tmp)
            calls = []
            step.package = lambda *tensors: calls.append(tensors) or torch.zeros(3, dtype=torch.long)
            k, v = torch.zeros(6, 4, llm.H_KV, llm.HEAD_DIM), torch.zeros(6, 4, llm.H_KV, llm.HEAD_DIM)
            meta = {"slot_mapping": torch.zeros(4, dtype=torch.long), "cu_seqlens_q": torch.zeros(4, dtype=torch.int32),
                    "seq_lens": torch.zeros(3, dtype=torch.int32), "block_table": torch.zeros(3, 2, dtype=torch.int32)}
            ids, positions = torch.zeros(4, dtype=torch.long), torch.zeros(4, dtype=torch.long)
            # what a loaded package's metadata holds (test_built_then_loaded... checks a real one records it)
            step.signature = llm.input_signature([("input_ids", ids), ("positions", positions), ("k_caches[0]", k),
                                                  ("v_caches[0]", v), *meta.items()])
            step(ids, positions, [k], [v], meta)
            step(ids, positions, [k], [v], meta)  # the built shapes: served
            for bad in ({"block_table": torch.zeros(3, 5, dtype=torch.int32)},
                        {"seq_lens": torch.zeros(3, dtype=torch.int64)}):
                with self.assertRaises(ValueError) as cm:
                    step(ids, positions, [k], [v], {**meta, **bad})
                self.assertIn(next(iter(bad)), str(cm.exception))
            with self.assertRaises(ValueError) as cm:
                step(ids, positions, [torch.zeros(7, 4, llm.H_KV, llm.HEAD_DIM)], [v], meta)
            self.assertEqual(str(cm.exception), (
                f"PackagedStep: k_caches[0] is [[7, 4, 2, 64], 'torch.float32', 'cpu'] (shape, dtype, device), but "
                f"{step.path.name} was built for [[6, 4, 2, 64], 'torch.float32', 'cpu']: pass inputs of those "
                f"shapes, or build another package (other arguments)"))
            self.assertEqual(len(calls), 2)


class TestNativeInAotiPackages(unittest.TestCase):
    def test_use_native_under_aot_compilation(self):
        """Outside the context AOTInductor compilation gets the composite (packages that run without kvops); inside,
        the native kernel when it is available; the setting is restored on exit, also after an error."""
        from torch._inductor.virtualized import V

        with V.set_aot_compilation(True):
            self.assertFalse(kvops.native.use_native())
            with kvops.native.native_in_aoti_packages():
                self.assertEqual(kvops.native.use_native(), kvops.native.available())
            self.assertFalse(kvops.native.use_native())
            with self.assertRaises(KeyError), kvops.native.native_in_aoti_packages():
                raise KeyError
            self.assertFalse(kvops.native.use_native())
        self.assertEqual(kvops.native.use_native(), kvops.native.available())


if __name__ == "__main__":
    unittest.main()
