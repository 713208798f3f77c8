"""``examples/streaming_video.py --package DIR``: each cache configuration's pass (``StreamStep``, tensor cursors) as an
AOTInductor package, built by one process and loaded by the next (the warm start torch.compile's caches cannot give a
frozen graph in torch 2.13), and ``aten_streaming_update``, the ``--impl aten`` update of the packaged pass.

Two AOTInductor compiles (one per configuration; a 1-layer model at the example's head geometry, ~15 s of CPU each)
in the first example process, none in the second."""

from __future__ import annotations

import pathlib
import sys
import tempfile
import types
import unittest
from unittest import mock

import torch

from kvops.export import init_cursors, streaming_update
from tests.example_loader import corrupted_copy, load_example, run_example_json

video = load_example("streaming_video")
TINY = ["--layers", "1", "--tokens-per-frame", "1", "--ffn", "64", "--chunks", "8", "--steps", "1", "--repeats", "1",
        "--threads", "1"]  # chunk 3 tokens, window 21: the 8th chunk evicts


def run_example(package_dir: str, out: pathlib.Path) -> dict:
    result, stdout = run_example_json("streaming_video", [*TINY, "--package", package_dir], out)
    assert "compilations: none by torch.compile (an AOTInductor package" in stdout, stdout[-3000:]
    return result


class TestPackagedStream(unittest.TestCase):
    def test_built_then_loaded_within_tolerance(self):
        with tempfile.TemporaryDirectory() as tmp:
            first = run_example(tmp, pathlib.Path(tmp) / "first.json")
            packages = sorted(pathlib.Path(tmp).glob("*.pt2"))
            self.assertEqual(len(packages), 2, packages)  # one per configuration, and no temporary left behind
            second = run_example(tmp, pathlib.Path(tmp) / "second.json")
            self.assertEqual(list(first["configs"]), list(video.CONFIGS))
            for run, verb in ((first, "built"), (second, "loaded")):
                self.assertTrue(run["ok"])
                paths = []
                for config in run["configs"].values():
                    # the package's stream vs the eager CausalKVCache stream, within the example's tolerance
                    self.assertTrue(config["within_tolerance"])
                    self.assertLessEqual(config["max_diff"], 1e-4)
                    self.assertEqual(config["graphs_first"] + config["graphs"], 0)  # torch.compile never ran
                    status, path = config["package"].split(" ", 1)
                    self.assertEqual(status, verb)
                    paths.append(pathlib.Path(path))
                self.assertEqual(sorted(paths), packages)
            for package in packages:  # each checked against the sha256 recorded at build time (test_llm_package:
                video.check_package(package)  # the refusal through PackagedStep)
            bad = corrupted_copy(packages[0], pathlib.Path(tmp) / "bad")
            with self.assertRaisesRegex(SystemExit, f"{bad} does not match the sha256 recorded in {bad.name}.sha256"):
                video.check_package(bad)

    def test_package_name_hashes_what_the_package_bakes_in(self):
        base = {"device": "cpu", "dtype": "float32", "layers": 1, "tokens_per_frame": 8, "ffn": 64, "impl": "kvops"}
        config = video.CONFIGS["lingbot-style sink"]
        path = lambda config=config, **kw: video.package_path(  # noqa: E731
            types.SimpleNamespace(**{**base, **kw}), config, "d")
        self.assertEqual(path(), path())
        names = {path(), path(video.CONFIGS["wan2.1-1.3b (no sink)"]), path(layers=2), path(tokens_per_frame=4),
                 path(ffn=32), path(dtype="bfloat16"), path(impl="aten")}
        self.assertEqual(len(names), 7)
        threads, before = torch.get_num_threads(), path()
        try:
            torch.set_num_threads(threads + 1)  # Inductor's CPP GEMM is generated for a thread count
            self.assertNotEqual(path(), before)
        finally:
            torch.set_num_threads(threads)

    def test_ring_layout_is_refused(self):
        argv = ["streaming_video.py", "--layout", "ring", "--package", "unused"]
        with mock.patch.object(sys, "argv", argv), self.assertRaises(SystemExit) as cm:
            video.main()
        self.assertIn("--package", str(cm.exception))
        self.assertIn("--layout ring", str(cm.exception))


class TestAtenStreamingUpdate(unittest.TestCase):
    def test_equals_streaming_update_bit_for_bit(self):
        """Appends, rewrites and evicting appends (with and without a sink): same caches, mask and cursors as
        ``kvops.export.streaming_update``."""
        for sink in (0, 3):
            caches = {impl: [torch.zeros(2, 10, 3, 8) for _ in "kv"] for impl in ("kvops", "aten")}
            cursors = {impl: init_cursors() for impl in caches}
            gen = torch.Generator().manual_seed(sink)
            for chunk in range(7):  # chunks of 3 rows in a 10-row cache: evictions from the 4th chunk on
                for _ in range(3):  # append, then two rewrites of the same chunk
                    k, v = torch.randn(2, 3, 3, 8, generator=gen), torch.randn(2, 3, 3, 8, generator=gen)
                    results = {}
                    for impl, update in (("kvops", streaming_update), ("aten", video.aten_streaming_update)):
                        results[impl] = update(k, v, *caches[impl], cursors[impl], torch.tensor(3 * chunk),
                                               sink_tokens=sink)
                        cursors[impl] = results[impl][1]
                    for a, b in zip(results["aten"] + tuple(caches["aten"]),
                                    results["kvops"] + tuple(caches["kvops"])):
                        self.assertTrue(torch.equal(a, b), (sink, chunk))
            self.assertEqual(cursors["aten"].tolist(), [21, 10])


if __name__ == "__main__":
    unittest.main()
