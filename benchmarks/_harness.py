"""The timing harness and the output format of every benchmark in ``benchmarks/`` (a helper module, not a benchmark).

**Timing.** ``interleave`` runs the candidates in rounds: each round times every candidate once, in an order rotated
by one every round (A B C, B C A, C A B, A B C, ...), so drift and other processes' load hit every candidate alike
and none always runs first or last. Before the rounds each candidate is called once (warm-up: compiles, lazy
initialization, caches) and its calls per sample are calibrated so that one sample lasts at least 2 ms; a sample's
value is its clock time over its calls. The clock: the calling thread's CPU time (``time.thread_time``) with one
CPU thread, where time the process spends preempted by other jobs is not counted; wall time (``time.perf_counter``)
with more threads (the calling thread's CPU time would miss the others' work), and wall time after
``torch.cuda.synchronize`` on CUDA. A ratio is taken per round, candidate over baseline *in the same round*, so
load hits both sides of it; baselines are always measured in the same run.

**Spread (one definition for every benchmark).** Every measured figure is printed ``median [p25-p75]``: the median
of its per-round values and their interquartile range (25th to 75th percentile, ``statistics.quantiles(...,
method="inclusive")``). For a ratio the per-round values are the per-round ratios; for a time, the per-round times.
A figure whose interquartile range is wider than 20% of its median is *noisy*, marked ``~``: rerun it on an idle
machine before believing it.

**Output.** A host line first (CPU model; ISA: AVX2, AVX-512, AVX-512 with AMX or NEON, from ``/proc/cpuinfo`` and
``torch.backends.cpu.get_cpu_capability()``; in a child process started by ``emulate_avx2``, "AVX2 emulated on an
AVX-512 host" and the variables that select the AVX2 code; threads; torch version; load average), then tables
whose rows fit in 120 columns (a last free-text column wraps), then a **verdict block**: host, ISA, threads, which
targets hold (per target, how many of its cases), the largest miss and what it means for a user. ``--json PATH``
writes the same content for tools (``--json`` or ``--json -``: to stdout, as its only content: everything else then
goes to stderr)::

    {"benchmark": str, "argv": [str], "host": {...}, "spread": str, "notes": [str],
     "tables": [{"title": str, "columns": [str], "rows": [{column: value, ...}]}],
     "targets": [{"target", "case", "value", "p25", "p75", "op", "bound", "met", "noisy", "meaning"}],
     "verdict": {"held": int, "total": int, "largest_miss": {...} | null, "lines": [str]}, "extra": {...}}

A measured value in ``rows`` is ``{"median", "p25", "p75", "rounds"}``. This module imports no torch at import time:
a benchmark parses its arguments (``--help`` answers at once) before torch is imported.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass

WIDTH = 120  # every printed line fits in this many columns
NOISY = 0.2  # a figure whose interquartile range exceeds this fraction of its median is noisy
MIN_SAMPLE_S = 2e-3
SPREAD = ("median [p25-p75] of the per-round values (a ratio: per round, against the baseline of the same round); "
          "'~' marks a noisy figure (p75 - p25 > 20% of the median): rerun it on an idle machine")


def add_json_arg(parser) -> None:
    """The ``--json [PATH]`` option every benchmark has."""
    parser.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                        help="also write the results as JSON to PATH (--json alone or --json -: JSON to stdout, the "
                             "tables to stderr); layout: benchmarks/_harness.py")


# --- figures ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spread:
    """A measured figure: the median and interquartile range ``[p25, p75]`` of its per-round values."""

    median: float
    p25: float
    p75: float
    rounds: int

    @classmethod
    def of(cls, values) -> Spread:
        values = [float(v) for v in values]
        if not values:
            raise ValueError("Spread.of: no values (a figure needs at least one round)")
        if len(values) == 1:
            return cls(values[0], values[0], values[0], 1)
        q = statistics.quantiles(values, n=4, method="inclusive")
        return cls(statistics.median(values), q[0], q[2], len(values))

    @property
    def noisy(self) -> bool:
        return self.p75 - self.p25 > NOISY * abs(self.median)

    def scaled(self, factor: float) -> Spread:
        """The same figure in other units (e.g. ``1e3``: seconds to milliseconds)."""
        return Spread(self.median * factor, self.p25 * factor, self.p75 * factor, self.rounds)

    def format(self, num: str | None = None) -> str:
        """``"1.23 [1.10-1.30] "`` (``num``: a format for each number; default 2 decimals below 10, else 1), ending in
        ``~`` when noisy, else in a space (so that table columns stay aligned)."""
        if num is None:
            num = "{:.2f}" if max(abs(self.median), abs(self.p25), abs(self.p75)) < 10 else "{:.1f}"
        text = f"{num.format(self.median)} [{num.format(self.p25)}-{num.format(self.p75)}]"
        return text + ("~" if self.noisy else " ")

    def json(self) -> dict:
        return {"median": self.median, "p25": self.p25, "p75": self.p75, "rounds": self.rounds}

    def __str__(self) -> str:
        return self.format().rstrip()


def ratio(values, baselines) -> Spread:
    """Per-round ratios ``values[i] / baselines[i]`` as a Spread."""
    if len(values) != len(baselines):
        raise ValueError(f"ratio: {len(values)} values against {len(baselines)} baselines (one per round each)")
    return Spread.of(a / b for a, b in zip(values, baselines))


# --- timing -----------------------------------------------------------------------------------------------------------
def pick_clock(threads: int = 1, device: str = "cpu", choice: str = "auto"):
    """``(name, clock)``: ``"thread"`` (``time.thread_time``) for one CPU thread, else ``"wall"``
    (``time.perf_counter``); ``choice`` ("thread"/"cpu" or "wall") overrides the automatic pick."""
    if choice == "auto":
        choice = "thread" if threads == 1 and device == "cpu" else "wall"
    return ("thread", time.thread_time) if choice in ("thread", "cpu") else ("wall", time.perf_counter)


def rotation(names: list, r: int) -> list:
    """The order of round ``r``: ``names`` rotated left by ``r`` (A B C, B C A, C A B, ...)."""
    k = r % len(names) if names else 0
    return list(names[k:]) + list(names[:k])


@dataclass
class Timings:
    """Per-call seconds of each candidate, one value per round, in candidate order."""

    times: dict
    reps: dict
    clock: str

    def time(self, name: str, factor: float = 1.0) -> Spread:
        """The candidate's per-call time (seconds times ``factor``: 1e3 for ms, 1e6 for us)."""
        return Spread.of(self.times[name]).scaled(factor)

    def ratio(self, name: str, baseline: str) -> Spread:
        """The candidate's per-round time over the baseline's in the same round."""
        return ratio(self.times[name], self.times[baseline])


def interleave(candidates: dict, rounds: int, *, clock: str = "thread", sync=None, reps=None,
               min_sample_s: float = MIN_SAMPLE_S, max_reps: int = 10_000, warmup: int = 1) -> Timings:
    """Time ``candidates`` (``{name: fn}`` or ``{name: (fn, context factory)}``; the context, e.g.
    ``lambda: kvops.value_checks("off")``, is entered around each sample, outside the timed region) over ``rounds``
    interleaved rounds, the order rotated every round. ``clock``: "thread" or "wall" (``pick_clock``). ``sync``: called
    before starting and before stopping the clock (``torch.cuda.synchronize`` on CUDA). ``reps``: calls per sample
    (an int, or ``{name: int}``); default: calibrated after the warm-up so that a sample lasts ``min_sample_s``."""
    if rounds < 1:
        raise ValueError(f"interleave: rounds={rounds}; needs at least 1 round")
    tick = pick_clock(choice=clock)[1]
    sync = sync or (lambda: None)
    fns = {n: c if isinstance(c, tuple) else (c, contextlib.nullcontext) for n, c in candidates.items()}

    def sample(fn, n: int) -> float:
        sync()
        t0 = tick()
        for _ in range(n):
            fn()
        sync()
        return (tick() - t0) / n

    counts = {}
    for name, (fn, ctx) in fns.items():
        with ctx():
            for _ in range(warmup):
                fn()
            if isinstance(reps, int) or (isinstance(reps, dict) and name in reps):
                counts[name] = reps[name] if isinstance(reps, dict) else reps
            else:
                t = sample(fn, 1)
                counts[name] = max(1, min(max_reps, math.ceil(min_sample_s / max(t, 1e-9))))
    times = {name: [] for name in fns}
    for r in range(rounds):
        for name in rotation(list(fns), r):
            fn, ctx = fns[name]
            with ctx():
                times[name].append(sample(fn, counts[name]))
    return Timings(times, counts, clock)


# --- host -------------------------------------------------------------------------------------------------------------
def _cpuinfo() -> tuple[str, set]:
    """(CPU model, flags) from /proc/cpuinfo (x86 ``flags``, Arm ``Features``); ("", set()) where there is none."""
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def isa_name(flags: set, machine: str = "") -> str:
    """The vector ISA a kernel can use: "AVX-512 with AMX", "AVX-512", "AVX2", "NEON" (+ " with SVE") or "none"."""
    if "avx512f" in flags:
        return "AVX-512 with AMX" if "amx_tile" in flags else "AVX-512"
    if "avx2" in flags:
        return "AVX2"
    if "asimd" in flags or machine.lower() in ("arm64", "aarch64"):
        return "NEON with SVE" if "sve" in flags else "NEON"
    return "no AVX2/AVX-512/NEON"


# Set in a child process before torch is imported, these make torch's own kernels (ATen's CPU dispatch), oneDNN, MKL
# and kvops' native build (KVOPS_NATIVE_ISA, kvops/native) run their AVX2 code on an AVX-512 host.
AVX2_EMULATION = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                  "KVOPS_NATIVE_ISA": "x86-64-v3"}
EMULATED = "KVOPS_BENCH_EMULATED_ISA"  # set in that child: its host line says the ISA is emulated


def emulate_avx2(script: str, argv: list) -> int:
    """Run ``script argv`` again in a child process with ``AVX2_EMULATION`` in its environment (so before its torch
    import) and return its exit status. SystemExit (naming the ISA) on a host without AVX-512: nothing to emulate."""
    model, flags = _cpuinfo()
    if "avx512f" not in flags:
        raise SystemExit(f"--emulate-avx2: this host ({model}) has ISA {isa_name(flags, platform.machine())}, not "
                         "AVX-512, so there is nothing to emulate: run without --emulate-avx2")
    env = {**os.environ, **AVX2_EMULATION, EMULATED: "AVX2"}
    return subprocess.run([sys.executable, script, *argv], env=env).returncode


def isa_text(info: dict, variables: bool = True) -> str:
    """``ISA <name> (torch: <capability>)``, or, in an ``emulate_avx2`` child, that AVX2 is emulated on this AVX-512
    host (``variables``: and the environment variables that select it)."""
    if info.get("emulated"):
        env = "; " + ", ".join(f"{k}={v}" for k, v in AVX2_EMULATION.items()) if variables else ""
        return (f"ISA {info['emulated']} emulated on an AVX-512 host ({info['isa']}; torch: "
                f"{info['torch_cpu_capability']}{env}): not a real {info['emulated']} host, its caches, memory and "
                "clocks are this one's")
    return f"ISA {info['isa']} (torch: {info['torch_cpu_capability']})"


def host(threads=None, device: str = "cpu") -> dict:
    """What the figures depend on: CPU model, ISA, torch's CPU capability, threads, torch version, load, GPU."""
    import torch  # here: the benchmark has parsed its arguments

    model, flags = _cpuinfo()
    info = {"cpu": model, "isa": isa_name(flags, platform.machine()),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": list(threads) if isinstance(threads, (list, tuple)) else
            threads if threads is not None else torch.get_num_threads(), "cores": os.cpu_count(),
            "torch": torch.__version__, "device": device,
            "load_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    if os.environ.get(EMULATED):
        info["emulated"] = os.environ[EMULATED]
    return info


def host_line(info: dict) -> str:
    t = info["threads"]
    t = t[0] if isinstance(t, (list, tuple)) and len(t) == 1 else t
    t = ", ".join(map(str, t)) if isinstance(t, (list, tuple)) else t
    threads = f"{t} thread{'' if t == 1 else 's'} of {info['cores']} cores"
    load = f"; load {info['load_1min']:.1f}" if info.get("load_1min") is not None else ""
    gpu = f"; GPU {info['gpu']}" if info.get("gpu") else ""
    return f"host: {info['cpu']}; {isa_text(info)}; {threads}; torch {info['torch']}{load}{gpu}"


# --- tables and the report --------------------------------------------------------------------------------------------
def _cell(value, fmt) -> str:
    if value is None:
        return "-"
    if isinstance(value, Spread):
        return value.format(fmt)  # (ends in "~" or " ")
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)) and fmt:
        return fmt.format(value)
    return str(value)


def _json(value):
    return value.json() if isinstance(value, Spread) else value


class Table:
    """Columns ``(name, width[, number format[, "<"]])``: the first is left-aligned, the others right-aligned (the last
    one left-aligned with ``"<"``), two spaces apart; the last column takes what is left of the 120 columns and wraps.
    A Spread cell prints ``median [p25-p75]`` and ``~`` when noisy."""

    SEP = "  "

    def __init__(self, report: Report, title: str, columns: list):
        self.report, self.title = report, title
        cols = [(c[0], max(int(c[1]), len(c[0])), c[2] if len(c) > 2 else None) for c in columns]
        self.left_last = len(columns[-1]) > 3 and columns[-1][3] == "<"
        fixed = sum(w for _, w, _ in cols[:-1]) + len(self.SEP) * (len(cols) - 1)
        if fixed + len(cols[-1][0]) > WIDTH:
            raise ValueError(f"table {title!r}: its columns need {fixed + len(cols[-1][0])} > {WIDTH} characters")
        self.columns, self.last_width = cols, WIDTH - fixed
        self.rows: list[dict] = []
        report.print()
        report.print(title)
        header = self._line([c[0] for c in cols])
        report.print(header)
        report.print("-" * min(WIDTH, max(len(header), fixed + 8)))

    def _line(self, texts: list[str]) -> list[str]:
        parts = []
        for i, (text, (_, width, _)) in enumerate(zip(texts[:-1], self.columns)):
            parts.append(f"{text:<{width}}" if i == 0 else f"{text:>{width}}")
        head = self.SEP.join(parts) + (self.SEP if parts else "")
        last = texts[-1]
        if len(self.columns) > 1 and len(last) <= self.last_width and not self.left_last:  # right-align it
            last = f"{last:>{min(self.columns[-1][1], self.last_width)}}"
        wrapped = textwrap.wrap(last, self.last_width) or [""]
        return "\n".join([head + wrapped[0]] + [" " * len(head) + w for w in wrapped[1:]])

    def row(self, *cells, **extra) -> dict:
        """Print one row (``cells`` in column order) and record it, with ``extra`` fields, for ``--json``."""
        if len(cells) != len(self.columns):
            raise ValueError(f"table {self.title!r}: {len(cells)} cells for {len(self.columns)} columns")
        self.report.print(self._line([_cell(v, c[2]) for v, c in zip(cells, self.columns)]))
        data = {c[0]: _json(v) for v, c in zip(cells, self.columns)}
        data.update({k: _json(v) for k, v in extra.items()})
        self.rows.append(data)
        return data

    def sub(self, text: str) -> None:
        """A continuation line under the last row (indented; kept in the row's ``"note"`` for ``--json``)."""
        self.report.print(text, indent="    ")
        if self.rows:
            self.rows[-1]["note"] = (self.rows[-1].get("note", "") + " " + text).strip()

    def json(self) -> dict:
        return {"title": self.title, "columns": [c[0] for c in self.columns], "rows": self.rows}


@dataclass
class Target:
    target: str  # what is promised, e.g. "decode B>=8 ctx>=1024: kvops/ideal <= 1.2"
    case: str  # where it was measured
    value: Spread
    op: str  # "<=" or ">="
    bound: float
    meaning: str  # what a miss means for a user; may use {value}, {bound}, {over}

    @property
    def met(self) -> bool:
        return self.value.median <= self.bound if self.op == "<=" else self.value.median >= self.bound

    @property
    def over(self) -> float:
        """How far the median is past the bound, as a fraction of the bound (> 0: missed)."""
        m = self.value.median
        return (m - self.bound) / self.bound if self.op == "<=" else (self.bound - m) / self.bound

    @property
    def within_spread(self) -> bool:
        return self.value.p25 <= self.bound <= self.value.p75

    def json(self) -> dict:
        return {"target": self.target, "case": self.case, "value": self.value.median, "p25": self.value.p25,
                "p75": self.value.p75, "op": self.op, "bound": self.bound, "met": self.met,
                "noisy": self.value.noisy, "meaning": self.explain()}

    def explain(self) -> str:
        return self.meaning.format(value=self.value.median, bound=self.bound, over=max(self.over, 0.0))


class Report:
    """One benchmark run's output: host line, notes, tables, targets, the verdict block and ``--json``."""

    def __init__(self, name: str, args=None, argv=None):
        self.name = name
        self.json_path = getattr(args, "json", None)
        self.out = sys.stdout
        self._stdout = None
        if self.json_path == "-":  # stdout is the JSON's alone: until finish(), whatever writes to fd 1 (this
            sys.stdout.flush()  # module, the benchmark, native libraries) goes to stderr
            self._stdout = os.dup(1)
            os.dup2(2, 1)
        self.argv = list(sys.argv[1:] if argv is None else argv)
        self.host: dict = {}
        self.notes: list[str] = []
        self.tables: list[Table] = []
        self.targets: list[Target] = []
        self.findings: list[str] = []
        self.extra: dict = {}
        self.lines: list[str] = []

    def print(self, text: str = "", indent: str = "") -> None:
        """Print ``text`` (a line longer than 120 columns wraps, its continuation lines indented by 2 more)."""
        for raw in str(text).split("\n"):
            line = indent + raw
            lead = indent + raw[: len(raw) - len(raw.lstrip())]
            lines = [line] if len(line) <= WIDTH else textwrap.wrap(
                raw.strip(), WIDTH, initial_indent=lead, subsequent_indent=lead + "  ", break_on_hyphens=False)
            for out in lines:
                print(out, file=self.out, flush=True)
                self.lines.append(out)

    def note(self, text: str) -> None:
        """A paragraph of explanation (wrapped), kept for ``--json``."""
        self.notes.append(text)
        self.print(text)

    def start(self, threads=None, device: str = "cpu", **facts) -> dict:
        """Detect and print the host line; ``threads``: the torch thread count, or the list of those the benchmark
        runs (default: torch's current count); ``facts``: more ``key: value`` pairs for the line and the JSON."""
        self.host = {**host(threads, device), **facts}
        extra = "; ".join(f"{k.replace('_', ' ')} {v}" for k, v in facts.items())
        self.print(host_line(self.host) + (f"; {extra}" if extra else ""))
        self.print(f"spread: {SPREAD}")
        return self.host

    def table(self, title: str, columns: list) -> Table:
        t = Table(self, title, columns)
        self.tables.append(t)
        return t

    def target(self, target: str, case: str, value, bound: float, op: str = "<=", meaning: str = "") -> Target:
        """Record whether ``value`` (a Spread, or one number) meets ``op bound`` by its median."""
        if op not in ("<=", ">="):
            raise ValueError(f"target {target!r}: op={op!r}; use '<=' or '>='")
        value = value if isinstance(value, Spread) else Spread(float(value), float(value), float(value), 1)
        t = Target(target, case, value, op, bound, meaning)
        self.targets.append(t)
        return t

    def finding(self, text: str) -> None:
        """A headline result for the verdict block (benchmarks without targets say what they found)."""
        self.findings.append(text)

    def verdict(self) -> list[str]:
        h = self.host or {}
        threads = h.get("threads")
        threads = ", ".join(map(str, threads)) if isinstance(threads, list) else threads
        isa = isa_text({"isa": "?", "torch_cpu_capability": "?", **h}, variables=False)
        lines = [f"host: {h.get('cpu', '?')}; {isa}; threads {threads}; torch {h.get('torch', '?')}"
                 + (f"; GPU {h['gpu']}" if h.get("gpu") else "")]
        if not self.targets:
            lines.append("targets: none (this benchmark reports costs and sets no target)")
        else:
            held = sum(t.met for t in self.targets)
            lines.append(f"targets: {held} of {len(self.targets)} hold")
            for name in dict.fromkeys(t.target for t in self.targets):
                mine = [t for t in self.targets if t.target == name]
                lines.append(f"  {name}: {sum(t.met for t in mine)} of {len(mine)} hold")
            missed = [t for t in self.targets if not t.met]
            if missed:
                worst = max(missed, key=lambda t: t.over)
                lines.append(f"largest miss: {worst.case} ({worst.target}): {worst.value} against {worst.op} "
                             f"{worst.bound:g}, {worst.over:.0%} {'over' if worst.op == '<=' else 'under'}")
                if worst.meaning:
                    lines.append(f"  meaning: {worst.explain()}")
                if worst.within_spread or worst.value.noisy:
                    lines.append("  the bound lies within the spread of the rounds or the figure is noisy: it may hold "
                                 "on an idle machine; rerun before concluding")
            else:
                lines.append("largest miss: none")
        noisy = sum(t.value.noisy for t in self.targets)
        if noisy:
            lines.append(f"noisy: {noisy} of the target figures ('~'): rerun on an idle machine before believing them")
        lines += [f"found: {f}" for f in self.findings]
        return lines

    def finish(self) -> dict:
        """Print the verdict block and write ``--json``; returns the JSON document."""
        lines = self.verdict()
        self.print()
        self.print(f"=== verdict: {self.name} ===")
        for line in lines:
            self.print(line)
        missed = [t for t in self.targets if not t.met]
        worst = max(missed, key=lambda t: t.over) if missed else None
        doc = {"benchmark": self.name, "argv": self.argv, "host": self.host, "spread": SPREAD, "notes": self.notes,
               "tables": [t.json() for t in self.tables], "targets": [t.json() for t in self.targets],
               "verdict": {"held": sum(t.met for t in self.targets), "total": len(self.targets),
                           "largest_miss": worst.json() if worst else None, "lines": lines},
               "extra": self.extra}
        if self._stdout is not None:
            sys.stdout.flush()
            os.dup2(self._stdout, 1)
            os.close(self._stdout)
            self._stdout = None
            print(json.dumps(doc), flush=True)
        elif self.json_path:
            os.makedirs(os.path.dirname(os.path.abspath(self.json_path)), exist_ok=True)
            with open(self.json_path, "w") as f:
                json.dump(doc, f, indent=1)
            self.print(f"json: {self.json_path}")
        return doc
