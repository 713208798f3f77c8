"""Unhappy paths of every cache class (docs/semantics.md): a failing call raises the documented exception, names the
argument and the value, and leaves every tensor byte and cursor as it was.

Each case builds a cache that already holds a stream (so evictions, wraps and quantized chunks are in play), then
makes one invalid call: wrong dtypes, ranks, sizes, devices (meta), key/value mismatches, SDPA's swapped layout,
out-of-range positions, layers and heads, fractional counts. ``tests/unhappy.py:check_failing_call`` snapshots the
whole state (tensor storages bytewise, int cursors, the head-slice dicts) before and after.

``python tests/errors/test_unhappy_caches.py --count`` classifies every case (clear / unclear / silent / crash / hang /
changed-on-failure), each case in a child process; with ``PYTHONPATH`` pointing at another checkout it counts that
code (the numbers of the adversarial review).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unittest

import expecttest
import torch

import kvops
from kvops.cache import PackedCausalKVCache, PagedKVCache, RingCausalKVCache, RollingKVCache
from tests import unhappy_integrations
from tests.contract import raises_everywhere
from tests.unhappy import changed, check_failing_call, snapshot

UNSUPPORTED = torch._dynamo.exc.Unsupported
CASES: dict[str, tuple] = {}  # name -> (build, exc, needles); build() -> (state, call)


def case(name: str, exc: type[BaseException], *needles):
    def register(build):
        assert name not in CASES, name
        CASES[name] = (build, exc, needles)
        return build
    return register


def rand(*shape, dtype=torch.float32, device=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype).to(device) if device != "meta" else torch.empty(
        *shape, dtype=dtype, device="meta")


# --- streams to break ----------------------------------------------------------------------------------------------
B, H, D = 1, 2, 4


def causal(size=8, chunks=3, n=3, cls=kvops.CausalKVCache, **kw):
    """A cache of ``size`` rows after ``chunks`` chunks of ``n`` random tokens (sink 2: the third chunk evicts)."""
    kw.setdefault("sink_tokens", 2)
    c = cls(torch.zeros(B, size, H, D), torch.zeros(B, size, H, D), **kw)
    for i in range(chunks):
        c.update_and_get_attention_kv(rand(B, n, H, D, seed=i), rand(B, n, H, D, seed=100 + i), i * n)
    return c


def packed(quant, chunks=4, **kw):
    c = PackedCausalKVCache.allocate(B, 8, H, D, chunk_tokens=2, quant=quant, keep_recent_chunks=1, sink_tokens=2,
                                     **kw)
    for i in range(chunks):
        c.update_and_get_attention_kv(rand(B, 2, H, D, seed=i), rand(B, 2, H, D, seed=100 + i), 2 * i)
    return c


def rolling():
    c = RollingKVCache.allocate(B, 4, H, D)
    c.write(rand(B, 3, H, D, seed=1), rand(B, 3, H, D, seed=2))
    return c


def paged():
    c = PagedKVCache(num_blocks=4, block_size=2, num_kv_heads=H, head_dim=D, num_layers=2)
    c.add_sequence("a")
    step = c.prepare({"a": 3})  # (the caches stay zero: a valid write would build the native kernel, minutes once)
    return c, step


# --- the streaming caches' update: one family of cases per class -------------------------------------------------
def _update_cases(label: str, make, append_at: int, n: int, *, rewrite_at: int | None = None):
    """Invalid updates of a streaming cache built by ``make()``; ``append_at``/``n``: a valid append of ``n`` tokens
    (it evicts or wraps), ``rewrite_at`` a valid rewrite start."""

    def call(**over):
        def build():
            c = make()
            args = dict(key=rand(B, n, H, D, seed=7), value=rand(B, n, H, D, seed=8), current_chunk_start=append_at)
            args.update(over)
            return c, lambda: c.update_and_get_attention_kv(**args)
        return build

    case(f"{label}_short_value", ValueError, "value of shape (1, 1, 2, 4)", f"key holds {n} tokens, value 1")(
        call(value=rand(B, 1, H, D)))
    case(f"{label}_long_value", ValueError, "value of shape", f"value {n + 1}")(call(value=rand(B, n + 1, H, D)))
    case(f"{label}_key_float64", ValueError, "key dtype torch.float64")(
        call(key=rand(B, n, H, D, dtype=torch.float64)))
    case(f"{label}_value_float16", ValueError, "value dtype torch.float16")(
        call(value=rand(B, n, H, D, dtype=torch.float16)))
    case(f"{label}_key_3d", ValueError, "key must be 4-D", "(1, 3, 8)" if n == 3 else "key")(
        call(key=rand(B, n, H * D)))
    case(f"{label}_value_5d", ValueError, "value must be 4-D")(call(value=rand(B, n, H, D, 1)))
    case(f"{label}_meta_key", ValueError, "key is on meta")(call(key=rand(B, n, H, D, device="meta")))
    case(f"{label}_head_dim", ValueError, "head_dim", "key")(call(key=rand(B, n, H, D + 1)))
    case(f"{label}_batch", ValueError, "batch")(call(key=rand(2, n, H, D), value=rand(2, n, H, D)))
    case(f"{label}_sdpa_layout", ValueError, "SDPA's layout", "key.transpose(1, 2)")(
        call(key=rand(B, H, n + 2, D), value=rand(B, H, n + 2, D)))
    case(f"{label}_head_slice_out_of_range", ValueError, "head slice [2, 3)", "cache_head_start")(
        call(key=rand(B, n, 1, D), value=rand(B, n, 1, D), cache_head_start=2))
    case(f"{label}_negative_head_start", ValueError, "head slice [-1, 0)")(
        call(key=rand(B, n, 1, D), value=rand(B, n, 1, D), cache_head_start=-1))
    case(f"{label}_fractional_start", TypeError, "current_chunk_start must be an int", "1.5")(
        call(current_chunk_start=1.5))
    case(f"{label}_tensor_start", TypeError, "current_chunk_start must be an int", "Tensor")(
        call(current_chunk_start=torch.tensor(append_at)))
    case(f"{label}_negative_recent", ValueError, "recent_window_tokens must be non-negative or None",
         "recent_window_tokens=-2")(call(recent_window_tokens=-2))
    case(f"{label}_fractional_recent", TypeError, "recent_window_tokens must be an int", "0.5")(
        call(recent_window_tokens=0.5))
    return call


for _label, _cls in (("causal", kvops.CausalKVCache), ("ring", RingCausalKVCache)):
    _call = _update_cases(_label, lambda cls=_cls: causal(cls=cls), 9, 3)
    case(f"{_label}_gap", RuntimeError, "Invalid", "write range", "current_start is past global_end",
         "positions [9, 10)")(_call(current_chunk_start=10))
    case(f"{_label}_negative_start", RuntimeError, "write range", "current_start is negative", "current_start=-3")(
        _call(current_chunk_start=-3))
    case(f"{_label}_rewrite_evicted", RuntimeError, "write range", "were already evicted", "current_start >= 3")(
        _call(current_chunk_start=0))
    case(f"{_label}_chunk_too_long", RuntimeError, "write range", "does not fit after the sink rows [0, 2)",
         "2 + 7 > 8")(_call(key=rand(B, 7, H, D), value=rand(B, 7, H, D)))
    case(f"{_label}_window_mode", ValueError, "window_mode must be 'sink'", "'newest'")(
        lambda cls=_cls: ((), lambda: cls(torch.zeros(1, 8, 2, 4), torch.zeros(1, 8, 2, 4), window_mode="newest")))

# growth: the short value must not grow the buffers or the window
_call = _update_cases("causal_growth", lambda: causal(allow_growth=True, chunks=2, n=4, sink_tokens=0), 8, 4)
case("causal_pin_inside_global_sink", ValueError, "pin_current_chunk(8)", "row 0")(
    lambda: (lambda c: (c, lambda: c.pin_current_chunk(8)))(causal(global_sink_tokens=2, chunks=2, n=4)))
case("causal_head_slice_then_bad_range", RuntimeError, "write range")(
    lambda: (lambda c: (c, lambda: c.update_and_get_attention_kv(rand(B, 9, 1, D), rand(B, 9, 1, D), 0, 1)))(
        causal(chunks=0)))
case("ring_pin", ValueError, "pinned chunks are not supported by the ring layout")(
    lambda: (lambda c: (c, lambda: c.pin_current_chunk(3)))(causal(cls=RingCausalKVCache)))
case("ring_wrapping_short_value", ValueError, "key holds 3 tokens, value 2")(
    lambda: (lambda c: (c, lambda: c.update_and_get_attention_kv(rand(B, 3, H, D), rand(B, 2, H, D), 12)))(
        causal(cls=RingCausalKVCache, chunks=4)))

for _quant in (None, "int8", "int4", "int2"):
    _label = f"packed_{_quant or 'dense'}"
    _call = _update_cases(_label, lambda q=_quant: packed(q), 8, 2)
    case(f"{_label}_non_sequential", NotImplementedError, "non-sequential write current_start=10",
         "current_chunk_start=8")(_call(current_chunk_start=10))
    case(f"{_label}_rewrite_size_changed", NotImplementedError, "current-chunk rewrite size changed",
         "holds 2 tokens, the rewrite 1")(_call(current_chunk_start=6, key=rand(B, 1, H, D), value=rand(B, 1, H, D)))
    case(f"{_label}_head_slice_missing", ValueError, "cache_head_start required for head slice",
         "key has 1 heads, the cache 2")(_call(key=rand(B, 2, 1, D), value=rand(B, 2, 1, D)))
    case(f"{_label}_pin_unpinnable", ValueError, "pinnable=True")(
        lambda q=_quant: (lambda c: (c, lambda: c.pin_current_chunk(2)))(packed(q)))
case("packed_window_mode", ValueError, "window_mode must be 'sink'", "'newest'")(
    lambda: ((), lambda: PackedCausalKVCache.allocate(1, 8, 2, 4, chunk_tokens=2, quant=None, window_mode="newest")))


# --- RollingKVCache.write -------------------------------------------------------------------------------------------
def _rolling(**over):
    def build():
        c = rolling()
        args = dict(key=rand(B, 2, H, D, seed=3), value=rand(B, 2, H, D, seed=4))
        args.update(over)
        return c, lambda: c.write(**args)
    return build


case("rolling_key_float64", ValueError, "key dtype torch.float64")(_rolling(key=rand(B, 2, H, D, dtype=torch.float64)))
case("rolling_key_3d", ValueError, "key must be 4-D", "(1, 2, 8)")(_rolling(key=rand(B, 2, H * D)))
case("rolling_meta_key", ValueError, "key is on meta")(_rolling(key=rand(B, 2, H, D, device="meta")))
case("rolling_short_value", ValueError, "key holds 2 tokens, value 1")(_rolling(value=rand(B, 1, H, D)))
case("rolling_sdpa_layout", ValueError, "SDPA's layout")(_rolling(key=rand(B, H, 5, D), value=rand(B, H, 5, D)))
case("rolling_heads", ValueError, "cache_head_start")(_rolling(key=rand(B, 2, 1, D), value=rand(B, 2, 1, D)))
case("rolling_head_dim", ValueError, "head_dim")(_rolling(value=rand(B, 2, H, D + 1)))


# --- PagedKVCache -----------------------------------------------------------------------------------------------------
def _paged(method):
    def build():
        c, step = paged()
        return c, lambda: method(c, step)
    return build


case("paged_extend_fractional", TypeError, "num_tokens must be an int", "1.5")(_paged(lambda c, s: c.extend("a", 1.5)))
case("paged_extend_negative", ValueError, "num_tokens must be >= 0", "-1")(_paged(lambda c, s: c.extend("a", -1)))
case("paged_extend_unknown", ValueError, "unknown sequence 'b'")(_paged(lambda c, s: c.extend("b", 1)))
case("paged_extend_out_of_blocks", kvops.cache.OutOfBlocksError, "blocks")(_paged(lambda c, s: c.extend("a", 99)))
case("paged_prepare_fractional", TypeError, "num_tokens must be an int", "1.5")(
    _paged(lambda c, s: c.prepare({"a": 1.5})))
case("paged_prepare_twice", ValueError, "appears twice")(_paged(lambda c, s: c.prepare([("a", 1), ("a", 1)])))
case("paged_fork_fractional", TypeError, "num_tokens must be an int", "0.5")(
    _paged(lambda c, s: c.fork("a", "b", 0.5)))
case("paged_write_layer_5", ValueError, "layer must be an int in [0, 2)", "5")(
    _paged(lambda c, s: c.write(5, rand(3, H, D), rand(3, H, D), s)))
case("paged_write_layer_negative", ValueError, "layer must be an int in [0, 2)", "-1")(
    _paged(lambda c, s: c.write(-1, rand(3, H, D), rand(3, H, D), s)))
case("paged_write_heads", ValueError, "num_kv_heads=2")(_paged(lambda c, s: c.write(0, rand(3, 1, D), rand(3, 1, D), s)))
case("paged_attention_layer_5", ValueError, "layer must be an int in [0, 2)", "5")(
    _paged(lambda c, s: c.attention(5, rand(3, H, D), s)))
case("paged_attention_layer_float", ValueError, "layer must be an int", "1.0")(
    _paged(lambda c, s: c.attention(1.0, rand(3, H, D), s)))


# --- transformers caches, StreamingLLM forks, transfer endpoints (tests/unhappy_integrations.py) --------------------
unhappy_integrations.add_cases(case)


# --- the tests ---------------------------------------------------------------------------------------------------------
class TestUnhappyCaches(unittest.TestCase):
    """One test per case: the documented exception, the needles, nothing changed."""


def _make_test(name):
    def test(self):
        build, exc, needles = CASES[name]
        state, call = build()
        check_failing_call(self, call, exc, needles, state=state)
    return test


for _name in CASES:
    setattr(TestUnhappyCaches, f"test_{_name}", _make_test(_name))


class TestMessages(expecttest.TestCase):
    """The new messages in full, and in compiled and exported code too (raises_everywhere)."""

    def test_short_value(self):
        c = causal()
        msg = raises_everywhere(self, ValueError, lambda k, v: c.update_and_get_attention_kv(k, v, 9),
                                (rand(B, 3, H, D), rand(B, 2, H, D)), compile_exc=UNSUPPORTED)
        self.assertExpectedInline(msg, """CausalKVCache: key of shape (1, 3, 2, 4) and value of shape (1, 2, 2, 4) must agree in [batch, num_new_tokens, num_heads] (key holds 3 tokens, value 2). Pass the keys and values of the same tokens and heads.""")

    def test_sdpa_layout(self):
        c = causal()
        msg = raises_everywhere(self, ValueError, lambda k, v: c.update_and_get_attention_kv(k, v, 9),
                                (rand(B, H, 5, D), rand(B, H, 5, D)), compile_exc=UNSUPPORTED)
        self.assertExpectedInline(msg, """CausalKVCache: key of shape (1, 2, 5, 4) looks like SDPA's layout [batch, num_heads, seq_len, head_dim] (heads and tokens swapped): its dim 2 (5) is more heads than the cache's 2 KV heads, while dim 1 (2) fits them. The caches take key/value as [batch, num_new_tokens, num_heads, head_dim]: pass key.transpose(1, 2) and value.transpose(1, 2) (or, if key really carries 5 heads, allocate the cache with 5 KV heads).""")

    def test_write_range_negative_start(self):
        c = causal()
        msg = check_failing_call(self, lambda: c.update_and_get_attention_kv(rand(B, 3, H, D), rand(B, 3, H, D), -3),
                                 RuntimeError, state=c)
        self.assertExpectedInline(msg, """Invalid CausalKVCache write range: local=[-4, -1), global_end=9, prev_local_end=8, kv_cache_size=8, num_new_tokens=3, current_start=-3, current_end=0 (current_start is negative: token positions start at 0; pass current_start >= 0 (current_start=9 appends the next chunk))""")

    def test_fractional_start(self):
        c = causal()
        msg = check_failing_call(self, lambda: c.update_and_get_attention_kv(rand(B, 3, H, D), rand(B, 3, H, D), 1.5),
                                 TypeError, state=c)
        self.assertExpectedInline(msg, """CausalKVCache: current_chunk_start must be an int (a token position), got float 1.5. Pass a Python int (e.g. int(current_chunk_start) outside the compiled region).""")

    def test_paged_layer_and_count(self):
        c, step = paged()
        msg = check_failing_call(self, lambda: c.write(5, rand(3, H, D), rand(3, H, D), step), ValueError, state=c)
        self.assertExpectedInline(msg, """PagedKVCache.write: layer must be an int in [0, 2) (the cache holds num_layers=2), got int 5. Pass the layer's index, or build PagedKVCache with more layers.""")
        msg = check_failing_call(self, lambda: c.extend("a", 1.5), TypeError, state=c)
        self.assertExpectedInline(msg, """PagedKVCache.extend: num_tokens must be an int, got float 1.5 for sequence 'a'. Pass a whole number of tokens (int(n)).""")

    def test_adversarial_messages(self):
        """Beam reorder, padding-mask hole, a deeper model, a StreamingLLM fork (tests/unhappy_integrations.py)."""
        names = ("hf_paged_reorder_short", "hf_static_mask_hole", "hf_static_deeper_model",
                 "streaming_fork_evicted_prefix")
        if not set(names) <= set(CASES):
            self.skipTest("transformers is not installed")
        messages = []
        for name in names:
            build, exc, needles = CASES[name]
            state, call = build()
            messages.append(check_failing_call(self, call, exc, needles, state=state))
        self.assertExpectedInline("\n".join(messages), """\
KvopsPagedCache.reorder_cache: beam_idx=[1] has 1 entries but the cache holds batch_size=2 rows; a kvops cache keeps its batch: pass one parent row per row (len(beam_idx) == 2), or build a cache for the new batch size.
kvops attention: attention_mask row 0 has a hole: padding (0) at position 2 between real tokens (1) at positions 0 and 5. kvops attention supports left and right padding only (each row 0...0 1...1 0...0, as generate() builds it); move the padding to the left, or use attn_implementation='sdpa' or 'eager' for such masks.
KvopsStaticCache: a model with num_hidden_layers=4 needs more layers than this cache, which holds 2 layers (from the config it was built with); nothing was written. A cache serves one model: build it from this model's config (KvopsStaticCache(model.config, ...)).
PagedKVCache.fork: num_tokens=32 of 0 includes blocks [1] (token positions [16, 32)) that the parent already evicted (StreamingLLM: window_left=63, sink_tokens=4), and the child's next query at position 32 would read them. Nothing was forked; pass num_tokens=192 or more (a multiple of block_size 16).""")


# --- counting (not part of the suite) ------------------------------------------------------------------------------
def classify(name: str) -> str:
    build, exc, needles = CASES[name]
    state, call = build()
    before = snapshot(state)
    try:
        call()
    except Exception as e:  # noqa: BLE001 -- classifying every outcome is the point
        if changed(before, snapshot(state)):
            return "changed-on-failure"
        message = str(e)
        return "clear" if type(e) is exc and all(str(x) in message for x in needles) else "unclear"
    return "silent"


def _count() -> dict:
    """Every case in a child process (one child for a run of cases): a death by signal is a crash (a new child resumes
    with the next case), a case still running after 60 s a hang."""
    names, outcomes = list(CASES), {}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    while len(outcomes) < len(names):
        todo = [n for n in names if n not in outcomes]
        code = ("import signal\nfrom tests.errors.test_unhappy_caches import classify\n"
                "class Hang(BaseException): pass\n"
                "def alarm(*_): raise Hang()\n"
                "signal.signal(signal.SIGALRM, alarm)\n"
                f"for name in {todo!r}:\n"
                "    signal.alarm(60)\n"
                "    try:\n        out = classify(name)\n    except Hang:\n        out = 'hang'\n"
                "    except Exception:\n        out = 'unclear'\n"
                "    signal.alarm(0)\n"
                "    print(name, out, flush=True)\n")
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
        for line in proc.stdout:
            name, out = line.split()
            outcomes[name] = out
        proc.wait()
        rest = [n for n in todo if n not in outcomes]
        if rest:
            outcomes[rest[0]] = "crash" if proc.returncode < 0 else "unclear"
    return outcomes


if __name__ == "__main__":
    if sys.argv[1:] == ["--count"]:
        out = _count()
        totals: dict[str, int] = {}
        for v in out.values():
            totals[v] = totals.get(v, 0) + 1
        print(json.dumps({"totals": totals, "cases": out}, indent=1))
    else:
        unittest.main()
