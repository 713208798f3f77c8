"""Cache writes whose key/value are views of the caches they write: snapshot semantics in every kernel path.

``key``/``value`` may alias ``k_cache``/``v_cache`` (docs/semantics.md §1, §3): they are read as they were before the
call, as in compiled code (the Inductor lowerings copy such a source out before any store). Checked bit for bit
(``torch.equal``) against a plain reference computed from clones, for every eager path (the paged write's eager fast
path with the native kernel, the op's CPU kernel, the composite kernel, the Triton kernels, interpreted on CPU without
a GPU) and ``torch.compile(fullgraph=True)``; separate caches and K/V views of one joint allocation, NHD and HND.
Sources alias the K cache, the V cache, or both; the written rows overlap the source rows shifted by one row (so a
kernel that reads a source row after writing it gives a different answer).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before kvops.triton is imported (tests/conftest.py sets it too)

import contextlib  # noqa: E402
import itertools  # noqa: E402
import unittest  # noqa: E402
import unittest.mock  # noqa: E402

import kvops  # noqa: E402
import kvops.ops.paged_write as paged_write_ops  # noqa: E402
from kvops.triton import HAS_TRITON  # noqa: E402
from tests.paged.test_paged_write import ref_write  # noqa: E402

P, BS, H, D = 4, 4, 2, 8
# the Triton kernels: on CUDA through the ops (their CUDA kernels), else interpreted on CPU tensors, called directly
CUDA = torch.cuda.is_available()
TRITON_DEVICE = "cuda" if CUDA else "cpu"
SOURCES = [(k, v) for k, v in itertools.product(("K", "V", None), repeat=2) if (k, v) != (None, None)]
# tokens 0..BS-1 are read from block 1 of a cache (when aliased) and land one row later: block 1 rows 1..3, then
# block 2 row 0; a padding token (slot -1) in the middle
SLOTS = torch.tensor([BS + 1, -1, BS + 3, 2 * BS], dtype=torch.int64)
DENSE_SLOTS = torch.tensor([BS + 1, BS + 2, BS + 3, 2 * BS], dtype=torch.int32)  # no padding: no masked copy of key


def paged_caches(joint: bool, kv_layout: str, seed: int = 0, device: str = "cpu"):
    """Random caches ``[P, BS, H, D]`` (NHD) or ``[P, H, BS, D]`` (HND); joint: K/V views of ``[P, BS, 2, H, D]``
    (NHD) or ``[P, 2, H, BS, D]`` (HND, FlashInfer's joint layout)."""
    g = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    if kv_layout == "NHD":
        if joint:
            kv = randn(P, BS, 2, H, D)
            return kv[:, :, 0], kv[:, :, 1]
        return randn(P, BS, H, D), randn(P, BS, H, D)
    if joint:
        kv = randn(P, 2, H, BS, D)
        return kv[:, 0], kv[:, 1]
    return randn(P, H, BS, D), randn(P, H, BS, D)


def nhd(cache, kv_layout):
    return cache if kv_layout == "NHD" else cache.transpose(1, 2)


def paged_sources(k_cache, v_cache, kv_layout, key_src, value_src):
    """``key``/``value`` ``[BS, H, D]``: block 1 of the named cache (a view) or a fresh tensor."""
    fresh = torch.arange(BS * H * D, dtype=torch.float32, device=k_cache.device).view(BS, H, D)
    pick = {"K": nhd(k_cache, kv_layout)[1], "V": nhd(v_cache, kv_layout)[1]}
    return (pick[key_src] if key_src else fresh + 1000), (pick[value_src] if value_src else fresh + 2000)


def paged_reference(k_cache, v_cache, key, value, kv_layout, slots=SLOTS):
    """The caches after the write, from clones of the sources taken before it (NHD views)."""
    cpu = lambda x: x.clone().cpu()  # noqa: E731
    return ref_write(cpu(nhd(k_cache, kv_layout)), cpu(nhd(v_cache, kv_layout)), cpu(key), cpu(value), slots.cpu())


def composite():
    """The composite CPU kernel (kvops/cpu/paged_write.py), as when no C++ compiler is available."""
    return unittest.mock.patch.object(paged_write_ops.native, "use_native", return_value=False)


def paged_eager_paths():
    """name -> (device, callable(key, value, k_cache, v_cache, slots, kv_layout)) running one eager kernel path."""
    paths = {
        "fast path": ("cpu", lambda k, v, kc, vc, s, lay: kvops.paged_cache_write(k, v, kc, vc, s, kv_layout=lay)),
        "op (native)": ("cpu", lambda k, v, kc, vc, s, lay: torch.ops.kvops.paged_cache_write(k, v, kc, vc, s,
                                                                                             kv_layout=lay)),
    }

    def composite_op(k, v, kc, vc, s, lay):
        with composite():
            kvops.paged_cache_write(k, v, kc, vc, s, kv_layout=lay)

    paths["composite"] = ("cpu", composite_op)
    if CUDA:
        paths["triton (CUDA op)"] = ("cuda", paths["op (native)"][1])
    elif HAS_TRITON:
        from kvops.triton import paged_write as triton_paged_write

        paths["triton (interpreted)"] = ("cpu", lambda k, v, kc, vc, s, lay: triton_paged_write.paged_cache_write(
            k, v, nhd(kc, lay), nhd(vc, lay), s, 0, None, None))
    return paths


class TestPagedWriteAliasing(unittest.TestCase):
    def test_eager_paths_read_sources_before_writing(self):
        for (joint, lay), (ks, vs), (name, (device, run)), slots in itertools.product(
                itertools.product((False, True), ("NHD", "HND")), SOURCES, paged_eager_paths().items(),
                (SLOTS, DENSE_SLOTS)):
            with self.subTest(joint=joint, kv_layout=lay, key=ks, value=vs, path=name, padding=bool(slots.min() < 0)):
                kc, vc = paged_caches(joint, lay, device=device)
                key, value = paged_sources(kc, vc, lay, ks, vs)
                want_k, want_v = paged_reference(kc, vc, key, value, lay, slots)
                run(key, value, kc, vc, slots.to(device), lay)
                self.assertTrue(torch.equal(nhd(kc, lay).cpu(), want_k))
                self.assertTrue(torch.equal(nhd(vc, lay).cpu(), want_v))

    def test_head_slice_source_from_other_heads(self):
        """cache_head_start: head 0 of block 1 of the K cache written to head 1 of the next rows (NHD and HND)."""
        for lay, name in itertools.product(("NHD", "HND"), ("fast path", "op (native)", "composite")):
            with self.subTest(kv_layout=lay, path=name):
                kc, vc = paged_caches(False, lay)
                key, value = nhd(kc, lay)[1][:, 0:1], nhd(vc, lay)[1][:, 1:2]
                want_k, want_v = ref_write(nhd(kc, lay), nhd(vc, lay), key.clone(), value.clone(), DENSE_SLOTS, h0=1)
                with composite() if name == "composite" else contextlib.nullcontext():
                    op = torch.ops.kvops.paged_cache_write if name == "op (native)" else kvops.paged_cache_write
                    op(key, value, kc, vc, DENSE_SLOTS, 1, kv_layout=lay)
                self.assertTrue(torch.equal(nhd(kc, lay), want_k) and torch.equal(nhd(vc, lay), want_v))

    def test_sources_are_copied_only_when_they_overlap_a_cache(self):
        """The alias check copies a source only if its bytes may overlap a cache: never a cache, never a fresh
        tensor or a disjoint region of the caches' storage."""
        from kvops.cpu.paged_write import unaliased

        arena = torch.randn(P * BS * H * D + BS * H * D)
        cache = arena[: P * BS * H * D].view(P, BS, H, D)
        after = arena[P * BS * H * D :].view(BS, H, D)  # same storage, disjoint bytes
        fresh = torch.randn(BS, H, D)
        self.assertIs(unaliased(fresh, cache), fresh)
        self.assertIs(unaliased(after, cache), after)
        inside = cache[1]
        copied = unaliased(inside, cache)
        self.assertIsNot(copied, inside)
        self.assertTrue(torch.equal(copied, inside) and copied.untyped_storage().data_ptr() != arena.data_ptr())

    def test_compiled_equals_eager_equals_reference(self):
        """One compile per cache layout, each with a different aliasing (cross K<->V, and within one cache)."""
        cases = ((False, "NHD", "K", "V"), (True, "NHD", "V", "K"), (False, "HND", "V", "K"), (True, "HND", "K", "K"))
        for joint, lay, ks, vs in cases:
            with self.subTest(joint=joint, kv_layout=lay, key=ks, value=vs):
                def step(kc, vc, slots):
                    key, value = paged_sources(kc, vc, lay, ks, vs)
                    kvops.paged_cache_write(key, value, kc, vc, slots, kv_layout=lay)

                torch._dynamo.reset()
                kc, vc = paged_caches(joint, lay)
                want_k, want_v = paged_reference(kc, vc, *paged_sources(kc, vc, lay, ks, vs), lay)
                torch.compile(step, fullgraph=True)(kc, vc, SLOTS)
                eager_k, eager_v = paged_caches(joint, lay)
                step(eager_k, eager_v, SLOTS)
                for mode, got_k, got_v in (("compiled", kc, vc), ("eager", eager_k, eager_v)):
                    self.assertTrue(torch.equal(nhd(got_k, lay), want_k), f"{mode}: k_cache")
                    self.assertTrue(torch.equal(nhd(got_v, lay), want_v), f"{mode}: v_cache")

    def test_rotary_write_reads_sources_before_writing(self):
        """kvops.rotary_paged_cache_write (NHD only): key/value views of the caches, eager and compiled."""
        seqlen_ro, rd = 16, 4
        g = torch.Generator().manual_seed(1)
        cos, sin = torch.randn(seqlen_ro, rd // 2, generator=g), torch.randn(seqlen_ro, rd // 2, generator=g)
        positions = torch.tensor([3, 0, 7, 11])

        def step(kc, vc, slots, ks, vs):
            key, value = paged_sources(kc, vc, "NHD", ks, vs)
            kvops.rotary_paged_cache_write(key, value, kc, vc, slots, positions, cos, sin)

        for joint, (ks, vs), slots in itertools.product((False, True), SOURCES, (SLOTS, DENSE_SLOTS)):
            with self.subTest(joint=joint, key=ks, value=vs, padding=bool(slots.min() < 0)):
                kc, vc = paged_caches(joint, "NHD")
                key, value = paged_sources(kc, vc, "NHD", ks, vs)
                rotated = kvops.apply_rotary(key.clone(), cos, sin, positions)
                want_k, want_v = ref_write(kc, vc, rotated, value.clone(), slots)
                step(kc, vc, slots, ks, vs)
                self.assertTrue(torch.equal(kc, want_k) and torch.equal(vc, want_v))
        torch._dynamo.reset()
        kc, vc = paged_caches(True, "NHD")
        eager_k, eager_v = paged_caches(True, "NHD")
        torch.compile(step, fullgraph=True)(kc, vc, SLOTS, "V", "K")
        step(eager_k, eager_v, SLOTS, "V", "K")
        self.assertTrue(torch.equal(kc, eager_k) and torch.equal(vc, eager_v), "compiled != eager")


# --- contiguous caches -----------------------------------------------------------------------------------------
B, S, T, START = 2, 8, 3, 1  # sources: rows [0, T) of a cache; written rows [START, START + T) overlap them


def contiguous_caches(joint: bool, seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    if joint:
        kv = torch.randn(B, S, 2, H, D, generator=g).to(device)
        return kv[:, :, 0], kv[:, :, 1]
    return torch.randn(B, S, H, D, generator=g).to(device), torch.randn(B, S, H, D, generator=g).to(device)


def contiguous_sources(k_cache, v_cache, key_src, value_src):
    fresh = torch.arange(B * T * H * D, dtype=torch.float32, device=k_cache.device).view(B, T, H, D)
    pick = {"K": k_cache[:, 0:T], "V": v_cache[:, 0:T]}
    return (pick[key_src] if key_src else fresh + 1000), (pick[value_src] if value_src else fresh + 2000)


def contiguous_reference(k_cache, v_cache, key, value):
    want_k, want_v = k_cache.clone(), v_cache.clone()
    want_k[:, START : START + T] = key.clone()
    want_v[:, START : START + T] = value.clone()
    return want_k, want_v


def contiguous_paths(op, triton_call):
    """name -> (device, callable): ``op`` (the public op) on CPU, and the Triton kernels: ``op`` on CUDA, or
    ``triton_call(kvops.triton.contiguous, *args)`` (the launcher, interpreted on CPU tensors) without a GPU."""
    paths = {"op (CPU kernel)": ("cpu", op)}
    if CUDA:
        paths["triton (CUDA op)"] = ("cuda", op)
    elif HAS_TRITON:
        from kvops.triton import contiguous as triton_contiguous

        paths["triton (interpreted)"] = ("cpu", lambda *args: triton_call(triton_contiguous, *args))
    return paths


class TestContiguousWriteAliasing(unittest.TestCase):
    def test_eager_paths_read_sources_before_writing(self):
        paths = contiguous_paths(lambda k, v, kc, vc: kvops.cache_write(k, v, kc, vc, START),
                                 lambda tc, k, v, kc, vc: tc.cache_write(k, v, kc, vc, START, 0))
        for joint, (ks, vs), (name, (device, run)) in itertools.product((False, True), SOURCES, paths.items()):
            with self.subTest(joint=joint, key=ks, value=vs, path=name):
                kc, vc = contiguous_caches(joint, device=device)
                key, value = contiguous_sources(kc, vc, ks, vs)
                want_k, want_v = contiguous_reference(kc, vc, key, value)
                run(key, value, kc, vc)
                self.assertTrue(torch.equal(kc, want_k) and torch.equal(vc, want_v))

    def test_compiled_equals_eager_equals_reference(self):
        for joint, ks, vs in ((False, "K", "V"), (True, "V", "K")):
            with self.subTest(joint=joint, key=ks, value=vs):
                def step(kc, vc):
                    kvops.cache_write(*contiguous_sources(kc, vc, ks, vs), kc, vc, START)

                torch._dynamo.reset()
                kc, vc = contiguous_caches(joint)
                want_k, want_v = contiguous_reference(kc, vc, *contiguous_sources(kc, vc, ks, vs))
                torch.compile(step, fullgraph=True)(kc, vc)
                eager_k, eager_v = contiguous_caches(joint)
                step(eager_k, eager_v)
                for mode, got_k, got_v in (("compiled", kc, vc), ("eager", eager_k, eager_v)):
                    self.assertTrue(torch.equal(got_k, want_k) and torch.equal(got_v, want_v), mode)

    def test_roll_overlapping_ranges_joint_cache(self):
        """cache_roll with overlapping src/dst ranges (both directions) on K/V views of one joint allocation: eager
        (CPU kernel, Triton kernel) and compiled equal a reference computed from a clone of the moved rows."""
        def reference(cache, src, dst, n):
            want = cache.clone()
            want[:, dst : dst + n] = cache[:, src : src + n].clone()
            return want

        paths = contiguous_paths(lambda kc, vc, src, dst, n: kvops.cache_roll(kc, vc, src, dst, n),
                                 lambda tc, kc, vc, src, dst, n: tc.cache_roll(kc, vc, src, dst, n, 0, H))
        for (src, dst, n), (name, (device, run)) in itertools.product(((2, 1, 5), (1, 3, 4)), paths.items()):
            with self.subTest(src=src, dst=dst, path=name):
                kc, vc = contiguous_caches(True, device=device)
                want_k, want_v = reference(kc, src, dst, n), reference(vc, src, dst, n)
                run(kc, vc, src, dst, n)
                self.assertTrue(torch.equal(kc, want_k) and torch.equal(vc, want_v))
        torch._dynamo.reset()
        kc, vc = contiguous_caches(True)
        want_k, want_v = reference(kc, 2, 1, 5), reference(vc, 2, 1, 5)
        torch.compile(lambda kc, vc: kvops.cache_roll(kc, vc, 2, 1, 5), fullgraph=True)(kc, vc)
        self.assertTrue(torch.equal(kc, want_k) and torch.equal(vc, want_v))

    def test_roll_one_cache_passed_as_both(self):
        """k_cache is v_cache: the rows move once (both moves read the rows as they were before the call), eager and
        compiled; overlapping and disjoint ranges."""
        op = lambda c, src, dst, n: kvops.cache_roll(c, c, src, dst, n)  # noqa: E731
        paths = contiguous_paths(op, lambda tc, c, src, dst, n: tc.cache_roll(c, c, src, dst, n, 0, H))
        torch._dynamo.reset()
        paths["compiled"] = ("cpu", torch.compile(op, fullgraph=True))
        for (src, dst, n), (name, (device, run)) in itertools.product(((2, 1, 5), (1, 3, 4), (5, 1, 3), (0, 4, 4)),
                                                                       paths.items()):
            with self.subTest(src=src, dst=dst, n=n, path=name):
                cache = contiguous_caches(False, device=device)[0]
                want = cache.clone()
                want[:, dst : dst + n] = cache[:, src : src + n].clone()
                run(cache, src, dst, n)
                self.assertTrue(torch.equal(cache, want))


if __name__ == "__main__":
    unittest.main()
