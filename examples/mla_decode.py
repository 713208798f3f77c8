"""Decode a DeepSeek-V3 attention block (MLA) through kvops' paged latent cache, weights absorbed, against transformers.

No weights are downloaded: ``DeepseekV3Attention`` is built from a small ``DeepseekV3Config`` with random weights
(``--geometry tiny``: 4 heads, kv_lora_rank 32, rope 16; ``deepseek``: DeepSeek-V3's 128 heads, kv_lora_rank 512,
rope 64, nope 128, v 128 on a small hidden size). Two prompts of different lengths are prefilled in one varlen batch
(chunked prefill), then decoded token by token, both sequences in one batch: each token's latent row ``[kv_c | k_pe]``
goes into the cache (``kvops.mla_cache_write``, RoPE fused), and attention runs in the absorbed form
(``kvops.mla_attention``: ``W_UK`` folded into the query, ``W_UV`` applied to the latent output). The outputs are
compared with transformers' own eager attention over the whole sequences; ``--compile`` runs the decode steps under
``torch.compile(fullgraph=True)`` and prints the number of graphs. The cache per token is ``kv_lora_rank + rope``
values against ``2 * H * head_dim`` for MHA (docs/mla.md).

    python examples/mla_decode.py
    python examples/mla_decode.py --geometry deepseek --compile
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

import kvops

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # examples/_common.py, from any working directory
from _common import parser as example_parser  # noqa: E402

GEOMETRIES = {  # (heads, kv_lora_rank, rope, nope, v, hidden, q_lora_rank)
    "tiny": (4, 32, 16, 16, 12, 64, 24),
    "deepseek": (128, 512, 64, 128, 128, 256, 96),
}


def build(geometry: str, seed: int = 0, rope_interleave: bool = True):
    """``(config, attention, rotary)``: a DeepSeek-V3 attention block with random weights (fp32); DeepSeek-V3's rope
    weights are interleaved (``rope_interleave=True``, GPT-J pairs), ``False`` gives GPT-NeoX pairs."""
    heads, rank, rope, nope, v, hidden, q_rank = GEOMETRIES[geometry]
    config = DeepseekV3Config(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=heads,
                              kv_lora_rank=rank, qk_rope_head_dim=rope, qk_nope_head_dim=nope, v_head_dim=v,
                              q_lora_rank=q_rank, head_dim=rope, max_position_embeddings=256, vocab_size=64,
                              rope_interleave=rope_interleave)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    attn = DeepseekV3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in attn.parameters():  # random weights of a scale that keeps the softmax away from one-hot
            p.copy_(torch.randn_like(p) * p.shape[-1] ** -0.5)
    return config, attn, DeepseekV3RotaryEmbedding(config)


def reference(attn, rotary, x: torch.Tensor) -> torch.Tensor:
    """transformers' eager attention over one whole sequence ``x [L, hidden]`` (causal mask): ``[L, hidden]``."""
    length = x.shape[0]
    pos = torch.arange(length)[None]
    mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
    out, _ = attn(x[None], rotary(x[None], pos), mask)
    return out[0]


class AbsorbedMLA(torch.nn.Module):
    """A ``DeepseekV3Attention``'s weights in the absorbed form over a paged latent cache (DeepSeek-V2 §2.1.2).

    ``forward(x [T, hidden], positions [T], slot_mapping [T], cu_seqlens_q, seq_lens, block_table, max_seqlen_q)``:
    writes the ``T`` tokens' latent rows, then attends (decode and chunked prefill in one varlen batch; the metadata
    of ``kvops.paged_attention``) and returns ``[T, hidden]``.
    """

    def __init__(self, attn, rotary, num_blocks: int, block_size: int, max_positions: int = 256):
        super().__init__()
        self.attn = attn
        self.heads, self.rank = attn.num_heads, attn.kv_lora_rank
        self.nope, self.rope, self.v = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim
        w = attn.kv_b_proj.weight.detach().view(self.heads, self.nope + self.v, self.rank)
        self.register_buffer("w_uk", w[:, : self.nope].contiguous())  # [H, nope, rank]
        self.register_buffer("w_uv", w[:, self.nope :].contiguous())  # [H, v, rank]
        cos, sin = rotary(torch.zeros(1), torch.arange(max_positions)[None])
        half = self.rope // 2  # transformers' tables are cat(freqs, freqs): the first half per pair
        self.register_buffer("cos", cos[0, :, :half].contiguous())
        self.register_buffer("sin", sin[0, :, :half].contiguous())
        self.register_buffer("kv_cache", torch.zeros(num_blocks, block_size, self.rank + self.rope))
        self.scale = attn.scaling

    def forward(self, x, positions, slot_mapping, cu_seqlens_q, seq_lens, block_table, max_seqlen_q: int):
        a = self.attn
        t = x.shape[0]
        q = a.q_b_proj(a.q_a_layernorm(a.q_a_proj(x))).view(t, self.heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        kv_c, k_pe = a.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        kv_c = a.kv_a_layernorm(kv_c)
        # DeepSeek-V3 rope weights are interleaved (rope_interleave=True): GPT-J pairs for k_pe and q_pe alike
        kvops.mla_cache_write(kv_c, k_pe, self.kv_cache, slot_mapping, positions=positions, rotary_cos=self.cos,
                              rotary_sin=self.sin, rotary_interleaved=a.config.rope_interleave)
        q_pe = kvops.apply_rotary(q_pe, self.cos, self.sin, positions, a.config.rope_interleave)
        q_lat = torch.einsum("thn,hnr->thr", q_nope, self.w_uk)  # W_UK absorbed into the query
        out, _ = kvops.mla_attention(torch.cat((q_lat, q_pe), dim=-1), self.kv_cache, cu_seqlens_q, seq_lens,
                                     block_table, max_seqlen_q, self.rank, scale=self.scale)
        o = torch.einsum("thr,hvr->thv", out, self.w_uv)  # W_UV on the latent output
        return a.o_proj(o.reshape(t, self.heads * self.v))


def run(geometry: str = "tiny", prompts=(9, 6), new_tokens: int = 6, block_size: int = 4, compile_decode=False,
        seed: int = 0, rope_interleave: bool = True, inductor: bool = False):
    """Prefill ``prompts`` in one batch, decode ``new_tokens`` per sequence; returns ``{"max_abs_diff", "graphs",
    "kvops", "reference"}`` (outputs ``[B, L, hidden]`` of both paths, ``L = prompt + new_tokens``). ``inductor``: the
    compiled decode step is Inductor's code (else the traced graph runs as is)."""
    _, attn, rotary = build(geometry, seed, rope_interleave)
    lengths = [p + new_tokens for p in prompts]
    g = torch.Generator().manual_seed(seed + 1)
    xs = [torch.randn(n, attn.hidden_size, generator=g) for n in lengths]
    blocks = [-(-n // block_size) for n in lengths]
    table = torch.full((len(prompts), max(blocks)), -1, dtype=torch.int32)
    at = 0
    for b, k in enumerate(blocks):  # sequence b owns blocks [at, at + k), in reverse order (any order works)
        table[b, :k] = torch.arange(at + k - 1, at - 1, -1, dtype=torch.int32)
        at += k
    model = AbsorbedMLA(attn, rotary, at, block_size)

    def slots(b, start, stop):
        j = torch.arange(start, stop)
        return table[b].long()[j // block_size] * block_size + j % block_size

    outs = [[] for _ in prompts]
    graphs = []
    with torch.no_grad():  # chunked prefill: both prompts in one varlen batch
        cu = torch.tensor([0, *torch.tensor(prompts).cumsum(0).tolist()], dtype=torch.int32)
        x = torch.cat([xs[b][:p] for b, p in enumerate(prompts)])
        pos = torch.cat([torch.arange(p) for p in prompts])
        sl = torch.cat([slots(b, 0, p) for b, p in enumerate(prompts)])
        y = model(x, pos, sl, cu, torch.tensor(prompts, dtype=torch.int32), table, max(prompts))
        for b in range(len(prompts)):
            outs[b].append(y[cu[b] : cu[b + 1]])

        def count(gm, example_inputs):
            graphs.append(gm)
            if inductor:
                from torch._inductor.compile_fx import compile_fx

                return compile_fx(gm, example_inputs)
            return gm

        step = torch.compile(model, backend=count, fullgraph=True, dynamic=False) if compile_decode else model
        cu1 = torch.arange(len(prompts) + 1, dtype=torch.int32)
        for i in range(new_tokens):  # decode: one token per sequence, positions and slots as tensors
            pos = torch.tensor([p + i for p in prompts])
            x = torch.stack([xs[b][p + i] for b, p in enumerate(prompts)])
            sl = torch.stack([slots(b, p + i, p + i + 1)[0] for b, p in enumerate(prompts)])
            y = step(x, pos, sl, cu1, (pos + 1).to(torch.int32), table, 1)
            for b in range(len(prompts)):
                outs[b].append(y[b : b + 1])
        ours = [torch.cat(o) for o in outs]
        ref = [reference(attn, rotary, x) for x in xs]
    diff = max(float((a - r).abs().max()) for a, r in zip(ours, ref))
    return {"max_abs_diff": diff, "graphs": len(graphs), "kvops": ours, "reference": ref}


def cache_ratio(heads=128, rank=512, rope=64, nope=128, v=128) -> float:
    """MHA's cached values per token and layer (K ``nope + rope`` and V ``v`` per head) over MLA's ``rank + rope``."""
    return heads * (nope + rope + v) / (rank + rope)


def main():
    p = example_parser(__doc__)
    p.add_argument("--geometry", choices=sorted(GEOMETRIES), default="tiny",
                   help="tiny (4 heads, kv_lora_rank 32, rope 16) or deepseek (DeepSeek-V3's 128 heads, 512, 64)")
    p.add_argument("--new-tokens", type=int, default=6, help="decode steps per sequence after the prefill")
    p.add_argument("--block-size", type=int, default=4, help="rows per block of the latent cache")
    p.add_argument("--compile", action="store_true", help="run the decode steps under torch.compile(fullgraph=True)")
    p.add_argument("--inductor", action="store_true",
                   help="with --compile: run Inductor's generated code (else the traced graph as is)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the result to this JSON file")
    args = p.parse_args()
    r = run(args.geometry, new_tokens=args.new_tokens, block_size=args.block_size, compile_decode=args.compile,
            inductor=args.inductor)
    heads, rank, rope, nope, v, _, _ = GEOMETRIES[args.geometry]
    ok = r["max_abs_diff"] < 1e-4
    print(f"geometry {args.geometry}: {heads} heads, kv_lora_rank {rank}, rope {rope}; latent cache {rank + rope} "
          f"values per token vs {heads * (nope + rope + v)} for MHA ({cache_ratio(heads, rank, rope, nope, v):.1f}x "
          f"smaller)")
    verdict = "match" if ok else "MISMATCH"
    print(f"kvops absorbed MLA vs transformers eager: max |diff| {r['max_abs_diff']:.2e} ({verdict})"
          + (f"; decode compiled in {r['graphs']} graph(s)" if args.compile else ""))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"geometry": args.geometry, "max_abs_diff": r["max_abs_diff"],
                                                       "graphs": r["graphs"], "match": ok}))
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
