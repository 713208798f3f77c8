"""Every documented error of ``kvops.mla_cache_write`` and ``kvops.mla_attention``: one message in eager,
``torch.compile(fullgraph=True)`` and ``torch.export`` (the validator is shared by the kernel and the fake rule), and
a refused call changes nothing."""

import expecttest
import torch

import kvops
from tests.contract import raises_everywhere
from tests.mla._cases import FP8, tables


class TestWriteContracts(expecttest.TestCase):
    def setUp(self):
        self.kv_c, self.k_pe = torch.randn(3, 32), torch.randn(3, 16)
        self.kv_cache = torch.zeros(4, 4, 48)
        self.slots = torch.tensor([0, 5, -1])
        self.cos, self.sin = tables(8, 16)
        self.pos = torch.tensor([0, 1, 2])

    def error(self, **kw):
        args = dict(kv_c=self.kv_c, k_pe=self.k_pe, kv_cache=self.kv_cache, slot_mapping=self.slots, kv_scale=None,
                    positions=None, rotary_cos=None, rotary_sin=None)
        args.update(kw)
        names = list(args)
        before = args["kv_cache"].clone()
        msg = raises_everywhere(self, ValueError, lambda *a: kvops.mla_cache_write(**dict(zip(names, a))),
                                tuple(args.values()))
        self.assertTrue(torch.equal(args["kv_cache"].view(torch.uint8), before.view(torch.uint8)))
        return msg

    def test_cache(self):
        self.assertExpectedInline(self.error(kv_cache=torch.zeros(4, 4, 1, 48)), """kvops.mla_cache_write: kv_cache must be 3-D [num_blocks, block_size, kv_lora_rank + rope_dim], got shape (4, 4, 1, 48). Reshape kv_cache to [num_blocks, block_size, kv_lora_rank + rope_dim].""")
        self.assertExpectedInline(self.error(kv_cache=torch.zeros(4, 0, 48)), """kvops.mla_cache_write: kv_cache has block_size = 0 (shape (4, 0, 48) read as [num_blocks, block_size, kv_lora_rank + rope_dim]); allocate the latent cache with block_size >= 1.""")
        self.assertExpectedInline(self.error(kv_cache=torch.zeros(4, 4, 48, dtype=torch.float64)), """kvops.mla_cache_write: kv_cache dtype torch.float64 is not supported; allocate it as float32, bfloat16, float16 or torch.float8_e4m3fn (with kv_scale).""")
        self.assertExpectedInline(self.error(kv_cache=torch.zeros(1, 4, 48).expand(4, 4, 48)), """kvops.mla_cache_write: kv_cache of shape (4, 4, 48) has stride 0 in dim 0 (an expanded view): its elements share memory, so it cannot be written in place. Allocate the cache with its own storage (e.g. torch.zeros, or .clone() the expanded view once).""")

    def test_width(self):
        self.assertExpectedInline(self.error(kv_cache=torch.zeros(4, 4, 576)), """kvops.mla_cache_write: kv_c has kv_lora_rank 32 and k_pe has rope_dim 16, together 48 columns, but kv_cache (4, 4, 576) holds rows of 576 (kv_lora_rank + rope_dim). Allocate the cache with width kv_lora_rank + rope_dim, or pass the model's kv_c and k_pe.""")
        self.assertExpectedInline(self.error(kv_c=torch.randn(3, 0), k_pe=torch.randn(3, 48)), """kvops.mla_cache_write: kv_c has kv_lora_rank = 0 (shape (3, 0)); pass kv_c [N, kv_lora_rank] with kv_lora_rank >= 1.""")

    def test_sources(self):
        self.assertExpectedInline(self.error(kv_c=torch.randn(3, 1, 32)), """kvops.mla_cache_write: kv_c must be 2-D [num_tokens, kv_lora_rank], got shape (3, 1, 32). Reshape kv_c to [num_tokens, kv_lora_rank].""")
        self.assertExpectedInline(self.error(k_pe=self.k_pe.half()), """kvops.mla_cache_write: k_pe dtype torch.float16 does not match kv_c dtype torch.float32. Cast k_pe to torch.float32.""")
        self.assertExpectedInline(self.error(kv_c=self.kv_c.half(), k_pe=self.k_pe.half()), """kvops.mla_cache_write: kv_c dtype torch.float16 does not match kv_cache dtype torch.float32. Cast kv_c and k_pe to torch.float32.""")
        self.assertExpectedInline(self.error(kv_c=self.kv_c[:2]), """kvops.mla_cache_write: kv_c has 2 tokens but slot_mapping has 3; kv_c and k_pe need at least one row per slot (extra rows are ignored). Pad them or trim slot_mapping.""")

    def test_slot_mapping(self):
        self.assertExpectedInline(self.error(slot_mapping=self.slots.float()), """kvops.mla_cache_write: slot_mapping must be a 1-D int32 or int64 tensor [num_tokens], got shape (3,) and dtype torch.float32. Pass slot_mapping.to(torch.int64) (built with integer ops: // rather than /).""")
        self.assertExpectedInline(self.error(slot_mapping=self.slots[None]), """kvops.mla_cache_write: slot_mapping must be a 1-D int32 or int64 tensor [num_tokens], got shape (1, 3) and dtype torch.int64. Reshape slot_mapping to [num_tokens].""")

    def test_fp8_scale(self):
        fp8 = torch.zeros(4, 4, 48, dtype=FP8)
        self.assertExpectedInline(self.error(kv_cache=fp8), """kvops.mla_cache_write: a torch.float8_e4m3fn kv_cache needs kv_scale (a float32 scalar tensor, vLLM's per-tensor scale: the cache holds x / kv_scale). Pass kv_scale=torch.tensor(s, dtype=torch.float32).""")
        self.assertExpectedInline(self.error(kv_cache=fp8, kv_scale=torch.ones(2)), """kvops.mla_cache_write: kv_scale must be a float32 scalar tensor (shape [] or [1], one scale per tensor), got shape (2,) and dtype torch.float32. Pass one scale, torch.tensor(s, dtype=torch.float32) (the latent cache is one head: no per-head scales).""")
        self.assertExpectedInline(self.error(kv_cache=fp8, kv_scale=torch.tensor(1.0, dtype=torch.float64)), """kvops.mla_cache_write: kv_scale must be a float32 scalar tensor (shape [] or [1], one scale per tensor), got shape () and dtype torch.float64. Pass one scale, torch.tensor(s, dtype=torch.float32) (the latent cache is one head: no per-head scales).""")
        self.assertExpectedInline(self.error(kv_scale=torch.tensor(1.0)), """kvops.mla_cache_write: kv_scale was given but kv_cache dtype is torch.float32; a scale applies only to a torch.float8_e4m3fn cache. Drop kv_scale or allocate the cache as torch.float8_e4m3fn.""")
        self.assertExpectedInline(self.error(kv_cache=fp8, kv_scale=torch.tensor(1.0), kv_c=self.kv_c.double(),
                                             k_pe=self.k_pe.double()), """kvops.mla_cache_write: kv_c dtype torch.float64 cannot be quantized into a torch.float8_e4m3fn kv_cache; pass kv_c and k_pe as float32, bfloat16 or float16.""")

    def test_python_float_scale(self):
        """A Python float is refused by the wrapper before dispatch (the schema takes a Tensor)."""
        fp8 = torch.zeros(4, 4, 48, dtype=FP8)
        msg = raises_everywhere(self, ValueError, lambda c: kvops.mla_cache_write(self.kv_c, self.k_pe, c, self.slots,
                                                                                  0.05), (fp8,),
                                compile_exc=torch._dynamo.exc.Unsupported)
        self.assertExpectedInline(msg, """kvops.mla_cache_write: kv_scale must be a float32 scalar tensor (or None), got float 0.05. Pass kv_scale=torch.tensor(0.05, dtype=torch.float32) on the cache's device.""")
        self.assertTrue((fp8.view(torch.uint8) == 0).all())

    def test_rotary(self):
        self.assertExpectedInline(self.error(positions=self.pos, rotary_cos=self.cos), """kvops.mla_cache_write: RoPE on k_pe needs positions, rotary_cos and rotary_sin together, got only positions, rotary_cos. Pass all three (or none: k_pe is written as given).""")
        self.assertExpectedInline(self.error(positions=self.pos[:2], rotary_cos=self.cos, rotary_sin=self.sin), """kvops.mla_cache_write: positions has 2 entries but slot_mapping has 3 tokens; pass one position per token.""")
        cos, sin = tables(8, 32)
        self.assertExpectedInline(self.error(positions=self.pos, rotary_cos=cos, rotary_sin=sin), """kvops.mla_cache_write: rotary_dim must be <= headdim: rotary_cos (8, 16) gives rotary_dim 32 but k_pe has rope_dim 16 (and rotary_dim must be > 0). Pass tables [seqlen_ro, rotary_dim / 2] with rotary_dim <= 16; transformers' cos/sin [seq, rope_dim] repeat their halves: pass their first rope_dim // 2 columns, cos[:, :8] and sin[:, :8].""")
        empty = torch.zeros(8, 0)
        self.assertExpectedInline(self.error(positions=self.pos, rotary_cos=empty, rotary_sin=empty), """kvops.mla_cache_write: rotary_dim must be <= headdim: rotary_cos (8, 0) gives rotary_dim 0 but k_pe has rope_dim 16 (and rotary_dim must be > 0). Pass tables with at least one column.""")
        self.assertExpectedInline(self.error(positions=self.pos, rotary_cos=self.cos.half(),
                                             rotary_sin=self.sin.half()), """kvops.mla_cache_write: rotary_cos must have the same dtype as k_pe (torch.float32), got torch.float16. Cast the tables with .to(torch.float32).""")


class TestAttentionContracts(expecttest.TestCase):
    def setUp(self):
        self.q = torch.randn(3, 4, 48)
        self.kv_cache = torch.zeros(4, 4, 48)
        self.cu = torch.tensor([0, 1, 3], dtype=torch.int32)
        self.lens = torch.tensor([3, 5], dtype=torch.int32)
        self.table = torch.tensor([[0, -1], [2, 1]], dtype=torch.int32)

    def error(self, **kw):
        args = dict(q=self.q, kv_cache=self.kv_cache, cu_seqlens_q=self.cu, seq_lens=self.lens,
                    block_table=self.table, max_seqlen_q=2, kv_lora_rank=32, scale=None, causal=True, kv_scale=None)
        args.update(kw)
        tensors = {k: v for k, v in args.items() if isinstance(v, torch.Tensor)}
        rest = {k: v for k, v in args.items() if k not in tensors}
        names = list(tensors)
        return raises_everywhere(self, ValueError,
                                 lambda *a: kvops.mla_attention(**dict(zip(names, a)), **rest), tuple(tensors.values()))

    def test_q_and_cache(self):
        self.assertExpectedInline(self.error(q=torch.randn(3, 48)), """kvops.mla_attention: q must be 3-D [num_tokens, num_heads, kv_lora_rank + rope_dim], got shape (3, 48). Reshape q to [num_tokens, num_heads, kv_lora_rank + rope_dim].""")
        self.assertExpectedInline(self.error(q=self.q.double()), """kvops.mla_attention: q dtype torch.float64 is not supported; pass q as float32, bfloat16 or float16.""")
        self.assertExpectedInline(self.error(q=self.q.half()), """kvops.mla_attention: kv_cache dtype torch.float32 does not match q dtype torch.float16. The cache must have q's dtype or be torch.float8_e4m3fn (with kv_scale); cast q or allocate the cache as torch.float16.""")
        self.assertExpectedInline(self.error(q=torch.randn(3, 4, 40)), """kvops.mla_attention: q has head_dim 40 (shape (3, 4, 40)) but kv_cache (4, 4, 48) holds latent rows of 48 (kv_lora_rank + rope_dim). In the absorbed form q is [T_q, H, kv_lora_rank + rope_dim]: the nope part multiplied by W_UK, then the rope part.""")
        self.assertExpectedInline(self.error(kv_cache=torch.zeros(4, 4, 1, 48)), """kvops.mla_attention: kv_cache must be 3-D [num_blocks, block_size, kv_lora_rank + rope_dim], got shape (4, 4, 1, 48). Reshape kv_cache to [num_blocks, block_size, kv_lora_rank + rope_dim].""")
        self.assertExpectedInline(self.error(kv_cache=torch.zeros(4, 4, 0), q=torch.randn(3, 4, 0)), """kvops.mla_attention: kv_cache has kv_lora_rank + rope_dim = 0 (shape (4, 4, 0) read as [num_blocks, block_size, kv_lora_rank + rope_dim]); allocate the latent cache with kv_lora_rank + rope_dim >= 1.""")

    def test_kv_lora_rank(self):
        self.assertExpectedInline(self.error(kv_lora_rank=0), """kvops.mla_attention: kv_lora_rank must be in [1, 48] (the latent columns read as values; the rest are the rope part), got 0. Pass the model's kv_lora_rank (e.g. 512 for DeepSeek-V3).""")
        self.assertExpectedInline(self.error(kv_lora_rank=512), """kvops.mla_attention: kv_lora_rank must be in [1, 48] (the latent columns read as values; the rest are the rope part), got 512. Pass the model's kv_lora_rank (e.g. 512 for DeepSeek-V3).""")

    def test_index_tensors(self):
        self.assertExpectedInline(self.error(block_table=self.table.long()), """kvops.mla_attention: block_table must be a 2-D int32 tensor [batch, max_blocks_per_seq], got shape (2, 2) and dtype torch.int64. Pass block_table.to(torch.int32).""")
        self.assertExpectedInline(self.error(seq_lens=self.lens[None]), """kvops.mla_attention: seq_lens must be a 1-D int32 tensor [batch], got shape (1, 2) and dtype torch.int32. Reshape seq_lens to [batch].""")
        self.assertExpectedInline(self.error(cu_seqlens_q=self.cu.float()), """kvops.mla_attention: cu_seqlens_q must be a 1-D int32 tensor [batch + 1], got shape (3,) and dtype torch.float32. Pass cu_seqlens_q.to(torch.int32) (built with integer ops: // rather than /).""")
        self.assertExpectedInline(self.error(seq_lens=self.lens[:1]), """kvops.mla_attention: inconsistent batch size: block_table has 2 rows, seq_lens has 1 entries and cu_seqlens_q has 3; expected seq_lens [B] and cu_seqlens_q [B + 1] for block_table [B, max_blocks_per_seq].""")

    def test_scalars(self):
        self.assertExpectedInline(self.error(max_seqlen_q=0), """kvops.mla_attention: max_seqlen_q must be >= 1 (the longest query length in the batch) when q has tokens, got 0 for 3 tokens.""")
        self.assertExpectedInline(self.error(scale=float("nan")), """kvops.mla_attention: scale must be a finite number (the softmax scale on the scores q . row; None: (kv_lora_rank + rope_dim) ** -0.5), got nan. Pass a finite scale (DeepSeek: (qk_nope_head_dim + qk_rope_head_dim) ** -0.5).""")

    def test_fp8_scale(self):
        fp8 = torch.zeros(4, 4, 48, dtype=FP8)
        self.assertExpectedInline(self.error(kv_cache=fp8), """kvops.mla_attention: a torch.float8_e4m3fn kv_cache needs kv_scale (a float32 scalar tensor, vLLM's per-tensor scale: the cache holds x / kv_scale). Pass kv_scale=torch.tensor(s, dtype=torch.float32).""")
        self.assertExpectedInline(self.error(kv_cache=fp8, kv_scale=torch.ones(1, 1)), """kvops.mla_attention: kv_scale must be a float32 scalar tensor (shape [] or [1], one scale per tensor), got shape (1, 1) and dtype torch.float32. Pass one scale, torch.tensor(s, dtype=torch.float32) (the latent cache is one head: no per-head scales).""")
        self.assertExpectedInline(self.error(kv_scale=torch.tensor(0.5)), """kvops.mla_attention: kv_scale was given but kv_cache dtype is torch.float32; a scale applies only to a torch.float8_e4m3fn cache. Drop kv_scale or allocate the cache as torch.float8_e4m3fn.""")

    def test_python_float_scale(self):
        fp8 = torch.zeros(4, 4, 48, dtype=FP8)
        msg = raises_everywhere(self, ValueError, lambda q, c: kvops.mla_attention(q, c, self.cu, self.lens, self.table,
                                                                                   2, 32, kv_scale=0.5), (self.q, fp8),
                                compile_exc=torch._dynamo.exc.Unsupported)
        self.assertExpectedInline(msg, """kvops.mla_attention: kv_scale must be a float32 scalar tensor (or None), got float 0.5. Pass kv_scale=torch.tensor(0.5, dtype=torch.float32) on the cache's device.""")

    def test_value_contracts_name_the_op(self):
        """Bad values (docs/semantics.md §7): ``kvops.paged_attention``'s messages under this op's name."""
        with self.assertRaises(RuntimeError) as cm:
            kvops.mla_attention(self.q, self.kv_cache, self.cu, torch.tensor([3, 9], dtype=torch.int32), self.table,
                                2, 32)
        self.assertExpectedInline(str(cm.exception), """kvops.mla_attention: seq_lens[1] = 9 is outside [0, 8], the capacity of block_table: 2 blocks per sequence x block_size 4. Give block_table more columns (max_blocks >= ceil(seq_len / block_size)) or pass the sequence's real KV length.""")
        with self.assertRaises(RuntimeError) as cm:
            kvops.mla_attention(self.q, self.kv_cache, self.cu, self.lens, self.table, 1, 32)
        self.assertExpectedInline(str(cm.exception), """kvops.mla_attention: sequence 1 has q_len 2 (cu_seqlens_q[2] - cu_seqlens_q[1]) but max_seqlen_q=1; pass max_seqlen_q >= 2, the longest query length in the batch.""")
