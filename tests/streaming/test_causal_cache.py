"""CausalKVCache (docs/semantics.md §1) against a plain-Python oracle of token rows; worked examples; documented
errors.

The oracle keeps, per cache head, a list of row labels (an int per token written, a negative label for a row's initial
sentinel, ``None`` for rows a growth left uninitialized) and per head slice the cursors and the pin. Caches are filled
with a distinct sentinel per element first, so a write or move that touches the wrong row, head or dim shows up.
"""

from __future__ import annotations

import unittest
from collections import Counter

import expecttest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvops import CausalKVCache
from tests.contract import raises_everywhere

UNSUPPORTED = torch._dynamo.exc.Unsupported  # how Dynamo (fullgraph) reports an exception raised by traced Python


# --- values: a label (token or sentinel) -> distinct K and V elements ------------------------------------------
def enc(label: int, b: int, h: int, d: int) -> float:
    return float(label * 64 + b * 32 + h * 4 + d)


def kv_values(labels_by_row, batch, heads, dim):
    """K and V ``[B, len(rows), len(heads), D]`` for row labels (``heads`` are global head indices)."""
    k = [[[[enc(lab, b, h, d) for d in range(dim)] for h in heads] for lab in labels_by_row] for b in range(batch)]
    t = torch.tensor(k, dtype=torch.float64).view(batch, len(labels_by_row), len(heads), dim)
    return t, -t - 0.5


def sentinel_cache(batch, size, heads, dim, fused=False):
    k, v = kv_values([-(r + 1) for r in range(size)], batch, range(heads), dim)
    if not fused:
        return k.clone(), v.clone()
    kv = torch.stack([k, v], dim=2).contiguous()  # [B, S, 2, H, D]
    return kv[:, :, 0], kv[:, :, 1]


# --- the oracle ------------------------------------------------------------------------------------------------
class _Slice:
    def __init__(self):
        self.g, self.l, self.pin = 0, 0, None  # pin: (start row, length)


class Oracle:
    """docs/semantics.md §1 on lists of labels, written from the contract (not from the implementation)."""

    def __init__(self, size, heads, sink=0, global_sink=0, window=None, grow=False):
        self.cap, self.k_sink, self.gs, self.grow = size, sink, global_sink, grow
        self.w = size if window is None else window
        self.rows = [[-(r + 1) for r in range(size)] for _ in range(heads)]  # per head
        self.slices: dict[tuple[int, int], _Slice] = {}
        self.cases: Counter = Counter()  # which §1.6 cases the schedule reached (for coverage checks)

    def sink(self, sl):
        if sl.pin is not None:
            return self.gs + sl.pin[1] if sl.pin[0] == self.gs else self.gs
        return max(self.gs, self.k_sink)

    def call(self, h0, h1, s, labels, recent=None):
        """Returns ("error", type) or (ls, le, L', G', visible labels per head, contiguous)."""
        if recent is not None and recent < 0:
            return ("error", ValueError)
        sl = self.slices.setdefault((h0, h1), _Slice())
        n, e, g, l = len(labels), s + len(labels), sl.g, sl.l
        sink = self.sink(sl)
        cap = self.cap
        if e <= g:  # rewrite
            ls = s - (g - l)
            protected = self.gs if sl.pin is not None else sink
            if ls < 0 or ls + n > cap or (g > l and ls < protected):
                return ("error", RuntimeError)
            new_l, new_g, moved, new_pin = l, g, None, sl.pin
        else:
            if s > g:
                return ("error", RuntimeError)
            a = e - g
            if self.grow and l + a > cap:
                cap = max(l + a, 2 * cap)
            if l + a > cap:
                ev = l + a - cap
                ls = cap - n
                if sl.pin is not None and sl.pin[0] != self.gs:  # pin not yet next to the global sink
                    p, pl = sl.pin
                    middle, pinned, after = list(range(self.gs, p)), list(range(p, p + pl)), list(range(p + pl, l))
                    d1 = min(ev, len(middle))
                    moved = (self.gs, middle[d1:] + pinned + after[ev - d1 :])
                    new_pin = (p - d1, pl)
                else:
                    moved = (sink, list(range(sink + ev, l)))
                    new_pin = sl.pin
            else:
                ls, moved, new_pin = l + a - n, None, sl.pin
            protected = self.gs if sl.pin is not None else sink
            if ls < 0 or (moved is not None and ls < protected):  # an evicting append never lands on the sink
                return ("error", RuntimeError)
            new_l, new_g = ls + n, e
        # commit
        if cap != self.cap:
            keep = max(x.l for x in self.slices.values())
            self.rows = [r[:keep] + [None] * (cap - keep) for r in self.rows]
            if self.w == self.cap:
                self.w = cap
            self.cap = cap
        for h in range(h0, h1):
            rows = self.rows[h]
            if moved is not None:
                dst, src_rows = moved
                vals = [rows[i] for i in src_rows]
                rows[dst : dst + len(vals)] = vals
            rows[ls : ls + n] = labels
        sl.g, sl.l, sl.pin = new_g, new_l, new_pin
        order = self.visible(sl, ls, new_l, recent)
        contiguous = not order or order == list(range(order[0], order[-1] + 1))
        visible = [[self.rows[h][i] for i in order] for h in range(h0, h1)]
        return ls, ls + n, new_l, new_g, visible, contiguous

    def visible(self, sl, ls, new_l, recent):
        """Visible rows after an update (docs/semantics.md §1.6), as a sorted list of row indices."""
        sink = self.sink(sl)
        loose_pin = []  # a pinned chunk not yet next to the global sink, clipped to the rows in use
        if sl.pin is not None and sl.pin[0] != self.gs:
            loose_pin = list(range(sl.pin[0], min(sl.pin[0] + sl.pin[1], new_l)))
        sink_rows = list(range(min(sink, new_l)))
        if recent is not None:  # sink, the loose pin, the r rows before the chunk and the rows from the chunk on
            idx = set(sink_rows) | set(loose_pin) | set(range(max(min(sink, new_l), ls - recent), new_l))
            return sorted(idx)
        a = max(0, new_l - self.w)
        if a == 0 or (sink == 0 and not loose_pin):
            self.cases["window from row 0" if a == 0 else "window [a, L')"] += 1
            return list(range(a, new_l))
        # W is the whole budget: the sink, a pin that starts before a, then the newest W - E - p rows
        pin_rows = loose_pin if loose_pin and loose_pin[0] < a else []
        newest = max(0, self.w - sink - len(pin_rows))
        tail = list(range(max(sink, new_l - newest), new_l))
        view = sink_rows + pin_rows + tail
        self.cases["sink + pin + newest" if pin_rows else "sink + newest"] += 1
        self.cases["pin past the window shown"] += bool(pin_rows) and a > 0
        self.cases["budget exhausted (no newest rows)"] += not tail
        assert view == sorted(set(view)), view  # disjoint and in row order
        return view

    def pin(self, num_tokens):
        if self.k_sink <= 0 or num_tokens <= 0:
            for sl in self.slices.values():
                sl.pin = None
            return None
        slices = list(self.slices.values()) or [_Slice()]
        if any(sl.l - num_tokens < max(0, self.gs) for sl in slices):
            return ValueError
        for sl in self.slices.values():
            sl.pin = (sl.l - num_tokens, min(self.k_sink, num_tokens))
        return None

    def reset(self):
        for sl in self.slices.values():
            sl.g, sl.l, sl.pin = 0, 0, None


# --- a driver that runs one schedule on the cache and the oracle, comparing after every call ---------------------
class Harness:
    def __init__(self, test, batch, size, heads, dim, slices, fused=False, **kwargs):
        self.test, self.batch, self.dim, self.slices = test, batch, dim, slices
        k, v = sentinel_cache(batch, size, heads, dim, fused)
        self.cache = CausalKVCache(k, v, **kwargs)
        self.oracle = Oracle(
            size, heads, kwargs.get("sink_tokens", 0), kwargs.get("global_sink_tokens", 0),
            kwargs.get("attention_window_size"), kwargs.get("allow_growth", False),
        )
        self.next_label = 0
        self.heads = heads

    @property
    def global_end(self):
        return self.oracle.slices[self.slices[0]].g if self.slices[0] in self.oracle.slices else 0

    def expected_cache(self):
        """Expected K, V and a mask of rows whose content is defined (not left uninitialized by a growth)."""
        rows = self.oracle.rows
        labels = [[lab if lab is not None else 0 for lab in r] for r in rows]
        k = torch.stack([kv_values(labels[h], self.batch, [h], self.dim)[0][:, :, 0] for h in range(self.heads)], 2)
        mask = torch.tensor([[lab is not None for lab in r] for r in rows]).T  # [S, H]
        return k, -k - 0.5, mask[None, :, :, None].expand_as(k)

    def check_cache(self):
        k, v, mask = self.expected_cache()
        c = self.cache
        self.test.assertEqual(c.k.shape, k.shape)
        self.test.assertTrue(torch.equal(c.k[mask], k[mask]), "K cache differs from the oracle")
        self.test.assertTrue(torch.equal(c.v[mask], v[mask]), "V cache differs from the oracle")

    def call(self, s, n, recent=None):
        """Every writer (head slice) writes the chunk in lockstep; compare each result with the oracle."""
        for h0, h1 in self.slices:
            labels = list(range(self.next_label, self.next_label + n))
            self.next_label += n
            key, value = kv_values(labels, self.batch, range(h0, h1), self.dim)
            head_start = None if (h0, h1) == (0, self.heads) else h0
            before = (self.cache.k.clone(), self.cache.v.clone())
            want = self.oracle.call(h0, h1, s, labels, recent)
            if want[0] == "error":
                with self.test.assertRaises(want[1]):
                    self.cache.update_and_get_attention_kv(key, value, s, head_start, recent)
                self.test.assertTrue(torch.equal(self.cache.k, before[0]) and torch.equal(self.cache.v, before[1]))
                continue
            got = self.cache.update_and_get_attention_kv(key, value, s, head_start, recent)
            ls, le, lend, gend, visible, contiguous = want
            self.test.assertEqual(tuple(got[2:]), (ls, le, lend, gend))
            vk = torch.stack([kv_values(visible[j], self.batch, [h], self.dim)[0][:, :, 0]
                              for j, h in enumerate(range(h0, h1))], 2)
            self.test.assertTrue(torch.equal(got.k, vk), f"visible K differs: {got.k.flatten()} vs {vk.flatten()}")
            self.test.assertTrue(torch.equal(got.v, -vk - 0.5))
            is_view = got.k.untyped_storage().data_ptr() == self.cache.k.untyped_storage().data_ptr()
            self.test.assertEqual(is_view, contiguous)
            self.check_cache()

    def pin(self, m):
        err = self.oracle.pin(m)
        if err is not None:
            with self.test.assertRaises(err):
                self.cache.pin_current_chunk(m)
        else:
            self.cache.pin_current_chunk(m)

    def reset(self):
        self.oracle.reset()
        self.cache.reset()


# --- hypothesis schedules ----------------------------------------------------------------------------------------
_chunk = st.tuples(
    st.just("chunk"), st.integers(1, 4), st.integers(0, 3), st.booleans(),
    st.none() | st.integers(0, 4), st.none() | st.integers(0, 4),
)  # n, denoising rewrites, context pass, recent_window_tokens, pin_current_chunk(m) afterwards
_call = st.tuples(st.just("call"), st.integers(0, 12), st.integers(0, 2), st.integers(0, 5))  # back, forward, n
_ops = st.lists(st.one_of(_chunk, _chunk, _chunk, _call, st.tuples(st.just("reset"))), min_size=1, max_size=10)


@st.composite
def scenarios(draw):
    size = draw(st.integers(2, 9))
    heads = draw(st.integers(1, 3))
    slicing = draw(st.sampled_from(["full", "split", "partial"]))
    if slicing == "split" and heads > 1:
        slices = [(h, h + 1) for h in range(heads)]
    elif slicing == "partial" and heads > 1:
        slices = [(1, heads)]  # head 0 is never written
    else:
        slices = [(0, heads)]
    kwargs = dict(
        sink_tokens=draw(st.integers(0, min(3, size - 1))),
        global_sink_tokens=draw(st.integers(0, min(2, size - 1))),
        attention_window_size=draw(st.none() | st.integers(1, size + 2)),
        allow_growth=draw(st.booleans()),
    )
    return dict(batch=draw(st.integers(1, 2)), size=size, heads=heads, dim=draw(st.integers(1, 2)), slices=slices,
                fused=draw(st.booleans()), **kwargs), draw(_ops)


@st.composite
def windowed_scenarios(draw):
    """W < S (semantics §1.6): the window starts past the sink; sinks and pins common, growth and head slices too."""
    size = draw(st.integers(4, 12))
    heads = draw(st.integers(1, 2))
    slices = draw(st.sampled_from([[(0, heads)], [(h, h + 1) for h in range(heads)]]))
    kwargs = dict(
        sink_tokens=draw(st.integers(0, 3)),
        global_sink_tokens=draw(st.integers(0, 2)),
        attention_window_size=draw(st.integers(1, size - 1) | st.integers(size // 2, size - 1)),
        allow_growth=draw(st.booleans()),
    )
    chunk = st.tuples(
        st.just("chunk"), st.integers(1, 3), st.integers(0, 1), st.booleans(),
        st.none() | st.none() | st.integers(0, 3), st.none() | st.integers(1, 3),
    )
    ops = draw(st.lists(st.one_of(chunk, chunk, chunk, chunk, _call), min_size=3, max_size=12))
    return dict(batch=1, size=size, heads=heads, dim=draw(st.integers(1, 2)), slices=slices,
                fused=draw(st.booleans()), **kwargs), ops


def run_schedule(h, ops):
    for op in ops:
        if op[0] == "chunk":
            _, n, steps, context, recent, pin = op
            s = h.global_end
            for _ in range(1 + steps + int(context)):  # append, denoising rewrites, clean context pass
                h.call(s, n, recent)
            if pin is not None:
                h.pin(pin)
        elif op[0] == "call":  # rewrites of old chunks, overlapping appends, gaps, chunks longer than the cache
            _, back, fwd, n = op
            h.call(max(0, h.global_end - back) + fwd, n)
        else:
            h.reset()


class TestAgainstOracle(unittest.TestCase):
    @settings(derandomize=True, max_examples=120, deadline=None)
    @given(scenarios())
    def test_random_schedules(self, scenario):
        config, ops = scenario
        run_schedule(Harness(self, **config), ops)

    def test_random_windowed_schedules(self):
        """W < S with sinks, pinned chunks, growth and head slices against the §1.6 oracle; the schedules
        reach every case of the windowed view (checked on the counts, so the test cannot pass vacuously)."""
        seen = Counter()

        @settings(derandomize=True, max_examples=150, deadline=None)
        @given(windowed_scenarios())
        def run(scenario):
            config, ops = scenario
            h = Harness(self, **config)
            run_schedule(h, ops)
            seen.update(h.oracle.cases)

        run()
        for case in ("sink + newest", "sink + pin + newest", "window [a, L')", "budget exhausted (no newest rows)"):
            self.assertGreater(seen[case], 10, (case, seen))

    def test_long_stream_every_feature(self):
        """A fixed long schedule: sink, pin, growth off, head slices, recent windows, well past eviction."""
        h = Harness(self, batch=2, size=10, heads=2, dim=3, slices=[(0, 1), (1, 2)], sink_tokens=2,
                    global_sink_tokens=1, attention_window_size=7)
        for chunk in range(12):
            s = h.global_end
            for step in range(5):
                h.call(s, 3, recent=None if step % 2 else chunk % 3)
            if chunk in (3, 8):
                h.pin(3)


# --- worked examples and focused cases ---------------------------------------------------------------------------
def tokens(*ids, dtype=torch.float32):
    return torch.tensor(ids, dtype=dtype).view(1, -1, 1, 1)


def ids(t):
    return t.flatten().tolist()


class TestWorkedExamples(unittest.TestCase):
    def test_no_sink_eviction(self):
        """docs/semantics.md §1: S=4, no sink: [1,2,3] at 0, then [4,5,6] at 3 -> rows [3,4,5,6]."""
        c = CausalKVCache(torch.zeros(1, 4, 1, 1), torch.zeros(1, 4, 1, 1))
        c.update_and_get_attention_kv(tokens(1, 2, 3), tokens(1, 2, 3), 0)
        r = c.update_and_get_attention_kv(tokens(4, 5, 6), tokens(4, 5, 6), 3)
        self.assertEqual(ids(c.k), [3, 4, 5, 6])
        self.assertEqual(ids(c.v), [3, 4, 5, 6])
        self.assertEqual((r.visible_local_end, r.visible_global_end), (4, 6))
        self.assertEqual((r.local_start_index, r.local_end_index), (1, 4))
        self.assertEqual(ids(r.k), [3, 4, 5, 6])

    def test_sink_eviction(self):
        """docs/semantics.md §1: S=6, sink 2, chunks of 3: [1,1,2,3,3,3] after the chunk at 6, [1,1,3,4,4,4] after
        9."""
        c = CausalKVCache(torch.zeros(1, 6, 1, 1), torch.zeros(1, 6, 1, 1), sink_tokens=2)
        seen = []
        for i in range(4):
            x = tokens(*[i + 1] * 3)
            c.update_and_get_attention_kv(x, x, 3 * i)
            seen.append(ids(c.k))
        self.assertEqual(seen[2], [1, 1, 2, 3, 3, 3])
        self.assertEqual(seen[3], [1, 1, 3, 4, 4, 4])
        self.assertEqual((c.global_end, c.local_end), (12, 6))

    def test_window_is_the_whole_budget(self):
        """docs/semantics.md §1.6: S=6, sink 2, W=3, chunks of 3 (ids 1,1,1 then 2,2,2): after the second chunk
        the view is the 2 sink rows and the newest row (3 rows, as sglang), not the sink plus 3 window rows."""
        c = CausalKVCache(torch.zeros(1, 6, 1, 1), torch.zeros(1, 6, 1, 1), sink_tokens=2, attention_window_size=3)
        views = []
        for i in range(4):
            x = tokens(*[i + 1] * 3)
            r = c.update_and_get_attention_kv(x, x, 3 * i)
            views.append((ids(r.k), ids(r.v), tuple(r[2:])))
        self.assertEqual(views[0], ([1, 1, 1], [1, 1, 1], (0, 3, 3, 3)))  # L' = 3 <= W: every row
        self.assertEqual(views[1], ([1, 1, 2], [1, 1, 2], (3, 6, 6, 6)))  # rows [0, 2) + [5, 6)
        self.assertEqual(views[2], ([1, 1, 3], [1, 1, 3], (3, 6, 6, 9)))  # rows [1,1,2,3,3,3]
        self.assertEqual(views[3], ([1, 1, 4], [1, 1, 4], (3, 6, 6, 12)))
        self.assertNotEqual(r.k.untyped_storage().data_ptr(), c.k.untyped_storage().data_ptr())  # a cat

    def test_window_budget_with_pinned_chunk(self):
        """§1.6 with a pin past the sink that fell before the window: sink, the pinned rows, then W - E - p rows."""
        c = CausalKVCache(torch.zeros(1, 12, 1, 1), torch.zeros(1, 12, 1, 1), sink_tokens=2, global_sink_tokens=1,
                          attention_window_size=5)
        for i in range(2):
            x = tokens(*[i + 1] * 2)
            c.update_and_get_attention_kv(x, x, 2 * i)
        c.pin_current_chunk(2)  # rows [2, 4) hold chunk 2; global sink row 0; E = 1 while the pin is not next to it
        for i in range(2, 5):
            x = tokens(*[i + 1] * 2)
            r = c.update_and_get_attention_kv(x, x, 2 * i)
        self.assertEqual(ids(c.k)[:10], [1, 1, 2, 2, 3, 3, 4, 4, 5, 5])
        self.assertEqual(ids(r.k), [1, 2, 2, 5, 5])  # L' = 10, a = 5: row 0, pinned rows [2, 4), newest 5 - 1 - 2 = 2
        self.assertEqual(len(ids(r.k)), 5)

    def test_window_smaller_than_sink(self):
        """W <= E: no room for newer rows, the view is the sink alone (max(0, W - E - p) = 0 newest rows)."""
        c = CausalKVCache(torch.zeros(1, 6, 1, 1), torch.zeros(1, 6, 1, 1), sink_tokens=3, attention_window_size=2)
        for i in range(2):
            x = tokens(*[i + 1] * 3)
            r = c.update_and_get_attention_kv(x, x, 3 * i)
        self.assertEqual(ids(r.k), [1, 1, 1])
        self.assertEqual(r.k.untyped_storage().data_ptr(), c.k.untyped_storage().data_ptr())  # one range: a view

    def test_recent_window_tokens(self):
        """r = 0: sink + current chunk; r = 1: one row before the chunk too; large r: everything (a view)."""
        c = CausalKVCache(torch.zeros(1, 8, 1, 1), torch.zeros(1, 8, 1, 1), sink_tokens=2)
        for i in range(3):
            x = tokens(*range(10 * i, 10 * i + 2))
            c.update_and_get_attention_kv(x, x, 2 * i)
        x = tokens(20, 21)
        self.assertEqual(ids(c.update_and_get_attention_kv(x, x, 4, recent_window_tokens=0).k), [0, 1, 20, 21])
        self.assertEqual(ids(c.update_and_get_attention_kv(x, x, 4, recent_window_tokens=1).k), [0, 1, 11, 20, 21])
        r = c.update_and_get_attention_kv(x, x, 4, recent_window_tokens=5)
        self.assertEqual(ids(r.k), [0, 1, 10, 11, 20, 21])
        self.assertEqual(r.k.untyped_storage().data_ptr(), c.k.untyped_storage().data_ptr())

    def test_pinned_chunk_moves_then_joins_the_sink(self):
        """LongLive-2 style shot sink: the pinned chunk moves down on eviction, then sits after the global sink."""
        c = CausalKVCache(torch.zeros(1, 6, 1, 1), torch.zeros(1, 6, 1, 1), sink_tokens=2, global_sink_tokens=1)
        for i in range(3):
            x = tokens(*[i + 1] * 2)
            c.update_and_get_attention_kv(x, x, 2 * i)
        c.pin_current_chunk(2)  # rows [4, 6) hold chunk 3
        self.assertEqual((c.pinned_start, c.pinned_len), (4, 2))
        x = tokens(4, 4)
        r = c.update_and_get_attention_kv(x, x, 6)
        self.assertEqual(ids(c.k), [1, 2, 3, 3, 4, 4])  # rows between the global sink and the pin go first
        self.assertEqual(ids(r.k), [1, 2, 3, 3, 4, 4])
        self.assertEqual(c.pinned_start, 2)
        x = tokens(5, 5)
        c.update_and_get_attention_kv(x, x, 8)
        self.assertEqual(ids(c.k), [1, 3, 3, 4, 5, 5])  # one row before the pin, then one after it
        self.assertEqual(c.pinned_start, 1)  # next to the global sink: the effective sink is 1 + 2 rows
        x = tokens(6, 6)
        r = c.update_and_get_attention_kv(x, x, 10)
        self.assertEqual(ids(c.k), [1, 3, 3, 5, 6, 6])
        self.assertEqual(ids(r.k), [1, 3, 3, 5, 6, 6])

    def test_pinned_chunk_is_never_evicted(self):
        """An eviction larger than the gap between sink and pin evicts around the pin."""
        c = CausalKVCache(torch.zeros(1, 6, 1, 1), torch.zeros(1, 6, 1, 1), sink_tokens=1)
        for i in range(3):
            x = tokens(*[i + 1] * 2)
            c.update_and_get_attention_kv(x, x, 2 * i)
        c.pin_current_chunk(2)  # pins 1 row (min(K, n)) at row 4
        x = tokens(7, 7, 7, 7, 7)
        c.update_and_get_attention_kv(x, x, 6)
        self.assertEqual(ids(c.k)[0], 3)
        self.assertEqual(c.pinned_start, 0)
        self.assertEqual(ids(c.k)[1:], [7, 7, 7, 7, 7])

    def test_growth_keeps_rows_and_fused_layout(self):
        kv = torch.zeros(1, 2, 2, 1, 1)
        c = CausalKVCache(kv[:, :, 0], kv[:, :, 1], allow_growth=True)
        for i in range(3):
            x = tokens(*range(10 * i, 10 * i + 3))
            r = c.update_and_get_attention_kv(x, -x, 3 * i)
        self.assertEqual(c.cache_size, 16)  # 2 -> max(0 + 3, 4) = 4 -> max(3 + 3, 8) = 8 -> max(6 + 3, 16) = 16
        self.assertEqual(c.k.untyped_storage().data_ptr(), c.v.untyped_storage().data_ptr())
        self.assertEqual(ids(r.k), [0, 1, 2, 10, 11, 12, 20, 21, 22])
        self.assertEqual(ids(r.v), [-x for x in ids(r.k)])
        self.assertEqual(c.attention_window_size, c.cache_size)


class TestVisibleRows(unittest.TestCase):
    """The pure row-range function shared by the §1 caches (kvops/cache/_window.py), docs/semantics.md §1.6."""

    def test_cases(self):
        from kvops.cache._window import visible_rows

        cases = [  # (L', W, E, pinned_start, pinned_len, ls, r) -> ranges
            ((6, 3, 2, -1, 0, 3, None), [(0, 2), (5, 6)]),  # semantics §1.6's example: sink + newest W - E rows
            ((3, 3, 2, -1, 0, 0, None), [(0, 3)]),  # L' <= W: every row, one range
            ((8, 3, 0, -1, 0, 6, None), [(5, 8)]),  # no sink: [L' - W, L')
            ((10, 5, 1, 2, 2, 8, None), [(0, 1), (2, 4), (8, 10)]),  # pin before a: sink, pin, W - E - p newest
            ((10, 5, 1, 6, 2, 8, None), [(0, 1), (6, 10)]),  # pin at/after a: only as part of the newest rows
            ((10, 5, 0, 2, 2, 8, None), [(2, 4), (7, 10)]),  # no sink, pin before a: pin, W - p newest
            ((6, 2, 3, -1, 0, 3, None), [(0, 3)]),  # W <= E: the sink alone
            ((8, 3, 2, -1, 0, 6, 0), [(0, 2), (6, 8)]),  # recent_window_tokens=0: sink + chunk
            ((8, 3, 2, -1, 0, 6, 9), [(0, 8)]),  # sink and recent rows meet: one range
            ((0, 3, 2, -1, 0, 0, None), [(0, 0)]),  # nothing visible
        ]
        for args, want in cases:
            with self.subTest(args=args):
                self.assertEqual(visible_rows(*args), want)


class TestFocused(unittest.TestCase):
    def test_allocate_fused_and_separate(self):
        c = CausalKVCache.allocate(2, 5, 3, 80, dtype=torch.bfloat16, fused_kv=True)
        self.assertEqual(c.k.shape, (2, 5, 3, 80))
        self.assertEqual(c.k.untyped_storage().data_ptr(), c.v.untyped_storage().data_ptr())
        c = CausalKVCache.allocate(1, 4, 2, 80, head_dim_v=64)
        self.assertEqual((c.k.shape, c.v.shape), ((1, 4, 2, 80), (1, 4, 2, 64)))

    def test_bf16_head_dim_80_strided_head_view(self):
        """A cache that is a head slice of a wider allocation (strided): written in place, other heads untouched."""
        big = torch.full((2, 6, 5, 80), -3.0, dtype=torch.bfloat16)
        big_v = torch.full((2, 6, 5, 64), -4.0, dtype=torch.bfloat16)
        c = CausalKVCache(big[:, :, 1:4], big_v[:, :, 1:4], sink_tokens=1)
        g = torch.Generator().manual_seed(0)
        chunks = []
        for i in range(4):
            k = torch.randn(2, 2, 3, 80, generator=g).to(torch.bfloat16)
            v = torch.randn(2, 2, 3, 64, generator=g).to(torch.bfloat16)
            r = c.update_and_get_attention_kv(k, v, 2 * i)
            chunks.append((k, v))
        self.assertTrue(torch.equal(big[:, :, 0], torch.full_like(big[:, :, 0], -3.0)))
        self.assertTrue(torch.equal(big[:, :, 4], torch.full_like(big[:, :, 4], -3.0)))
        # rows: sink token 0, then tokens 3..7 (chunks 1 (second token), 2, 3)
        want_k = torch.cat([chunks[0][0][:, :1], chunks[1][0][:, 1:], chunks[2][0], chunks[3][0]], 1)
        want_v = torch.cat([chunks[0][1][:, :1], chunks[1][1][:, 1:], chunks[2][1], chunks[3][1]], 1)
        self.assertTrue(torch.equal(big[:, :, 1:4], want_k) and torch.equal(big_v[:, :, 1:4], want_v))
        self.assertTrue(torch.equal(r.k, want_k) and torch.equal(r.v, want_v))

    def test_zero_length_chunk(self):
        c = CausalKVCache(torch.zeros(1, 4, 1, 1), torch.zeros(1, 4, 1, 1))
        r = c.update_and_get_attention_kv(tokens(), tokens(), 0)
        self.assertEqual((r.k.shape[1], tuple(r[2:])), (0, (0, 0, 0, 0)))
        c.update_and_get_attention_kv(tokens(1, 2), tokens(1, 2), 0)
        r = c.update_and_get_attention_kv(tokens(), tokens(), 2)
        self.assertEqual((ids(r.k), tuple(r[2:])), ([1, 2], (2, 2, 2, 2)))

    def test_lockstep_head_slices_have_their_own_cursors(self):
        c = CausalKVCache(torch.zeros(1, 4, 2, 1), torch.zeros(1, 4, 2, 1))
        for s in (0, 3):
            x = tokens(s + 1, s + 2, s + 3)
            c.update_and_get_attention_kv(x, x, s, cache_head_start=0)
            if s:
                with self.assertRaises(RuntimeError):
                    c.global_end  # the slices disagree mid-step
            r = c.update_and_get_attention_kv(x + 10, x + 10, s, cache_head_start=1)
        self.assertEqual((c.global_end, c.local_end), (6, 4))
        self.assertEqual(ids(c.k[:, :, 0]), [3, 4, 5, 6])  # each slice rolled its own heads once
        self.assertEqual(ids(c.k[:, :, 1]), [13, 14, 15, 16])
        self.assertEqual(ids(r.k), [13, 14, 15, 16])

    def test_can_direct_current_attention(self):
        c = CausalKVCache(torch.zeros(1, 4, 1, 1), torch.zeros(1, 4, 1, 1))
        self.assertTrue(c.can_direct_current_attention(4))
        self.assertFalse(c.can_direct_current_attention(3))
        self.assertFalse(CausalKVCache(c.k, c.v, sink_tokens=1).can_direct_current_attention(4))
        self.assertFalse(CausalKVCache(c.k, c.v, attention_window_size=2).can_direct_current_attention(4))

    def test_reset_indices(self):
        c = CausalKVCache(torch.zeros(1, 4, 1, 1), torch.zeros(1, 4, 1, 1), sink_tokens=1)
        c.update_and_get_attention_kv(tokens(1, 2), tokens(1, 2), 0)
        c.pin_current_chunk(2)
        c.reset()
        self.assertEqual((c.global_end, c.local_end, c.pinned_start, c.pinned_len), (0, 0, -1, 0))
        r = c.update_and_get_attention_kv(tokens(7), tokens(7), 0)
        self.assertEqual(ids(r.k), [7])


# --- every documented error, identical in eager, torch.compile(fullgraph=True) and torch.export -----------------
def streamed(size=4, heads=1, chunks=((1, 2, 3), (4, 5, 6)), **kwargs):
    c = CausalKVCache(torch.zeros(1, size, heads, 1), torch.zeros(1, size, heads, 1), **kwargs)
    s = 0
    for ch in chunks:
        x = tokens(*ch).expand(1, len(ch), heads, 1).contiguous()
        c.update_and_get_attention_kv(x, x, s)
        s += len(ch)
    return c


class TestErrors(expecttest.TestCase):
    def check(self, exc, fn, *args):
        return raises_everywhere(self, exc, fn, args, compile_exc=UNSUPPORTED)

    def test_requires_cache_head_start(self):
        c = streamed(heads=4, chunks=())
        msg = self.check(ValueError, lambda k, v: c.update_and_get_attention_kv(k, v, 0), torch.zeros(1, 2, 2, 1),
                         torch.zeros(1, 2, 2, 1))
        self.assertExpectedInline(msg, """CausalKVCache requires cache_head_start when cache heads (4) differ from input heads (2). If the model has 2 KV heads, allocate the cache with 2 KV heads (num_kv_heads=2). A head slice is for several writers filling one cache (tensor-parallel writers): then pass cache_head_start (0 <= cache_head_start <= 2) to write the input heads as heads [cache_head_start, cache_head_start + 2), and have the other writers fill the other heads before attention. Or pass key/value with all 4 heads.""")

    def test_head_slice_out_of_range(self):
        c = streamed(heads=4, chunks=())
        msg = self.check(ValueError, lambda k, v: c.update_and_get_attention_kv(k, v, 0, 3), torch.zeros(1, 2, 2, 1),
                         torch.zeros(1, 2, 2, 1))
        self.assertExpectedInline(msg, """CausalKVCache: head slice [3, 5) is outside the cache's heads [0, 4). Pass 0 <= cache_head_start <= 2 for 2 input heads.""")

    def test_overlapping_head_slices(self):
        c = streamed(heads=4, chunks=())
        c.update_and_get_attention_kv(torch.zeros(1, 2, 2, 1), torch.zeros(1, 2, 2, 1), 0, cache_head_start=0)
        msg = self.check(ValueError, lambda k, v: c.update_and_get_attention_kv(k, v, 0, 1), torch.zeros(1, 2, 2, 1),
                         torch.zeros(1, 2, 2, 1))
        self.assertExpectedInline(msg, """CausalKVCache: head slice [1, 3) overlaps head slice [0, 2), which holds tokens (global_end=2). Writers must use disjoint head slices (or the same one); call reset() before streaming with another slicing of the heads.""")

    def test_rewrite_of_evicted_chunk(self):
        c = streamed()  # rows [3, 4, 5, 6], global_end 6
        msg = self.check(RuntimeError, lambda k: c.update_and_get_attention_kv(k, k, 0), tokens(1, 2, 3))
        self.assertExpectedInline(msg, """Invalid CausalKVCache write range: local=[-2, 1), global_end=6, prev_local_end=4, kv_cache_size=4, num_new_tokens=3, current_start=0, current_end=3 (the chunk starts before position 2, the oldest one held after the sink: positions [0, 2) were already evicted (rows [0, 4) hold positions [2, 6)); rewrite only tokens still cached (current_start >= 2) or append at current_start=6)""")

    def test_chunk_longer_than_cache(self):
        c = streamed(chunks=())
        msg = self.check(RuntimeError, lambda k: c.update_and_get_attention_kv(k, k, 0), tokens(1, 2, 3, 4, 5))
        self.assertExpectedInline(msg, """Invalid CausalKVCache write range: local=[-1, 4), global_end=0, prev_local_end=0, kv_cache_size=4, num_new_tokens=5, current_start=0, current_end=5 (the chunk of 5 tokens is longer than the cache's 4 rows; use a larger cache, smaller chunks or allow_growth=True)""")

    def test_rewrite_of_evicted_chunk_onto_the_sink(self):
        c = streamed(size=6, chunks=((1, 1, 1), (2, 2, 2), (3, 3, 3)), sink_tokens=2)  # rows [1,1,2,3,3,3]
        msg = self.check(RuntimeError, lambda k: c.update_and_get_attention_kv(k, k, 3), tokens(2, 2, 2))
        self.assertExpectedInline(msg, """Invalid CausalKVCache write range: local=[0, 3), global_end=9, prev_local_end=6, kv_cache_size=6, num_new_tokens=3, current_start=3, current_end=6 (the chunk starts before position 5, the oldest one held after the sink: positions [2, 5) were already evicted (rows [0, 2) hold the sink, rows [2, 6) positions [5, 9)); rewrite only tokens still cached (current_start >= 5) or append at current_start=9)""")

    def test_evicting_append_would_overwrite_the_sink(self):
        c = streamed(size=6, chunks=((1, 1, 1), (2, 2, 2)), sink_tokens=4)  # rows [1,1,1,2,2,2], sink rows [0, 4)
        msg = self.check(RuntimeError, lambda k: c.update_and_get_attention_kv(k, k, 6), tokens(3, 3, 3))
        self.assertExpectedInline(msg, """Invalid CausalKVCache write range: local=[3, 6), global_end=6, prev_local_end=6, kv_cache_size=6, num_new_tokens=3, current_start=6, current_end=9 (the chunk does not fit after the sink rows [0, 4): sink + num_new_tokens must be <= kv_cache_size (4 + 3 > 6); use a larger cache or smaller chunks)""")

    def test_gap_after_global_end(self):
        c = streamed(size=8)
        msg = self.check(RuntimeError, lambda k: c.update_and_get_attention_kv(k, k, 7), tokens(1))
        self.assertExpectedInline(msg, """Invalid CausalKVCache write range: local=[7, 8), global_end=6, prev_local_end=6, kv_cache_size=8, num_new_tokens=1, current_start=7, current_end=8 (current_start is past global_end: positions [6, 7) would never be written; pass current_start <= 6)""")

    def test_recent_window_tokens_negative(self):
        c = streamed()
        msg = self.check(ValueError, lambda k: c.update_and_get_attention_kv(k, k, 6, recent_window_tokens=-1),
                         tokens(7))
        self.assertExpectedInline(msg, """recent_window_tokens must be non-negative or None (got recent_window_tokens=-1; 0 shows the sink and the current chunk only)""")

    def test_dtype_mismatch(self):
        c = streamed()
        msg = self.check(ValueError, lambda k: c.update_and_get_attention_kv(k, k, 6), tokens(7, dtype=torch.float64))
        self.assertExpectedInline(msg, """CausalKVCache: key dtype torch.float64 does not match k_cache dtype torch.float32. Cast key to torch.float32.""")

    def test_batch_mismatch_shows_the_key_as_given(self):
        c = streamed()
        msg = self.check(ValueError, lambda k: c.update_and_get_attention_kv(k, k, 6), tokens(7, 8, 9).expand(2, 3, 1, 1))
        self.assertExpectedInline(msg, """CausalKVCache: batch mismatch: key has shape (2, 3, 1, 1) (batch 2) but k_cache has shape (1, 4, 1, 1) (batch 1).""")

    def test_pin_inside_global_sink(self):
        c = streamed(size=8, chunks=((1, 1),), sink_tokens=2, global_sink_tokens=2)
        msg = self.check(ValueError, lambda x: c.pin_current_chunk(x.shape[1]), tokens(1, 1))
        self.assertExpectedInline(msg, """CausalKVCache.pin_current_chunk(2): the chunk would start at row 0 (local_end=2 minus 2), which is before row 0 or inside the global sink [0, 2). Pin a chunk right after appending it past the global sink.""")

    def test_constructor_errors(self):
        msg = self.check(ValueError, lambda k: CausalKVCache(k, k, sink_tokens=-1), torch.zeros(1, 4, 1, 1))
        self.assertExpectedInline(msg, """CausalKVCache: sink_tokens (-1) and global_sink_tokens (0) must be >= 0.""")
        msg = self.check(ValueError, lambda k: CausalKVCache(k, k, attention_window_size=-1), torch.zeros(1, 4, 1, 1))
        self.assertExpectedInline(msg, """CausalKVCache: attention_window_size must be >= 1 (or None or 0 for the cache size, as sglang's caches), got -1.""")
        self.assertEqual(CausalKVCache(torch.zeros(1, 4, 1, 1), torch.zeros(1, 4, 1, 1),
                                       attention_window_size=0).attention_window_size, 4)  # sglang's default: S
        msg = self.check(ValueError, lambda k: CausalKVCache(k, k, sink_tokens=4), torch.zeros(1, 4, 1, 1))
        self.assertExpectedInline(msg, """CausalKVCache: sink_tokens (4) and global_sink_tokens (0) must be smaller than the cache size (4 rows), leaving room for the chunks after the sink.""")

    def test_errors_leave_the_cache_untouched(self):
        c = streamed(size=6, chunks=((1, 1, 1), (2, 2, 2), (3, 3, 3)), sink_tokens=2)
        before = (c.k.clone(), c.global_end, c.local_end)
        for s in (0, 3, 10):
            with self.assertRaises(RuntimeError):
                c.update_and_get_attention_kv(tokens(9, 9, 9), tokens(9, 9, 9), s)
        self.assertTrue(torch.equal(c.k, before[0]))
        self.assertEqual((c.global_end, c.local_end), before[1:])


if __name__ == "__main__":
    unittest.main()
