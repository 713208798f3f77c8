"""What the examples share (a helper module, not an example): the command-line format, RoPE, the compiled CPU
settings, and the ``--package DIR`` machinery (an AOTInductor package of a step, built once, checked against its
recorded sha256 and its recorded input shapes, then loaded).

Each example puts its own folder on ``sys.path`` and imports this module by name, so ``python examples/X.py`` works
from any working directory, and so does a test that loads an example by its path (tests/example_loader.py).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import pathlib
import statistics
import tempfile

import torch
import torch._inductor.config

import kvops

HERE = pathlib.Path(__file__).resolve()


# --- command line -----------------------------------------------------------------------------------------------------
class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` as the examples print it: the description as written, and every option's help ending in its
    default, ``(default: ...)``, unless the help text already says it. Flags (``store_true``) are off by default and
    say nothing more."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if "(default" in text or default is argparse.SUPPRESS or isinstance(action, argparse._StoreTrueAction):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else default
        return f"{text} (default: {str(shown).replace('%', '%%')})"


def parser(doc: str) -> argparse.ArgumentParser:
    """The parser of an example whose module docstring is ``doc``: its first paragraph is the description."""
    return argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=HelpFormatter)


def add_device_options(p: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype`` as both timed examples take them (checked by :func:`parse_run_args`)."""
    p.add_argument("--device", default="cpu", help="where the model and caches live: cpu or cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="model and cache dtype")


def add_run_options(p: argparse.ArgumentParser, unit: str, package_what: str, package_note: str) -> None:
    """The options both timed examples share: ``--repeats``, ``--threads``, ``--package DIR``, ``--json PATH``."""
    p.add_argument("--repeats", type=int, default=3,
                   help=f"timed eager/compiled {unit} pairs after warm-up, interleaved (median and spread printed)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    p.add_argument("--package", default=None, metavar="DIR",
                   help=f"compiled = an AOTInductor package of {package_what} (same Inductor settings) instead of "
                        "torch.compile: built and saved in DIR on the first run, loaded from DIR by later runs with "
                        f"the same arguments ({package_note}) (default: none, torch.compile)")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the measurements to this JSON file (default: none)")


def parse_run_args(p: argparse.ArgumentParser):
    """Parse, check what both timed examples check (``--package`` names a folder, CUDA is there when asked for) and
    apply ``--threads``."""
    args = p.parse_args()
    if args.package and os.path.exists(args.package) and not os.path.isdir(args.package):
        p.error(f"--package {args.package}: not a directory (give a folder for the packages)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda requested but CUDA is not available")
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


# --- model pieces -----------------------------------------------------------------------------------------------------
def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (half-split, as Llama / Qwen2) of ``x [N, H, D]`` at ``positions [N]`` with base ``theta``."""
    d = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(d, device=x.device, dtype=torch.float32) / d)
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :d].float(), x[..., d:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def configure_cpu_inference_compile(device: torch.device) -> str:
    """Inductor settings for the compiled CPU path (set in an example's ``main`` only; returned as a line to print).

    Both examples are GEMM-bound at their CPU scale (``aten::addmm``/``mm`` are ~90% of an eager step, measured with
    torch.profiler), and by default Inductor calls the same GEMM as eager. Under ``torch.no_grad``, ``freezing``
    turns the weights into constants (constant folding, weight prepacking) and ``max_autotune`` with the ``CPP``
    GEMM backend only (one candidate, so nothing is benchmarked at compile time) generates a GEMM over the prepacked
    weights with the bias/activation fused in. Only parameters are frozen: the KV caches are arguments of the
    compiled function (mutated graph inputs), never constants. Weight updates after the first compiled call are not
    seen by the compiled model (freezing's contract). torch 2.13's freezing fails to compile a graph whose mutated
    inputs are views of one tensor (reproduced without kvops: a module writing ``k[:, :4] = h; v[:, :4] = 2 * h``
    with ``k, v = kv[:, :, 0], kv[:, :, 1]`` raises IndexError under freezing and compiles without it), so with
    freezing on, examples/streaming_video.py allocates K and V separately. Cost: torch 2.13 caches no frozen graph on
    disk (AOTAutograd and FX graph caches bypass it), so every process traces and generates code again
    (docs/compile.md).
    """
    if device.type != "cpu":
        return "inductor: defaults"
    torch._inductor.config.freezing = True
    torch._inductor.config.max_autotune = True
    torch._inductor.config.max_autotune_gemm_backends = "CPP"
    return "inductor: freezing, max_autotune with the CPP GEMM backend (weights prepacked; caches are inputs)"


# --- measurements -----------------------------------------------------------------------------------------------------
def spread(values, fmt="{:.1f}") -> str:
    """``median [min-max]`` of an example's few repeated measurements (the benchmarks, which repeat more, print
    ``median [p25-p75]``: benchmarks/_harness.py)."""
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (Inductor's C++ compiler runs): a compile-cost measure
    that other load on the machine does not inflate as it does wall time."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


# --- --package DIR: AOTInductor packages ------------------------------------------------------------------------------
def kvops_sources() -> str:
    """sha256 of kvops' version and installed sources (``.py``, ``.cpp``, ``.h``), for ``--package`` file names: a
    package bakes in kvops code (lowerings, the ops' schemas, ``streaming_update``), so a changed kvops builds anew."""
    root = pathlib.Path(kvops.__file__).parent
    digest = hashlib.sha256(kvops.__version__.encode())
    for f in sorted(root.rglob("*")):
        if f.suffix in (".py", ".cpp", ".h"):
            digest.update(f.relative_to(root).as_posix().encode() + f.read_bytes())
    return digest.hexdigest()


def package_path(directory: str, example: str, key: dict, source: str) -> pathlib.Path:
    """``DIR/<example>-<digest>.pt2``: the digest hashes everything a package bakes in (its weights are constants:
    freezing): ``key`` (the arguments that shape the model and the step), threads, the CPU's vector ISA, torch, the
    Inductor settings, kvops' lowering tag, kvops' sources, and the source of the example (``source``, its
    ``__file__``) and of this module."""
    key = {**key, "threads": torch.get_num_threads(), "isa": torch.backends.cpu.get_cpu_capability(),
           "torch": torch.__version__, "tag": torch.compiler.config.cache_key_tag,
           "inductor": [torch._inductor.config.freezing, torch._inductor.config.max_autotune,
                        torch._inductor.config.max_autotune_gemm_backends],
           "source": hashlib.sha256(pathlib.Path(source).read_bytes() + HERE.read_bytes()).hexdigest(),
           "kvops": kvops_sources()}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return pathlib.Path(directory) / f"{example}-{digest}.pt2"


def input_signature(named) -> dict:
    """``{name: [shape, dtype, device]}`` of ``(name, tensor)`` pairs: what a ``--package`` records in its metadata
    (as JSON) and checks every call against."""
    return {name: [list(t.shape), str(t.dtype), str(t.device)] for name, t in named}


def digest_path(path: pathlib.Path) -> pathlib.Path:
    """Where a package's sha256 is recorded when it is built: ``<package>.sha256`` beside it."""
    return path.with_name(path.name + ".sha256")


def file_digest(path: pathlib.Path) -> str:
    """sha256 of a file's bytes, read in 1 MiB chunks (about 1-2 s per GB, once per process)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_package(path: pathlib.Path) -> None:
    """SystemExit naming the file and the cure unless ``path`` has the bytes whose sha256 was recorded when it was
    built: AOTInductor loads a package whose weights were changed (even with a stale zip CRC) and runs it."""
    record = digest_path(path)
    try:
        recorded = record.read_text().strip()
    except OSError as e:
        raise SystemExit(f"--package: {path} has no readable digest record {record.name} (written beside it when it is "
                         f"built; {e.strerror}); delete {path.name} to rebuild it") from e
    if file_digest(path) != recorded:
        raise SystemExit(f"--package: {path} does not match the sha256 recorded in {record.name} when it was built: "
                         f"the file was changed or corrupted; delete {path.name} and {record.name} to rebuild it")


def writable_package_dir(path: pathlib.Path) -> None:
    """Make sure a package that is not there yet can be built in its folder (else SystemExit naming the folder)."""
    if path.exists():
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SystemExit(f"--package: cannot create {path.parent} to build {path.name} ({e})") from e
    if not os.access(path.parent, os.W_OK):
        raise SystemExit(f"--package: cannot build {path.name} in {path.parent}: the folder is not writable")


class AOTPackage:
    """A step as an AOTInductor package at ``path``: built on the first call (``export()`` gives the
    ``torch.export`` program, compiled inside ``context()`` with ``aoti_compile_and_package``, the inputs' signature
    recorded in its metadata and its sha256 beside it), or only loaded when a previous process built it; every call
    is checked against the recorded inputs before the package runs. ``status`` is ``"built <path>"`` or
    ``"loaded <path>"`` after the first call."""

    def __init__(self, path: pathlib.Path):
        self.path, self.package, self.status, self.signature = path, None, None, {}
        writable_package_dir(self.path)

    def run(self, tensors: tuple, signature: dict, export, context=contextlib.nullcontext):
        if self.package is None:
            self._build_or_load(signature, export, context)
        self._check_inputs(signature)
        return self.package(*tensors)

    def _build_or_load(self, signature: dict, export, context) -> None:
        from torch._inductor import aoti_compile_and_package, aoti_load_package

        if self.path.exists():
            self.status = f"loaded {self.path}"
        else:  # (writable_package_dir made the folder)
            exported = export()
            metadata = {"aot_inductor.metadata": {"kvops_inputs": json.dumps(signature)}}  # checked on load
            with tempfile.TemporaryDirectory(prefix=".building-", dir=self.path.parent) as tmp:  # no half file
                with context():
                    built = pathlib.Path(aoti_compile_and_package(
                        exported, package_path=os.path.join(tmp, self.path.name), inductor_configs=metadata))
                digest_path(built).write_text(file_digest(built) + "\n")  # checked at every load
                os.replace(digest_path(built), digest_path(self.path))  # (a record without its package: rebuilt)
                os.replace(built, self.path)
            self.status = f"built {self.path}"
        check_package(self.path)
        try:
            self.package = aoti_load_package(str(self.path))
            self.signature = json.loads(self.package.get_metadata()["kvops_inputs"])
        except (RuntimeError, KeyError) as e:
            raise SystemExit(f"--package: {self.path} could not be loaded ({e!r}); delete it to rebuild it") from e

    def _check_inputs(self, signature: dict) -> None:
        """Refuse (ValueError, before the package runs) inputs whose shape, dtype or device differ from those the
        package was built for (its metadata records them): its generated code indexes with the built shapes, and
        AOTInductor checks none at run time unless ``AOTI_RUNTIME_CHECK_INPUTS=1``, so other inputs would be read and
        written out of bounds."""
        if signature != self.signature:
            name = next(n for n in {**signature, **self.signature} if signature.get(n) != self.signature.get(n))
            raise ValueError(f"{type(self).__name__}: {name} is {signature.get(name)} (shape, dtype, device), but "
                             f"{self.path.name} was built for {self.signature.get(name)}: pass inputs of those "
                             f"shapes, or build another package (other arguments)")
