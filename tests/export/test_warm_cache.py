"""Streaming loops compile the same graphs in a second process on warm on-disk caches (docs/compile.md).

Two subprocesses share one fresh ``TORCHINDUCTOR_CACHE_DIR`` and run, with torch's default configuration (FX graph
cache, AOTAutograd cache and automatic dynamic shapes on), the block-causal loop of tests/streaming/test_causal_compile.py under
``torch.compile(fullgraph=True)`` with Inductor: a sink stream, and a pinned stream with a window smaller than the
cache. The first process compiles cold; the second finds every graph in the FX graph cache. Before the fix the second
compiled more graphs (sink: 3 -> 8, at the default ``recompile_limit``; pinned: past it, ``FailOnRecompileLimitHit``),
because on a hit torch 2.13 re-evaluates the stored guards and their ``Max``/``Min`` terms specialized (see
kvops/cache/_clamp.py). The outputs of both processes must also be bit-equal.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys
import torch, torch._dynamo
from torch._dynamo.utils import counters
from tests.streaming.test_causal_compile import forward, make_caches, stream

KINDS = {  # name: (cache kwargs, stream kwargs); chunks of 2 tokens, past eviction
    "sink": (dict(layers=1, sink_tokens=1), dict(chunks=4, steps=1)),
    "pinned+window": (dict(layers=1, size=8, sink_tokens=2, global_sink_tokens=2, attention_window_size=6),
                      dict(chunks=5, steps=1, pin_after=(2,))),
}
out = {}
for name, (cache_kwargs, stream_kwargs) in KINDS.items():
    torch._dynamo.reset()
    counters.clear()
    outs = stream(torch.compile(forward, fullgraph=True), make_caches(**cache_kwargs), **stream_kwargs)
    out[name] = dict(graphs=counters["stats"]["unique_graphs"], hits=counters["inductor"]["fxgraph_cache_hit"],
                     checksum=[float(o.double().sum()) for o in outs])
print("RESULT " + json.dumps(out))
"""


def _run_child(cache_dir: Path, child: str = CHILD) -> dict:
    # torch's defaults: drop any cache/compile switches of the calling environment, keep only our cache dir.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TORCH_COMPILE", "TORCHDYNAMO"))}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", child], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def test_second_process_compiles_no_more_graphs(tmp_path):
    cold = _run_child(tmp_path)
    warm = _run_child(tmp_path)
    for name in cold:
        assert cold[name]["hits"] == 0, (name, cold[name])  # a fresh cache dir: everything compiled
        assert warm[name]["hits"] > 0, (name, warm[name])  # the second process did use the warm FX graph cache
        assert warm[name]["graphs"] <= cold[name]["graphs"], (name, cold[name]["graphs"], warm[name]["graphs"])
        assert warm[name]["checksum"] == cold[name]["checksum"], name


PACKED_CHILD = r"""
import json, sys
import torch, torch._dynamo
from torch._dynamo.utils import counters
from kvops.cache import PackedCausalKVCache
from tests.packed.test_packed_compile import B, D, H, forward, forward_segments, stream

def both(x, caches, s, recent=None):  # update_and_get_attention_kv on the first cache, update() on the second
    return forward_segments(forward(x, caches[:1], s, recent), caches[1:], s, recent)

torch._dynamo.reset()
caches = [PackedCausalKVCache.allocate(B, sink + 6, H, D, chunk_tokens=2, quant=quant, keep_recent_chunks=1,
                                       sink_tokens=sink, dtype=torch.float32)
          for quant, sink in (("int8", 0), ("int4", 2))]
outs, _ = stream(torch.compile(both, fullgraph=True), caches, 6, 2, steps=1)  # a window of 3 chunks, past eviction
out = {"packed": dict(graphs=counters["stats"]["unique_graphs"], hits=counters["inductor"]["fxgraph_cache_hit"],
                      checksum=[float(o.double().sum()) for o in outs])}
print("RESULT " + json.dumps(out))
"""


def test_packed_second_process_compiles_no_more_graphs(tmp_path):
    """The same for kvops.PackedCausalKVCache: one stream through ``update_and_get_attention_kv`` of an int8 cache
    without a sink and ``update()`` + ``kvops.packed.packed_attention`` of an int4 cache with one. Before its clamps
    were built on kvops/cache/_clamp.py the warm process hit the default ``recompile_limit`` of 8 here
    (``FailOnRecompileLimitHit``; measured alone, an int8 ``update_and_get_attention_kv`` stream of 7 chunks of 4
    tokens compiled 5 graphs cold and 7 warm, the ``update()`` + ``packed_attention`` int4 stream with a 4-token
    sink 6 cold and 8 warm)."""
    cold = _run_child(tmp_path, PACKED_CHILD)
    warm = _run_child(tmp_path, PACKED_CHILD)
    for name in cold:  # (a cold stream may hit a graph it compiled itself: the rewrite of a repeated shape)
        assert warm[name]["hits"] > cold[name]["hits"], (name, cold[name], warm[name])
        assert warm[name]["graphs"] <= cold[name]["graphs"], (name, cold[name]["graphs"], warm[name]["graphs"])
        assert warm[name]["checksum"] == cold[name]["checksum"], name


NATIVE_CHILD = r"""
import json
import torch
from torch._dynamo.utils import counters
import kvops
from tests.paged.test_paged_attention import make_inputs

inputs = make_inputs(3, [37, 5, 0], [2, 1, 1], block_size=16, h_q=4, h_kv=2, d=16)
args = [inputs[k] for k in ("q", "k_cache", "v_cache", "cu_seqlens_q", "seq_lens", "block_table")]
f = torch.compile(lambda *a: kvops.paged_attention(*a, 2, window_left=20, return_lse=True), fullgraph=True)
out, lse = f(*args)
print("RESULT " + json.dumps(dict(hits=counters["inductor"]["fxgraph_cache_hit"], native=kvops.native.available(),
                                  out=out.double().flatten().tolist(), lse=lse.double().flatten().tolist())))
"""


def test_graph_cached_with_the_native_kernel_runs_without_it(tmp_path):
    """A graph compiled (and stored in the on-disk FX graph cache) while the native CPU kernel was available calls
    ``kvops::_paged_attention_native``; a later process with ``KVOPS_NATIVE=0`` (or no C++ compiler) loads that graph.
    Before the fix the op did not exist there (``AttributeError: '_OpNamespace' 'kvops' object has no attribute
    '_paged_attention_native'``); now its schema is always defined and runs the composite kernel without the build."""
    import math
    from unittest import mock

    with_native = _run_child(tmp_path, NATIVE_CHILD)
    with mock.patch.dict(os.environ, {"KVOPS_NATIVE": "0"}):
        without = _run_child(tmp_path, NATIVE_CHILD)
    assert with_native["native"] and not without["native"]
    assert without["hits"] > 0, without["hits"]  # the second process did reuse the graph with the native call
    for name in ("out", "lse"):  # two kernels, one attention (fp32 accumulation in both)
        for a, b in zip(with_native[name], without[name], strict=True):
            assert a == b or abs(a - b) <= 1e-5 + 1e-5 * abs(b), (name, a, b)
    assert any(math.isinf(x) for x in with_native["lse"])  # (the empty sequence's row: -inf in both)
