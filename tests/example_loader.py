"""Test helper: import an example or benchmark script (``examples/<name>.py``, ``benchmarks/``) as a module."""

import importlib.util
import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_example(name: str):
    return load_module(ROOT / "examples" / f"{name}.py", f"kvops_example_{name}")


def load_module(path: pathlib.Path, name: str):
    """Import the script at ``path`` as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # strict export (Dynamo) imports the module of the code it traces
    spec.loader.exec_module(module)
    return module


def run_example_json(name: str, args: list[str], out: pathlib.Path, timeout: int = 600) -> tuple[dict, str]:
    """Run ``examples/<name>.py args --json out`` in a fresh process; returns (its JSON result, its stdout). A
    failing run fails the caller with the tail of its output."""
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / f"{name}.py"), *args, "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout


def corrupted_copy(package: pathlib.Path, directory: pathlib.Path) -> pathlib.Path:
    """A copy of an AOTInductor package (and its ``.sha256`` record) with bytes flipped inside its largest member
    (the weights) in place: the zip stays readable, only that member's CRC is stale, which AOTInductor's loader does
    not check (before the digest, such a package loaded and gave wrong outputs)."""
    import shutil
    import struct
    import zipfile

    directory.mkdir(parents=True, exist_ok=True)
    copy = directory / package.name
    shutil.copyfile(package, copy)
    shutil.copyfile(package.with_name(package.name + ".sha256"), copy.with_name(copy.name + ".sha256"))
    with zipfile.ZipFile(copy) as z:
        member = max(z.infolist(), key=lambda i: i.compress_size)
    with open(copy, "r+b") as f:
        f.seek(member.header_offset + 26)
        name_len, extra_len = struct.unpack("<HH", f.read(4))
        at = member.header_offset + 30 + name_len + extra_len + member.compress_size // 2
        f.seek(at)
        data = bytearray(f.read(8))
        f.seek(at)
        f.write(bytes(b ^ 0x5A for b in data))
    return copy
