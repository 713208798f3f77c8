"""Generate with a Hugging Face transformers model on kvops: ``attn_implementation="kvops"`` + kvops caches.

No weights are downloaded: each model is built from a small config with random weights (2 layers, hidden 64-112,
each family's attention features kept: GQA 7:1 for Qwen2, sliding window 6 for Mistral, softcap 50 and alternating
sliding/global layers for Gemma-2, attention sinks for gpt-oss). Two prompts of lengths 9 and 6 are left-padded into
one batch and 20 tokens are generated greedily with the stock attention and with kvops on three caches
(transformers' DynamicCache, KvopsStaticCache, KvopsPagedCache); the script prints whether the tokens are identical
and the largest logit difference. ``--compile`` also runs a 20-step decode loop under ``torch.compile(fullgraph=True)``
and prints the number of graphs.

    python examples/hf_generate.py                  # Llama
    python examples/hf_generate.py --family all --compile
"""

from __future__ import annotations

import pathlib
import sys

import torch
from transformers import AutoModelForCausalLM, DynamicCache, Gemma2Config, LlamaConfig, MistralConfig, Qwen2Config

import kvops.integrations.transformers as kvops_hf  # registers attn_implementation="kvops"

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))  # examples/_common.py, from any working directory
from _common import parser as example_parser  # noqa: E402

COMMON = dict(vocab_size=96, num_hidden_layers=2, max_position_embeddings=128, intermediate_size=128)
SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
FAMILIES = {  # (config, stock attention to compare with: transformers disables sdpa for softcap and sinks)
    "llama": (lambda: LlamaConfig(**SMALL, **COMMON), "sdpa"),
    "qwen2": (lambda: Qwen2Config(hidden_size=112, num_attention_heads=14, num_key_value_heads=2, **COMMON), "sdpa"),
    "mistral": (lambda: MistralConfig(**SMALL, sliding_window=6, **COMMON), "sdpa"),
    "gemma2": (lambda: Gemma2Config(**SMALL, head_dim=16, sliding_window=6, attn_logit_softcapping=50.0,
                                    query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"],
                                    **COMMON), "eager"),
}
try:
    from transformers import GptOssConfig

    FAMILIES["gpt_oss"] = (lambda: GptOssConfig(**SMALL, head_dim=16, sliding_window=6, num_local_experts=2,
                                                num_experts_per_tok=1,
                                                layer_types=["sliding_attention", "full_attention"], **COMMON), "eager")
except ImportError:
    pass


def generate(model, impl, ids, mask, cache=None, new_tokens=20):
    model.set_attn_implementation(impl)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                         past_key_values=cache, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.logits)


def compiled_graphs(model, ids, mask, cache, steps=20):
    """Eager prefill, then ``steps - 1`` compiled decode steps; returns (tokens, graphs compiled)."""
    def decode(model, input_ids, attention_mask, position_ids, cache):
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                     past_key_values=cache).logits[:, -1]

    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    step = torch.compile(decode, fullgraph=True, backend=counter)
    model.set_attn_implementation("kvops")
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    tokens = [decode(model, ids, mask, pos, cache).argmax(-1)]
    for _ in range(steps - 1):
        mask, pos = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], 1), pos[:, -1:] + 1
        tokens.append(step(model, tokens[-1][:, None], mask, pos, cache).argmax(-1))
    return torch.stack(tokens, 1), counter.frame_count


def main():
    parser = example_parser(__doc__)
    parser.add_argument("--family", default="llama", choices=[*FAMILIES, "all"],
                        help="model family (a tiny random config of it), or all of them")
    parser.add_argument("--compile", action="store_true", help="also compile a decode loop (Inductor)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("scaled down for a CPU: 2 layers, hidden 64-112, vocab 96, random weights; batch of 2 left-padded prompts")
    for family in FAMILIES if args.family == "all" else [args.family]:
        make_config, stock = FAMILIES[family]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(make_config()).eval()
        model.generation_config.eos_token_id = None
        ids = torch.randint(3, COMMON["vocab_size"], (2, 9))
        mask = torch.ones_like(ids)
        mask[1, :3] = 0
        with torch.no_grad():
            ref_tokens, ref_logits = generate(model, stock, ids, mask)
            caches = {"DynamicCache": DynamicCache(config=model.config),
                      "KvopsStaticCache": kvops_hf.KvopsStaticCache(model.config, max_cache_len=29),
                      "KvopsPagedCache": kvops_hf.KvopsPagedCache(model.config, max_cache_len=29, block_size=4)}
            for name, cache in caches.items():
                tokens, logits = generate(model, "kvops", ids, mask, cache)
                same = torch.equal(tokens, ref_tokens)
                print(f"{family:8s} kvops + {name:17s} vs {stock:5s}: tokens identical {same}"
                      f", max |logit diff| {(logits - ref_logits).abs().max().item():.2e}")
            if args.compile:
                cache = kvops_hf.KvopsStaticCache(model.config, max_cache_len=29)
                tokens, graphs = compiled_graphs(model, ids, mask, cache)
                print(f"{family:8s} compiled decode (Inductor, KvopsStaticCache): tokens identical "
                      f"{torch.equal(tokens, ref_tokens[:, 9:])}, graphs compiled over 20 steps: {graphs}")


if __name__ == "__main__":
    main()
