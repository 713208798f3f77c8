"""A gpt-fast-style model ported to kvops: its ``KVCache.update(input_pos, k_val, v_val)`` keeps the positions in a
tensor and ``torch.compile(fullgraph=True)`` wraps the decode step, as pytorch-labs/gpt-fast does.

The model below is written here from gpt-fast's description (tiny dims, random weights): ``KVCache`` holds
``[B, H_kv, S, D]`` buffers written with ``k_cache[:, :, input_pos] = k_val``; ``Attention`` applies RoPE, updates the
cache and runs SDPA over the whole cache with a causal mask row per query position. The two ports change a few
lines of one or two classes (docs/porting.md, "From gpt-fast"):

- contiguous: ``KVCache.update`` calls ``kvops.cache_write`` with the tensor ``input_pos`` (no ``.item()``);
- paged: the cache is a layer of a ``kvops.cache.PagedKVCache`` whose blocks are reserved up front;
  ``update`` builds the step on the device (``PagedKVCache.step_at``) and writes, ``Attention`` calls
  ``PagedKVCache.attention`` instead of SDPA.

Each generates 65 tokens after a prompt (64 decode steps), at batch 1 and 4, with the decode step compiled once (one
graph, no graph break, no recompile as ``input_pos`` advances) and the same tokens as the model with its own cache.
"""

from __future__ import annotations

import unittest
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.testing import CompileCounter

import kvops
from kvops.cache import PagedKVCache


@dataclass
class Config:
    vocab: int = 96
    dim: int = 32
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: int = 2  # GQA 2:1
    rope_base: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head


def rope_table(max_seq: int, head_dim: int, base: float) -> torch.Tensor:
    """``[max_seq, head_dim / 2, 2]``: (cos, sin) of position ``p`` times frequency ``base ** (-2i / head_dim)``."""
    inv = base ** (-torch.arange(0, head_dim, 2).float() / head_dim)
    angle = torch.arange(max_seq).float()[:, None] * inv[None, :]
    return torch.stack([angle.cos(), angle.sin()], dim=-1)


def apply_rope(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, T, H, D]`` pairwise ``(2i, 2i + 1)`` by ``table [T, D / 2, 2]``."""
    pairs = x.float().unflatten(-1, (-1, 2))
    cos, sin = table[None, :, None, :, 0], table[None, :, None, :, 1]
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2).type_as(x)


# --- the model with its own cache (gpt-fast's structure) ---------------------------------------------------------
class KVCache(nn.Module):
    def __init__(self, batch: int, max_seq: int, n_heads: int, head_dim: int, dtype=torch.float32):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(batch, n_heads, max_seq, head_dim, dtype=dtype))
        self.register_buffer("v_cache", torch.zeros(batch, n_heads, max_seq, head_dim, dtype=dtype))

    def update(self, input_pos, k_val, v_val):  # input_pos [T], k_val [B, H_kv, T, D]
        self.k_cache[:, :, input_pos] = k_val
        self.v_cache[:, :, input_pos] = v_val
        return self.k_cache, self.v_cache


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.wqkv = nn.Linear(cfg.dim, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.kv_cache = None

    def project(self, x, rope):
        cfg, (b, t, _) = self.cfg, x.shape
        kv = cfg.n_kv_head * cfg.head_dim
        q, k, v = self.wqkv(x).split([cfg.dim, kv, kv], dim=-1)
        q = apply_rope(q.view(b, t, cfg.n_head, cfg.head_dim), rope)
        k = apply_rope(k.view(b, t, cfg.n_kv_head, cfg.head_dim), rope)
        return q, k, v.view(b, t, cfg.n_kv_head, cfg.head_dim)

    def forward(self, x, rope, mask, input_pos):
        q, k, v = (y.transpose(1, 2) for y in self.project(x, rope))
        k, v = self.kv_cache.update(input_pos, k, v)
        group = self.cfg.n_head // self.cfg.n_kv_head
        y = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                           attn_mask=mask)
        return self.wo(y.transpose(1, 2).reshape(x.shape))


class Block(nn.Module):
    def __init__(self, cfg: Config, attention=Attention):
        super().__init__()
        self.attention = attention(cfg)
        self.ffn = nn.Sequential(nn.Linear(cfg.dim, 2 * cfg.dim), nn.SiLU(), nn.Linear(2 * cfg.dim, cfg.dim))
        self.norm1, self.norm2 = nn.RMSNorm(cfg.dim), nn.RMSNorm(cfg.dim)

    def forward(self, x, rope, mask, input_pos):
        x = x + self.attention(self.norm1(x), rope, mask, input_pos)
        return x + self.ffn(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, cfg: Config, attention=Attention):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg, attention) for _ in range(cfg.n_layer))
        self.norm = nn.RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)

    def setup_caches(self, make_cache, max_seq: int):
        for i, layer in enumerate(self.layers):
            layer.attention.kv_cache = make_cache(i)
        self.register_buffer("rope", rope_table(max_seq, self.cfg.head_dim, self.cfg.rope_base), persistent=False)
        self.register_buffer("causal_mask", torch.ones(max_seq, max_seq, dtype=torch.bool).tril(), persistent=False)

    def forward(self, idx, input_pos):
        mask = self.causal_mask[None, None, input_pos]
        rope = self.rope[input_pos]
        x = self.embed(idx)
        for layer in self.layers:
            x = layer(x, rope, mask, input_pos)
        return self.output(self.norm(x))


# --- port 1: a contiguous cache (KVCache.update's two lines) ----------------------------------------------------
class KvopsKVCache(KVCache):
    def update(self, input_pos, k_val, v_val):
        kvops.cache_write(k_val.transpose(1, 2), v_val.transpose(1, 2), self.k_cache.transpose(1, 2),
                          self.v_cache.transpose(1, 2), input_pos)
        return self.k_cache, self.v_cache


# --- port 2: a paged cache (KVCache replaced, three lines of Attention.forward) --------------------------------
class PagedLayerCache(nn.Module):
    def __init__(self, pool: PagedKVCache, layer: int, block_table: torch.Tensor):
        super().__init__()
        self.pool, self.layer = pool, layer
        self.register_buffer("block_table", block_table)

    def update(self, input_pos, k_val, v_val):  # k_val [B, H_kv, T, D]
        step = self.pool.step_at(input_pos, self.block_table)
        self.pool.write(self.layer, k_val.transpose(1, 2).flatten(0, 1), v_val.transpose(1, 2).flatten(0, 1), step)
        return step


class PagedAttention(Attention):
    def forward(self, x, rope, mask, input_pos):
        q, k, v = (y.transpose(1, 2) for y in self.project(x, rope))
        step = self.kv_cache.update(input_pos, k, v)
        y = self.kv_cache.pool.attention(self.kv_cache.layer, q.transpose(1, 2).flatten(0, 1), step)
        return self.wo(y.reshape(x.shape))


def paged_pool(cfg: Config, batch: int, max_seq: int, block_size: int = 16) -> tuple[PagedKVCache, torch.Tensor]:
    """A pool with each sequence's blocks for ``max_seq`` tokens reserved, interleaved across sequences."""
    blocks = -(-max_seq // block_size)
    pool = PagedKVCache(batch * blocks + 3, block_size, cfg.n_kv_head, cfg.head_dim, num_layers=cfg.n_layer,
                        dtype=torch.float32)
    for b in range(batch):
        pool.add_sequence(b)
    for _ in range(blocks):
        for b in range(batch):
            pool.extend(b, block_size)
    return pool, pool.block_table(range(batch))


def generate(model, prompt, steps: int, decode):
    """gpt-fast's loop: an eager prefill at ``arange(T0)``, then ``steps`` decode steps at ``input_pos += 1``."""
    with torch.no_grad():
        input_pos = torch.arange(prompt.shape[1])
        token = model(prompt, input_pos)[:, -1].argmax(-1, keepdim=True)
        tokens = [token]
        input_pos = torch.tensor([prompt.shape[1]])
        for _ in range(steps - 1):
            token = decode(model, token, input_pos)
            input_pos += 1
            tokens.append(token)
    return torch.cat(tokens, dim=1)


def decode_one_token(model, token, input_pos):
    return model(token, input_pos)[:, -1].argmax(-1, keepdim=True)


class TestGptFastPort(unittest.TestCase):
    STEPS, PROMPT, MAX_SEQ = 65, 8, 80  # 65 tokens: the prefill's, then 64 compiled decode steps

    def model(self, attention=Attention):
        torch.manual_seed(0)
        return Transformer(Config(), attention).eval()

    def compiled_tokens(self, model, prompt):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        counter = CompileCounter()
        decode = torch.compile(decode_one_token, fullgraph=True, backend=counter)
        tokens = generate(model, prompt, self.STEPS, decode)
        self.assertEqual(counter.frame_count, 1)  # one graph for 64 decode steps: no recompile as input_pos moves
        self.assertEqual(dict(torch._dynamo.utils.counters["graph_break"]), {})
        return tokens

    def test_ports_give_the_tokens_of_the_own_cache(self):
        cfg = Config()
        for batch in (1, 4):
            prompt = torch.randint(0, cfg.vocab, (batch, self.PROMPT), generator=torch.Generator().manual_seed(batch))
            own = self.model()
            own.setup_caches(lambda i: KVCache(batch, self.MAX_SEQ, cfg.n_kv_head, cfg.head_dim), self.MAX_SEQ)
            want = generate(own, prompt, self.STEPS, decode_one_token)
            self.assertEqual(tuple(want.shape), (batch, self.STEPS))

            contiguous = self.model()
            contiguous.setup_caches(lambda i: KvopsKVCache(batch, self.MAX_SEQ, cfg.n_kv_head, cfg.head_dim),
                                    self.MAX_SEQ)
            self.assertTrue(torch.equal(self.compiled_tokens(contiguous, prompt), want), batch)
            for got, ref in zip(contiguous.layers, own.layers):  # the caches hold the same K/V, bit for bit
                self.assertTrue(torch.equal(got.attention.kv_cache.k_cache, ref.attention.kv_cache.k_cache))

            paged = self.model(PagedAttention)
            pool, table = paged_pool(cfg, batch, self.MAX_SEQ)
            paged.setup_caches(lambda i: PagedLayerCache(pool, i, table), self.MAX_SEQ)
            self.assertTrue(torch.equal(self.compiled_tokens(paged, prompt), want), batch)
            rows = self.PROMPT + self.STEPS - 1  # the last token generated is not written
            for layer, ref in enumerate(own.layers):
                k = pool.k_caches[layer][table.long()].flatten(1, 2)[:, :rows]  # [B, rows, H_kv, D] in order
                want_k = ref.attention.kv_cache.k_cache.transpose(1, 2)[:, :rows]
                if layer == 0:  # the same K, bit for bit (layer 1's input went through paged attention vs SDPA)
                    self.assertTrue(torch.equal(k, want_k))
                torch.testing.assert_close(k, want_k, atol=1e-5, rtol=1e-5)


if __name__ == "__main__":
    unittest.main()
