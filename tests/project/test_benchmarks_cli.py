"""Every benchmark's command line: ``--help`` answers without importing torch (well under a second), every option has
help text, the description is whole sentences and cites no internal issue numbers, every benchmark on the shared
harness has ``--json``; ``plots.py`` says it is a helper. Then the harness's output (benchmarks/_harness.py): two
cheap benchmarks' ``--quick --json`` documents have the documented shape and their printed lines fit in 120 columns;
the harness's spread, interleaving order, targets and verdict, on made-up figures.

Generic over ``benchmarks/*.py``: a new benchmark is checked as soon as it exists. Each runs in its own subprocess
(all at once), through ``runpy`` as ``__main__`` with ``--help``, recording the parsers it builds and whether torch
got imported.
"""

import json
import pathlib
import subprocess
import sys
import tempfile
import types
import unittest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))
HELPERS = {"plots.py"}  # imported by the benchmarks, not run: says so when run
NOT_ON_HARNESS = {"gpu_check.py"}  # a staged check of a GPU machine with its own --out files, not a timing table

SCRIPT = r"""
import argparse, contextlib, io, json, runpy, sys, time
results = {}
parsers = []
original = argparse.ArgumentParser.parse_args
def recording(self, *args, **kwargs):
    parsers.append(self)
    return original(self, *args, **kwargs)
argparse.ArgumentParser.parse_args = recording
for path in sys.argv[1:]:
    sys.argv = [path, "--help"]
    out, err = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    code = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as e:
            code = e.code
    seconds = time.perf_counter() - t0
    options = [(a.option_strings, a.help) for p in parsers for a in p._actions if a.option_strings]
    results[path] = dict(code=code if isinstance(code, (int, type(None))) else str(code), stdout=out.getvalue(),
                         stderr=err.getvalue(), seconds=seconds, options=options,
                         descriptions=[p.description for p in parsers],
                         heavy=[m for m in ("torch", "kvops", "numpy") if m in sys.modules])
print(json.dumps(results))
"""


class TestBenchmarkCommandLines(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(path)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, cwd=ROOT) for path in BENCHMARKS]
        cls.results = {}
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=300)
            assert proc.returncode == 0, stderr
            cls.results.update({pathlib.Path(k).name: v for k, v in json.loads(stdout.splitlines()[-1]).items()})

    def test_help_answers_without_importing_torch(self):
        self.assertGreaterEqual(len(self.results), 7)
        for name, r in self.results.items():
            with self.subTest(name):
                self.assertEqual(r["heavy"], [], f"{name} --help imported {r['heavy']} (parse arguments first)")
                if name in HELPERS:
                    continue
                self.assertEqual(r["code"], 0, r["stderr"])
                self.assertIn("usage:", r["stdout"])

    def test_every_option_has_help_and_descriptions_are_whole(self):
        for name, r in self.results.items():
            if name in HELPERS:
                continue
            with self.subTest(name):
                self.assertTrue(r["options"], f"{name} builds no argparse parser")
                for flags, text in r["options"]:
                    self.assertTrue(text and text.strip(), f"{name}: {flags} has no help text")
                for description in r["descriptions"]:
                    self.assertTrue(description and description.rstrip().endswith("."), (name, description))
                self.assertNotRegex(r["stdout"], r"(?i)\bissues? \d", f"{name} --help cites an issue number")

    def test_every_benchmark_has_json(self):
        for name, r in self.results.items():
            if name in HELPERS | NOT_ON_HARNESS:
                continue
            with self.subTest(name):
                self.assertIn(["--json"], [flags for flags, _ in r["options"]])

    def test_helper_says_what_it_is(self):
        for name in HELPERS:
            with self.subTest(name):
                r = self.results[name]
                self.assertNotEqual(r["code"], 0)
                self.assertIn("is not a benchmark", str(r["code"]))
                self.assertIn("python benchmarks/paged_decode.py", str(r["code"]))



def run_quick(script: str, *args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


class TestJsonOutput(unittest.TestCase):
    """``--json``: the document the harness's docstring describes, from real (quick) runs."""

    def check_document(self, doc: dict, benchmark: str, printed: str) -> None:
        self.assertEqual(set(doc), {"benchmark", "argv", "host", "spread", "notes", "tables", "targets", "verdict",
                                    "extra"})
        self.assertEqual(doc["benchmark"], benchmark)
        self.assertIn("--quick", doc["argv"])
        self.assertIn(doc["host"]["isa"], {"AVX2", "AVX-512", "AVX-512 with AMX", "NEON", "NEON with SVE",
                                           "no AVX2/AVX-512/NEON"})
        for key in ("cpu", "torch_cpu_capability", "threads", "torch"):
            self.assertTrue(doc["host"][key], key)
        self.assertIn("p25-p75", doc["spread"])
        self.assertTrue(doc["tables"])
        for table in doc["tables"]:
            self.assertTrue(table["rows"], table["title"])
            for row in table["rows"]:
                self.assertLessEqual(set(table["columns"]), set(row))  # every column, and maybe more fields
                for value in row.values():
                    if isinstance(value, dict) and "median" in value:  # a measured figure
                        self.assertEqual(set(value), {"median", "p25", "p75", "rounds"})
                        self.assertLessEqual(value["p25"], value["median"])
                        self.assertLessEqual(value["median"], value["p75"])
        verdict = doc["verdict"]
        self.assertEqual(verdict["total"], len(doc["targets"]))
        self.assertTrue(verdict["lines"][0].startswith("host: "))
        self.assertIn(doc["host"]["isa"], verdict["lines"][0])
        flat = " ".join(printed.split())
        for line in verdict["lines"]:
            self.assertIn(" ".join(line.split()), flat)  # the verdict block is printed as in the JSON (wrapped)
        self.assertIn(f"=== verdict: {benchmark} ===", printed)
        for line in printed.splitlines():
            self.assertLessEqual(len(line), 120, line)

    def test_json_to_stdout(self):
        proc = run_quick("streaming_cache.py", "--json")
        doc = json.loads(proc.stdout)  # stdout holds the JSON alone; the tables went to stderr
        self.check_document(doc, "streaming_cache", proc.stderr)
        (table,) = doc["tables"]
        self.assertEqual(len(table["rows"]), 4)  # 2 geometries x (evicting append, rewrite)
        self.assertEqual(table["rows"][0]["ring/roll"]["rounds"], 5)
        self.assertEqual(doc["targets"], [])
        self.assertIn("targets: none", proc.stderr)

    def test_json_to_a_file(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = pathlib.Path(tmp) / "sub" / "value_checks.json"
            proc = run_quick("value_checks.py", "--json", str(path))
            doc = json.loads(path.read_text())
        self.check_document(doc, "value_checks", proc.stdout)
        self.assertEqual([(r["op"], r["N"]) for r in doc["tables"][0]["rows"]],
                         [("paged_cache_write", 16), ("paged_attention", 16)])
        self.assertIn(f"json: {path}", proc.stdout)

    def test_paged_decode_bounds_threads_packed_and_verdict(self):
        """paged_decode.py at tiny sizes: the header names the native build; a bf16 decode row at context 4096 has its
        bandwidth sub-line (fraction of the copy, bytes and FMA bounds); the two-thread section (wall clock, 1 and 2
        threads) and the packed-vs-dense table are printed; the verdict has one ok/MISS line per target."""
        with tempfile.TemporaryDirectory() as tmp:
            path = pathlib.Path(tmp) / "paged_decode.json"
            proc = run_quick("paged_decode.py", "--threads", "1", "2", "--batches", "1", "--contexts", "4096",
                             "--rounds", "1", "--dtypes", "bfloat16", "--geometries", "qwen2.5-0.5b", "--modes",
                             "eager", "--peers", "--no-prefill", "--packed-contexts", "64", "--out", tmp, "--json",
                             str(path))
            doc = json.loads(path.read_text())
            self.assertTrue((pathlib.Path(tmp) / "paged_decode_quick.txt").exists())
        self.check_document(doc, "paged_decode", proc.stdout)
        self.assertIn("kvops native build", " ".join(proc.stdout.split()[:80]))
        self.assertRegex(doc["host"]["kvops_native_build"], r"^(native|x86-64-v3) \(code for .*\)$")
        for threads in ("1", "2"):
            figures = doc["extra"]["host_figures"][threads]
            self.assertGreater(figures["copy_gbs"], 0)
            self.assertGreater(figures["gflops"], 0)
            self.assertGreater(figures["gflops_bfloat16"], 0)
        decode = [row for table in doc["tables"] for row in table["rows"] if row.get("kind") == "decode"]
        self.assertEqual([row["threads"] for row in decode], [1, 2])
        for row in decode:  # the sub-line at every thread count, the target at 1 thread only
            self.assertIn(row["larger_bound"], {"bytes", "FMAs"})
            self.assertIn("of the copy's", row["note"])
            self.assertIn("bound is the larger", row["note"])
            # a bf16 row's FMA bound: Qwen's score + PV FMAs (2 x B 1 x 14 query heads x ctx 4096 x 64 dims) at the
            # faster of the fp32 and the bf16 mm rates
            figures = doc["extra"]["host_figures"][str(row["threads"])]
            rate = max(figures["gflops"], figures["gflops_bfloat16"])
            self.assertAlmostEqual(row["fma_bound_ms"], 2 * 14 * 4096 * 64 / (rate * 1e9 / 2) * 1e3, places=9)
        self.assertEqual(decode[0]["bandwidth_fraction"]["rounds"], 1)
        for row in decode:  # the copy in the row's rounds; the same calls over K/V in the caches: Qwen's K + V block
            # is 8 KiB, 256 KiB of them
            self.assertIn("GB/s timed in the same rounds", row["note"])
            note = " ".join(row["note"].split())
            self.assertIn("with the K/V in the core's caches (every table cycling over 32 blocks, 256 KiB of K + V",
                          note)
            self.assertEqual(row["in_cache_fraction"]["rounds"], 1)
            self.assertGreater(row["in_cache_ms"], 0)
            self.assertEqual((row["in_cache_blocks"], row["in_cache_kib"], row["copy_gbs"]["rounds"]), (32, 256, 1))
        names = [t["target"] for t in doc["targets"]]
        bandwidth = [n for n in names if "copy's read+write GB/s" in n]
        speedup = [n for n in names if "2 threads >= 1.7x" in n]
        self.assertEqual((len(bandwidth), len(speedup), len(names)), (1, 1, 2))  # no prefill; B=1 ctx=4096: no ratio
        titles = [t["title"] for t in doc["tables"]]
        (threads_table,) = [t for t in doc["tables"] if t["title"].startswith("two threads vs one")]
        self.assertIn("WALL clock at both", threads_table["title"])
        self.assertEqual([r["case"] for r in threads_table["rows"]], ["qwen2.5-0.5b bfloat16 B=8 ctx=4096"])
        (speedup_row,) = threads_table["rows"]  # and the same calls with the K/V in the caches
        self.assertIn("with the K/V in the core's caches (every table cycling over 32 blocks, 256 KiB of K + V",
                      " ".join(speedup_row["note"].split()))
        self.assertEqual(speedup_row["in_cache_speedup"]["rounds"], 1)
        self.assertGreater(speedup_row["in_cache_ms_2_threads"]["median"], 0)
        (packed,) = [t for t in doc["tables"] if t["title"].startswith("packed (quantized) vs dense")]
        (row,) = packed["rows"]
        self.assertEqual((row["batch"], row["context"]), (8, 64))
        self.assertLess(row["int4 bytes"], row["int8 bytes"])
        self.assertLess(row["int8 bytes"], 0.6)
        self.assertEqual(row["int8/dense"]["rounds"], 1)
        self.assertEqual(len(titles), 4)  # 2 thread counts x 1 geometry x 1 dtype, the two sections
        for name in set(names):
            (line,) = [line for line in doc["verdict"]["lines"] if f" {name}: " in line]
            self.assertRegex(line, r"^  (ok  |MISS) ")
            self.assertIn("worst ", line)


def load_harness():
    from tests.example_loader import load_module

    return load_module(ROOT / "benchmarks" / "_harness.py", "kvops_bench_harness")


class TestHarness(unittest.TestCase):
    """The harness on made-up figures: one definition of spread, rotated rounds, targets and the verdict."""

    @classmethod
    def setUpClass(cls):
        cls.h = load_harness()

    def test_spread_is_the_interquartile_range_of_per_round_values(self):
        s = self.h.Spread.of([1.0, 2.0, 3.0, 4.0, 100.0])
        self.assertEqual((s.median, s.p25, s.p75, s.rounds), (3.0, 2.0, 4.0, 5))  # one outlier round moves nothing
        self.assertTrue(s.noisy)  # 4 - 2 > 20% of 3
        self.assertEqual(s.format(), "3.00 [2.00-4.00]~")
        self.assertEqual(self.h.Spread.of([10.0, 10.5, 11.0]).format(), "10.5 [10.2-10.8] ")  # not noisy
        self.assertEqual(self.h.Spread.of([1.0, 1.01, 1.02, 1.03, 1.04]).format(), "1.02 [1.01-1.03] ")
        r = self.h.ratio([2.0, 3.0, 4.0], [1.0, 1.0, 2.0])  # per round: 2, 3, 2
        self.assertEqual((r.median, r.p25, r.p75), (2.0, 2.0, 2.5))
        with self.assertRaisesRegex(ValueError, "3 values against 2 baselines"):
            self.h.ratio([1, 2, 3], [1, 2])

    def test_rounds_rotate_the_order_and_ratios_pair_rounds(self):
        calls = []
        cands = {name: (lambda name=name: calls.append(name)) for name in "ABC"}
        t = self.h.interleave(cands, 4, clock="wall", reps=1, warmup=1)
        self.assertEqual("".join(calls), "ABC" + "ABC" "BCA" "CAB" "ABC")  # warm-up, then rotated rounds
        self.assertEqual({n: len(v) for n, v in t.times.items()}, {"A": 4, "B": 4, "C": 4})
        self.assertEqual(t.ratio("B", "A").rounds, 4)

    def test_host_isa_from_cpu_flags(self):
        isa = self.h.isa_name
        self.assertEqual(isa({"avx2", "avx512f", "amx_tile"}), "AVX-512 with AMX")
        self.assertEqual(isa({"avx2", "avx512f"}), "AVX-512")
        self.assertEqual(isa({"avx2", "fma"}), "AVX2")
        self.assertEqual(isa({"fp", "asimd"}), "NEON")
        self.assertEqual(isa(set(), "arm64"), "NEON")  # macOS: no /proc/cpuinfo

    def test_verdict_names_the_largest_miss_and_its_meaning(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = pathlib.Path(tmp) / "out.json"
            report = self.h.Report("made_up", types.SimpleNamespace(json=str(path)), argv=[])
            report.host = {"cpu": "a CPU", "isa": "AVX2", "torch_cpu_capability": "AVX2", "threads": 1,
                           "torch": "2.13"}
            table = report.table("t", [("case", 10), ("ratio", 17), ("note", 10, None, "<")])
            fig = self.h.Spread.of
            table.row("a", fig([1.0, 1.1, 1.2]), "x " * 80)  # the last column wraps within 120 columns
            report.target("decode <= 1.2", "a", fig([1.0, 1.1, 1.2]), 1.2, meaning="m {value:.2f}")
            report.target("decode <= 1.2", "b", fig([1.4, 1.5, 1.6]), 1.2, meaning="b is {value:.2f}x ({over:.0%})")
            report.target("speedup >= 1.5", "c", 1.2, 1.5, ">=", meaning="c is short")
            doc = report.finish()
            self.assertEqual(json.loads(path.read_text()), json.loads(json.dumps(doc)))
        self.assertTrue(all(len(line) <= 120 for line in report.lines))
        self.assertEqual(doc["verdict"]["held"], 1)
        self.assertEqual(doc["verdict"]["largest_miss"]["case"], "b")  # 25% over beats 20% under
        lines = doc["verdict"]["lines"]
        self.assertEqual(lines[1:4], ["targets: 1 of 3 hold", "  decode <= 1.2: 1 of 2 hold",
                                      "  speedup >= 1.5: 0 of 1 hold"])
        self.assertEqual(lines[4], "largest miss: b (decode <= 1.2): 1.50 [1.45-1.55] against <= 1.2, 25% over")
        self.assertEqual(lines[5], "  meaning: b is 1.50x (25%)")
        self.assertEqual(doc["tables"][0]["rows"][0]["ratio"], {"median": 1.1, "p25": 1.05, "p75": 1.15, "rounds": 3})

    def test_emulate_avx2_sets_the_variables_in_a_child(self):
        names = [*self.h.AVX2_EMULATION, self.h.EMULATED]
        script = ("import json, os, sys\n"
                  f"open(sys.argv[1], 'w').write(json.dumps({{k: os.environ.get(k) for k in {names!r}}}))\n")
        real = self.h._cpuinfo
        with tempfile.TemporaryDirectory() as tmp:
            child, seen = pathlib.Path(tmp) / "child.py", pathlib.Path(tmp) / "env.json"
            child.write_text(script)
            try:
                self.h._cpuinfo = lambda: ("an AVX2 CPU", {"avx2", "fma"})
                with self.assertRaisesRegex(SystemExit, "ISA AVX2, not AVX-512, so there is nothing to emulate"):
                    self.h.emulate_avx2(str(child), [str(seen)])
                self.assertFalse(seen.exists())
                self.h._cpuinfo = lambda: ("an AVX-512 CPU", {"avx2", "avx512f"})
                self.assertEqual(self.h.emulate_avx2(str(child), [str(seen)]), 0)
            finally:
                self.h._cpuinfo = real
            env = json.loads(seen.read_text())
        self.assertEqual(env, {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                               "MKL_ENABLE_INSTRUCTIONS": "AVX2", "KVOPS_NATIVE_ISA": "x86-64-v3",
                               self.h.EMULATED: "AVX2"})
        info = {"cpu": "c", "isa": "AVX-512 with AMX", "torch_cpu_capability": "AVX2", "threads": 1, "cores": 2,
                "torch": "2.13", "emulated": "AVX2"}
        line = self.h.host_line(info)
        self.assertIn("ISA AVX2 emulated on an AVX-512 host (AVX-512 with AMX; torch: AVX2; ATEN_CPU_CAPABILITY=avx2",
                      line)
        self.assertIn("not a real AVX2 host", line)

    def test_tables_refuse_columns_wider_than_120(self):
        report = self.h.Report("made_up", None, argv=[])
        with self.assertRaisesRegex(ValueError, "need 125 > 120 characters"):
            report.table("too wide", [("a", 60), ("b", 60), ("c", 2)])


class TestPagedDecodeLabels(unittest.TestCase):
    def test_grid_targets_name_the_shapes_run(self):
        """A target over a grid of decode shapes names, in the verdict, the part of the grid the run measured: the
        default run the whole grid, ``--quick`` (B in {1, 8} x context in {256, 1024}) its one shape, B=8 ctx=1024."""
        from tests.example_loader import load_module

        decode = load_module(ROOT / "benchmarks" / "paged_decode.py", "kvops_bench_paged_decode")
        full, quick = decode.parse_args([]), decode.parse_args(["--quick"])
        grid = [(name, t) for name, t in decode.TARGETS.items() if "B in {" in name]
        self.assertEqual([decode.run_label(n, t, full) for n, t in grid],
                         ["decode B in {8, 32} x ctx in {1024, 4096}: kvops <= 1.0x ideal"])
        self.assertEqual([decode.run_label(n, t, quick) for n, t in grid],
                         ["decode B in {8} x ctx in {1024}: kvops <= 1.0x ideal"])
        for name, t in decode.TARGETS.items():  # the others name one shape, or none
            if "B in {" not in name:
                self.assertEqual(decode.run_label(name, t, quick), name)


class TestInCacheCase(unittest.TestCase):
    def test_tables_cycle_over_few_blocks(self):
        """``in_cache_case``: every block table reads the first blocks of the case's tables in turn (their K + V at
        most ``IN_CACHE_BYTES``), the shape and the other inputs unchanged; kvops runs over it and matches the ideal
        over the K/V it names."""
        sys.path.insert(0, str(ROOT / "benchmarks"))
        try:
            import torch

            import _paged_cases as cases
        finally:
            sys.path.remove(str(ROOT / "benchmarks"))
        big = cases.in_cache_case(cases.make_case((32, 8, 512), 1, 1, 64, torch.float32, "cpu", flex=False))
        self.assertEqual((big["in_cache_blocks"], big["in_cache_kib"]), (1, 512))  # K + V of a block > 256 KiB: one
        c = cases.make_case((12, 2, 128), 3, 1, 1000, torch.bfloat16, "cpu", flex=False)  # GQA 6, 63 blocks each
        cached = cases.in_cache_case(c)
        block_bytes = 2 * 16 * 2 * 128 * 2  # K + V of a block: 16 tokens x 2 KV heads x 128 dims, bf16
        few = cases.IN_CACHE_BYTES // block_bytes
        self.assertEqual((few, cached["in_cache_blocks"], cached["in_cache_kib"]), (16, 16, 256))
        flat = c["block_table"].flatten()
        self.assertEqual(cached["block_table"].shape, c["block_table"].shape)
        self.assertEqual(cached["block_table"].flatten().tolist(), [flat[i % few].item() for i in range(flat.numel())])
        self.assertIs(cached["k_cache"], c["k_cache"])
        self.assertIs(cached["seq_lens"], c["seq_lens"])
        table = cached["block_table"].long()
        k = c["k_cache"][table].flatten(1, 2)[:, :1000].transpose(1, 2).float()
        v = c["v_cache"][table].flatten(1, 2)[:, :1000].transpose(1, 2).float()
        ref = torch.nn.functional.scaled_dot_product_attention(c["q_f"].float(), k, v)
        out = cases.unfold(c, ref)
        torch.testing.assert_close(cases.run_kvops(cached).float(), out, atol=2e-2, rtol=2e-2)


if __name__ == "__main__":
    unittest.main()
