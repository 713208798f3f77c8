"""RollingKVCache: transformers' sliding-window layer semantics, bit-exact against a plain list of kept tokens."""

from __future__ import annotations

import pytest
import torch

from kvops.cache import RollingKVCache

W, H, D = 5, 2, 3


def tokens(first: int, n: int, batch: int = 2):
    """Token ``g`` is filled with the value ``g`` (K) and ``-g`` (V), per batch row offset by 1000*b."""
    g = torch.arange(first, first + n, dtype=torch.float32).view(1, n, 1, 1)
    k = (g + 1000 * torch.arange(batch).view(batch, 1, 1, 1)).expand(batch, n, H, D).clone()
    return k, -k


def expected_window(total: int, batch: int = 2):
    """The K/V a sliding window of W holds after ``total`` tokens, in position order."""
    first = max(0, total - W)
    return tokens(first, total - first, batch)


def run(chunks):
    cache = RollingKVCache.allocate(2, W, H, D)
    g = 0
    for n in chunks:
        cache.write(*tokens(g, n))
        g += n
    return cache


@pytest.mark.parametrize("chunks", [[1] * 13, [3, 4, 6], [2, 3, 8], [13], [7, 1, 5], [4, 9]])
def test_writes_end_in_the_same_state(chunks):
    """Token-by-token, chunked (crossing the wrap point) and oversized writes: identical buffers and windows."""
    ref = run([1] * 13)
    cache = run(chunks)
    assert cache.global_end == 13 and cache.length == W and cache.window_start == 8
    assert torch.equal(cache.k_cache, ref.k_cache) and torch.equal(cache.v_cache, ref.v_cache)
    k, v, start = cache.window()
    ek, ev = expected_window(13)
    assert int(start) == 8 and torch.equal(k, ek) and torch.equal(v, ev)


def test_not_rolled_at_w_then_holds_1_to_w():
    cache = run([W])
    ek, ev = tokens(0, W)
    assert torch.equal(cache.k_cache, ek) and torch.equal(cache.v_cache, ev)  # row r holds token r: not rolled
    cache.write(*tokens(W, 1))
    k, v, start = cache.window()
    ek, ev = tokens(1, W)
    assert int(start) == 1 and torch.equal(k, ek) and torch.equal(v, ev)  # tokens 1..W


def test_prefill_longer_than_window_keeps_last_w():
    cache = run([W + 4])
    k, v, start = cache.window()
    ek, ev = tokens(4, W)
    assert cache.length == W and int(start) == 4 and torch.equal(k, ek) and torch.equal(v, ev)


@pytest.mark.parametrize("total", [0, 1, 3])
def test_partial_window(total):
    cache = run([total] if total else [])
    k, v, start = cache.window()
    ek, ev = expected_window(total)
    assert int(start) == 0 and cache.length == total
    assert torch.equal(k[:, :total], ek) and torch.equal(v[:, :total], ev)


def test_strided_joint_cache_written_in_place():
    """K and V as views of one [B, W, 2, H, D] allocation (never copied)."""
    kv = torch.zeros(2, W, 2, H, D)
    cache = RollingKVCache(kv[:, :, 0], kv[:, :, 1])
    for g in range(8):
        cache.write(*tokens(g, 1))
    ref = run([8])
    assert torch.equal(kv[:, :, 0], ref.k_cache) and torch.equal(kv[:, :, 1], ref.v_cache)


def test_compiled_decode_loop_two_graphs():
    """Decode writes + window reads across the fill point compile to <= 2 graphs (G is a dynamic int)."""
    cnt = torch._dynamo.testing.CompileCounter()

    @torch.compile(fullgraph=True, backend=cnt)
    def step(cache, key, value):
        cache.write(key, value)
        return cache.window()

    cache, ref = RollingKVCache.allocate(2, W, H, D), RollingKVCache.allocate(2, W, H, D)
    for g in range(12):
        k, v, start = step(cache, *tokens(g, 1))
        ref.write(*tokens(g, 1))
        rk, rv, rstart = ref.window()
        assert torch.equal(k, rk) and torch.equal(v, rv) and int(start) == int(rstart)
    assert cnt.frame_count <= 2


def test_bad_caches():
    with pytest.raises(ValueError, match=r"RollingKVCache: k_cache and v_cache must be \[batch, window"):
        RollingKVCache(torch.zeros(2, W, H, D), torch.zeros(2, W + 1, H, D))
    with pytest.raises(ValueError, match="window_size must be positive, got 0"):
        RollingKVCache.allocate(1, 0, H, D)


def test_allocate_follows_torch_defaults():
    """One rule for every kvops cache: ``dtype``/``device`` default to torch's defaults, as torch factories."""
    previous = torch.get_default_dtype()
    try:
        torch.set_default_dtype(torch.float64)
        assert RollingKVCache.allocate(1, 4, 1, 2).k_cache.dtype == torch.float64
    finally:
        torch.set_default_dtype(previous)
    assert RollingKVCache.allocate(1, 4, 1, 2, dtype=torch.bfloat16).v_cache.dtype == torch.bfloat16
