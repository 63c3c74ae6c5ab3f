"""``fibattn bench hf-cache``: KV-cache bytes of ``model.generate`` through transformers, full cache vs FibCache.

A tiny random transformers Llama (2 layers, hidden 64, 4 heads, 2 KV heads, head size 16,
float32, CPU) after ``apply_fibattn(window=12, base="fib", schedule="linear",
reach_len=--reach-len)``. For each context ``N`` one random prompt of ``N - --new`` tokens is
continued by ``--new`` greedy tokens twice: with transformers' default (full) cache and with
:class:`fibattn.interop.hf_cache.FibCache` (``context=None``: the reach bounds every layer's
set). Reported: the bytes each cache holds afterwards (:func:`~fibattn.interop.hf_cache.cache_bytes`),
FibCache's kept keys per layer, and whether the two runs gave the same tokens. Goal: FibCache's
bytes are the same at every context while the full cache's grow with it.
"""
from __future__ import annotations

import inspect
import json

import torch

from ..config import ConfigError
from ..validation import check_sizes_fit

TOKEN_BYTES = 8 + 512 + 2 * 64 * 4      # the least one position of the tiny Llama takes (see run)


def configure_parser(parser) -> None:
    parser.add_argument("--contexts", default="4096,16384", help="contexts N: prompt + new tokens (default 4096,16384)")
    parser.add_argument("--reach-len", type=int, default=1024, help="apply_fibattn reach_len (default 1024)")
    parser.add_argument("--new", type=int, default=8, help="greedy tokens generated per context (default 8)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def tiny_model(reach_len: int, max_len: int, seed: int = 0):
    """The random Llama the bench measures, switched to fibattn."""
    import transformers

    from ..interop.hf_llama import apply_fibattn
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len,
                                   attn_implementation="sdpa", eos_token_id=None)
    model = transformers.LlamaForCausalLM(cfg).eval()
    return apply_fibattn(model, window=12, base="fib", schedule="linear", reach_len=reach_len)


def measure(contexts: list[int], reach_len: int, new: int = 8, seed: int = 0) -> list[dict]:
    """One record per context: full-cache and FibCache bytes, FibCache's kept keys, tokens equal."""
    import transformers

    from ..interop.hf_cache import FibCache, cache_bytes
    model = tiny_model(reach_len, max(contexts), seed)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    records = []
    for n in contexts:
        prompt = torch.randint(0, 256, (1, n - new), generator=torch.Generator().manual_seed(seed + n))
        greedy = dict(max_new_tokens=new, do_sample=False, return_dict_in_generate=True)
        dense, fib = transformers.DynamicCache(config=model.config), FibCache(model)
        full = model.generate(prompt, **{name: dense}, **greedy)
        sparse = model.generate(prompt, **{name: fib}, **greedy)
        records.append(dict(context=n, full_cache_bytes=cache_bytes(dense), fib_cache_bytes=fib.cache_bytes,
                            kept_keys=list(fib.keeps),
                            tokens_equal=bool(torch.equal(full.sequences, sparse.sequences))))
    return records


def format_table(records: list[dict]) -> str:
    lines = [f"{'context':>8} {'full cache bytes':>17} {'FibCache bytes':>15}  tokens equal  kept keys per layer"]
    for r in records:
        lines.append(f"{r['context']:>8} {r['full_cache_bytes']:>17,} {r['fib_cache_bytes']:>15,}  "
                     f"{str(r['tokens_equal']):>12}  {r['kept_keys']}")
    same = len({r["fib_cache_bytes"] for r in records}) == 1
    lines.append(f"FibCache bytes equal at every context: {same}")
    return "\n".join(lines)


def run(args) -> int:
    try:
        contexts = sorted({int(x) for x in args.contexts.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--contexts must be a comma-separated list of integers, got {args.contexts!r}") from None
    if args.new < 1:
        raise ConfigError(f"--new must be an integer >= 1, got {args.new}")
    if args.reach_len < 1:
        raise ConfigError(f"--reach-len must be an integer >= 1, got {args.reach_len}")
    # every position, prompt or generated, holds at least its id, the full cache's keys and values (2 layers x
    # 2 KV heads x 2 x 16 floats) and two hidden states of 64 floats; --new first: it is part of every context
    check_sizes_fit("--new", [args.new], lambda n: n * TOKEN_BYTES, "the generated tokens' ids, full cache and "
                    "hidden states")
    if not contexts or contexts[0] <= args.new:
        raise ConfigError(f"--contexts must list integers > --new ({args.new}), got {args.contexts!r}")
    check_sizes_fit("--contexts", contexts, lambda n: n * TOKEN_BYTES, "the prompt, the full cache and "
                    "the hidden states of the tiny Llama")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError("fibattn bench hf-cache needs transformers: pip install 'fibattn[hf]'") from None
    records = measure(contexts, args.reach_len, args.new)
    if args.json:
        print(json.dumps(dict(settings=dict(contexts=contexts, reach_len=args.reach_len, new=args.new),
                              results=records), indent=2))
    else:
        print(format_table(records))
    return 0
