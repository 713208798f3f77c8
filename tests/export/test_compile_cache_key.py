"""A change of kvops' Inductor lowerings must not be served stale code from a warm compile cache.

Inductor's FX graph cache does not key on registered lowerings, so ``kvops.lowering.register()`` adds a hash of the
lowering sources to ``torch.compiler.config.cache_key_tag`` (lowering/__init__.py). These tests check that the tag is
there, keeps a user's own tag, follows the sources' bytes, and really separates cache entries.
"""

from __future__ import annotations

import pathlib
import shutil

import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch._inductor.utils import fresh_inductor_cache

import kvops
from kvops import lowering


def test_tag_is_set_and_keeps_the_users_tag():
    tag = lowering.cache_key_tag()
    assert tag.startswith("kvops-lowering-") and len(tag) == len("kvops-lowering-") + 16
    assert tag in torch.compiler.config.cache_key_tag.split("+")
    with torch.compiler.config.patch(cache_key_tag="mine"):  # (config.patch, not monkeypatch: it restores the entry)
        lowering._tag_compile_caches()
        assert torch.compiler.config.cache_key_tag == f"mine+{tag}"
        lowering._tag_compile_caches()  # idempotent
        assert torch.compiler.config.cache_key_tag == f"mine+{tag}"
    assert tag in torch.compiler.config.cache_key_tag.split("+")


def test_tag_follows_the_lowering_sources(tmp_path):
    copies = []
    for path in lowering.LOWERING_SOURCES:
        copies.append(tmp_path / path.name)
        shutil.copy(path, copies[-1])
    before = lowering.cache_key_tag(copies)
    assert lowering.cache_key_tag(copies) == before
    copies[0].write_bytes(copies[0].read_bytes() + b"\n# a changed lowering\n")
    assert lowering.cache_key_tag(copies) != before


def _compile_once():
    torch._dynamo.reset()
    counters.clear()

    @torch.compile(fullgraph=True)
    def step(k, v, kc, vc):
        kvops.cache_write(k * 0.5, v, kc, vc, 2)

    kc, vc = torch.zeros(1, 8, 2, 16), torch.zeros(1, 8, 2, 16)
    k, v = torch.randn(1, 3, 2, 16), torch.randn(1, 3, 2, 16)
    step(k, v, kc, vc)
    assert torch.equal(kc[:, 2:5], k * 0.5) and torch.equal(vc[:, 2:5], v)
    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def test_another_tag_misses_the_warm_cache():
    with fresh_inductor_cache():
        assert _compile_once() == (0, 1)  # cold
        assert _compile_once() == (1, 0)  # warm, same lowering sources: a hit
        with torch.compiler.config.patch(cache_key_tag="kvops-lowering-0000000000000000"):
            assert _compile_once() == (0, 1)  # as after a change of the lowerings: compiled anew, never the old code


def test_tag_covers_the_schemas():
    # A warm AOTAutograd cache keyed on a graph of public ops replayed code calling kvops::_paged_attention_native
    # with its older 14-argument schema after the attention features added arguments: schemas are part of the tag.
    names = {str(p.relative_to(pathlib.Path(kvops.__file__).parent)) for p in lowering.schema_sources()}
    expected = {"_library.py", "native/__init__.py", "ops/paged_attention.py", "ops/packed.py", "cpu/packed.py"}
    assert expected <= names, names
    assert "inductor_packed.py" in {p.name for p in lowering.LOWERING_SOURCES}  # the dequantize decomposition
    assert lowering.cache_key_tag() == lowering.cache_key_tag((*lowering.LOWERING_SOURCES,
                                                               *lowering.schema_sources()))
