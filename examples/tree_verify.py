"""Greedy tree verification (speculative decoding) on a paged KV cache: a draft tree of 1 + 4 + 16 tokens per sequence
is verified by one forward of the target model, whose attention is one ``kvops.paged_attention`` call per layer
with ``custom_mask`` (each node sees the sequence's cache and its own ancestors), and the tokens it accepts equal
plain greedy decoding's.

A tiny decoder-only model with random weights (built in code, no download): RMSNorm, GQA attention with RoPE,
SwiGLU. The draft is the same model cut after ``--draft-layers`` layers (self-speculation by early exit): at the
pending token it proposes its top 4 next tokens, and for each of them its top 4 followers (16 nodes). The target
scores all 21 nodes in one step (positions = the root's position + the node's depth; K/V written to the rows after
the sequence's cache), then walks the tree greedily: from the root, follow the child whose token is the target's
argmax, as long as one exists; the accepted path's tokens plus the target's next token (the bonus) are emitted, and
the accepted nodes' K/V rows are moved down to their sequence rows (the rejected ones are overwritten by the next
step). A batch of sequences with different prompts is verified in one call: their masks are concatenated.

Printed: whether the tokens equal plain greedy decoding (a full causal forward per token, no cache), verification
steps, tokens emitted per step. docs/tree-mask.md explains the mask format.

    python examples/tree_verify.py
    python examples/tree_verify.py --batch 4 --new-tokens 64 --attention torch
"""

from __future__ import annotations

import json
import pathlib
import sys

import torch
import torch.nn.functional as F

import kvops
from kvops.custom_mask import dense_custom_mask, packbits, tree_depths, tree_mask

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # examples/_common.py, from any working directory
from _common import parser, rope  # noqa: E402

# the draft tree: node 0 is the pending token (root), nodes 1-4 its children, nodes 5-20 four children of each
TREE = [-1, 0, 0, 0, 0] + [1 + i // 4 for i in range(16)]
VOCAB, HIDDEN, H_Q, H_KV, HEAD_DIM, FFN, THETA, BLOCK_SIZE = 96, 64, 4, 2, 16, 128, 10000.0, 8


def build_model(layers: int, seed: int) -> dict:
    """Random weights of the tiny model. The residual stream is dominated by the token embedding (small output
    projections), so a model cut after fewer layers often agrees with the full one: a useful draft."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape, std):
        return torch.randn(*shape, generator=g) * std

    blocks = [dict(wqkv=w(HIDDEN, (H_Q + 2 * H_KV) * HEAD_DIM, std=HIDDEN ** -0.5),
                   wo=w(H_Q * HEAD_DIM, HIDDEN, std=0.3 * (H_Q * HEAD_DIM) ** -0.5),
                   w13=w(HIDDEN, 2 * FFN, std=HIDDEN ** -0.5), w2=w(FFN, HIDDEN, std=0.3 * FFN ** -0.5))
              for _ in range(layers)]
    return dict(embed=w(VOCAB, HIDDEN, std=1.0), blocks=blocks, head=w(HIDDEN, VOCAB, std=HIDDEN ** -0.5))


def rms_norm(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def forward(model, tokens, positions, attend, layers=None):
    """Logits ``[T, VOCAB]`` of ``tokens [T]`` at ``positions [T]``; ``attend(layer, q, k, v)`` returns the attention
    output ``[T, H_Q, HEAD_DIM]`` of layer ``layer`` (and writes K/V where the caller keeps them)."""
    x = model["embed"][tokens]
    for i, blk in enumerate(model["blocks"][:layers]):
        qkv = rms_norm(x) @ blk["wqkv"]
        q, k, v = qkv.split([H_Q * HEAD_DIM, H_KV * HEAD_DIM, H_KV * HEAD_DIM], dim=-1)
        q = rope(q.view(-1, H_Q, HEAD_DIM), positions, THETA)
        k = rope(k.view(-1, H_KV, HEAD_DIM), positions, THETA)
        x = x + attend(i, q, k, v.view(-1, H_KV, HEAD_DIM)).flatten(1) @ blk["wo"]
        a, b = (rms_norm(x) @ blk["w13"]).chunk(2, dim=-1)
        x = x + (F.silu(a) * b) @ blk["w2"]
    return rms_norm(x) @ model["head"]


def causal_logits(model, tokens: list[int], layers=None) -> torch.Tensor:
    """Plain causal forward over a whole token list (no cache): the greedy baseline and the draft."""
    t = torch.tensor(tokens)

    def attend(_, q, k, v):
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                           enable_gqa=True)
        return o.transpose(0, 1)

    return forward(model, t, torch.arange(len(tokens)), attend, layers)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(causal_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt):]


def draft_tree(model, tokens: list[int], draft_layers: int) -> list[int]:
    """The 21 node tokens: the pending token, the draft's top 4 after it, and its top 4 after each of those."""
    first = causal_logits(model, tokens, draft_layers)[-1].topk(4).indices.tolist()
    nodes = [tokens[-1], *first]
    for c in first:
        nodes += causal_logits(model, tokens + [c], draft_layers)[-1].topk(4).indices.tolist()
    return nodes


class PagedTarget:
    """The target model over a paged KV cache (one per layer, ``[P, BLOCK_SIZE, H_KV, HEAD_DIM]``), each sequence
    owning consecutive blocks ``[b * blocks_per_seq, (b + 1) * blocks_per_seq)``."""

    def __init__(self, model, batch: int, capacity: int, attention: str, packed: bool):
        self.model, self.attention, self.packed = model, attention, packed
        self.blocks_per_seq = -(-capacity // BLOCK_SIZE)
        pages = batch * self.blocks_per_seq
        layers = len(model["blocks"])
        self.k = [torch.zeros(pages, BLOCK_SIZE, H_KV, HEAD_DIM) for _ in range(layers)]
        self.v = [torch.zeros(pages, BLOCK_SIZE, H_KV, HEAD_DIM) for _ in range(layers)]
        self.block_table = torch.arange(pages, dtype=torch.int32).view(batch, self.blocks_per_seq)

    def slots(self, b: int, rows: torch.Tensor) -> torch.Tensor:
        return (self.block_table[b].long()[rows // BLOCK_SIZE] * BLOCK_SIZE + rows % BLOCK_SIZE)

    def step(self, tokens, positions, starts, q_lens, mask):
        """Logits of the packed new rows of every sequence: sequence ``b``'s ``q_lens[b]`` rows go to cache rows
        ``[starts[b], starts[b] + q_lens[b])``; ``mask`` is the concatenated ``custom_mask`` (``packed_custom_mask``
        when the target was made with ``packed=True``; None: causal)."""
        slot_mapping = torch.cat([self.slots(b, torch.arange(s, s + n))
                                  for b, (s, n) in enumerate(zip(starts, q_lens))])
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        seq_lens = torch.tensor([s + n for s, n in zip(starts, q_lens)], dtype=torch.int32)

        name = "packed_custom_mask" if self.packed else "custom_mask"
        dense = None
        if mask is not None and self.attention == "torch":
            dense = dense_custom_mask(None if self.packed else mask, mask if self.packed else None, cu, max(q_lens))

        def attend(i, q, k, v):
            kvops.paged_cache_write(k, v, self.k[i], self.v[i], slot_mapping)
            if self.attention == "torch":
                return torch_tree_attention(q, self.k[i], self.v[i], cu, seq_lens, self.block_table, dense)
            return kvops.paged_attention(q, self.k[i], self.v[i], cu, seq_lens, self.block_table, max(q_lens),
                                         **({} if mask is None else {name: mask}))

        return forward(self.model, torch.tensor(tokens), torch.tensor(positions), attend)

    def move_rows(self, b: int, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of sequence ``b``'s rows ``src`` to rows ``dst`` in every layer (accepted nodes move down)."""
        s, d = self.slots(b, torch.tensor(src)), self.slots(b, torch.tensor(dst))
        for cache in (*self.k, *self.v):
            flat = cache.view(-1, H_KV, HEAD_DIM)
            flat[d] = flat[s]


def torch_tree_attention(q, k_cache, v_cache, cu, seq_lens, block_table, dense):
    """The same attention in plain torch (``--attention torch``): each sequence's keys gathered from the cache, the
    rows before its new rows visible to all of them, its block of ``dense [B, M, M]`` (None: causal) among the new
    rows."""
    out = torch.empty_like(q)
    for b in range(len(seq_lens)):
        q0, q1, kv = int(cu[b]), int(cu[b + 1]), int(seq_lens[b])
        n = q1 - q0
        rows = torch.arange(kv)
        slots = block_table[b].long()[rows // BLOCK_SIZE] * BLOCK_SIZE + rows % BLOCK_SIZE
        k = k_cache.view(-1, H_KV, HEAD_DIM)[slots]
        v = v_cache.view(-1, H_KV, HEAD_DIM)[slots]
        new = torch.ones(n, n, dtype=torch.bool).tril() if dense is None else dense[b, :n, :n]
        visible = torch.cat([torch.ones(n, kv - n, dtype=torch.bool), new], dim=1)
        o = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=visible, enable_gqa=True)
        out[q0:q1] = o.transpose(0, 1)
    return out


def accept(tree_tokens: list[int], target_argmax: list[int]) -> list[int]:
    """Greedy verification: the accepted path of node indices from the root (the root always)."""
    path = [0]
    while True:
        node = path[-1]
        child = next((c for c, p in enumerate(TREE) if p == node and tree_tokens[c] == target_argmax[node]), None)
        if child is None:
            return path
        path.append(child)


def tree_decode(model, prompts: list[list[int]], n: int, draft_layers: int, attention: str, packed: bool):
    """Tokens of every sequence (``n`` each) by draft-tree verification, and the number of verification steps."""
    batch = len(prompts)
    capacity = max(map(len, prompts)) + n + len(TREE) + 1
    target = PagedTarget(model, batch, capacity, attention, packed)
    # prefill: every prompt token but the last (the pending token, the root of the first tree)
    pre = [p[:-1] for p in prompts]
    target.step(sum(pre, []), sum([list(range(len(p))) for p in pre], []), [0] * batch, [len(p) for p in pre], None)
    tokens = [list(p) for p in prompts]  # the pending token sits at row len(tokens) - 1, the rows before are cached
    mask_one = tree_mask(TREE).flatten()
    depth = tree_depths(TREE)
    steps = 0
    while min(len(t) - len(p) for t, p in zip(tokens, prompts)) < n:
        trees = [draft_tree(model, t, draft_layers) for t in tokens]
        starts = [len(t) - 1 for t in tokens]
        positions = [s + d for s in starts for d in depth]
        mask = torch.cat([packbits(mask_one) if packed else mask_one] * batch)
        # (one tree per sequence: with packed=True each sequence's 441 bits take 56 whole bytes, as segment_packbits)
        logits = target.step(sum(trees, []), positions, starts, [len(TREE)] * batch, mask)
        argmax = logits.argmax(-1).view(batch, len(TREE)).tolist()
        for b in range(batch):
            path = accept(trees[b], argmax[b])
            target.move_rows(b, [starts[b] + c for c in path], [starts[b] + k for k in range(len(path))])
            tokens[b] += [trees[b][c] for c in path[1:]] + [argmax[b][path[-1]]]
        steps += 1
    return [t[len(p):len(p) + n] for t, p in zip(tokens, prompts)], steps


def main():
    p = parser(__doc__)
    p.add_argument("--batch", type=int, default=2, help="sequences verified together")
    p.add_argument("--prompt-len", type=int, default=10,
                   help="prompt tokens of the first sequence (the others: 3 more each)")
    p.add_argument("--new-tokens", type=int, default=24, help="tokens generated per sequence")
    p.add_argument("--layers", type=int, default=3, help="layers of the target model")
    p.add_argument("--draft-layers", type=int, default=1, help="layers of the draft (the target cut early)")
    p.add_argument("--attention", choices=("kvops", "torch"), default="kvops",
                   help="kvops.paged_attention with custom_mask, or the same attention in plain torch")
    p.add_argument("--packed", action="store_true", help="pass the tree mask as packed bits (packed_custom_mask)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write the results to this JSON file (default: none)")
    args = p.parse_args()
    torch.manual_seed(args.seed)
    model = build_model(args.layers, args.seed)
    prompts = [torch.randint(0, VOCAB, (args.prompt_len + 3 * b,)).tolist() for b in range(args.batch)]
    with torch.no_grad():
        tree, steps = tree_decode(model, prompts, args.new_tokens, args.draft_layers, args.attention, args.packed)
        plain = [greedy(model, pr, args.new_tokens) for pr in prompts]
    same = tree == plain
    per_step = args.new_tokens / steps
    print(f"tree of {len(TREE)} nodes (1 + 4 + 16), batch {args.batch}, {args.new_tokens} tokens per sequence, "
          f"attention: {args.attention}{' (packed mask)' if args.packed else ''}")
    print(f"verification steps: {steps} ({per_step:.2f} tokens per sequence per step; plain greedy: 1)")
    print(f"tokens identical to plain greedy decoding: {same}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(dict(identical=same, steps=steps, tree=tree, greedy=plain)))
    if not same:
        raise SystemExit("tree verification disagrees with greedy decoding")


if __name__ == "__main__":
    main()
