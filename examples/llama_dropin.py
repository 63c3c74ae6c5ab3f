"""fibattn attention inside a Hugging Face Llama model (no download, CPU, ~1 minute).

    pip install 'fibattn[hf]'
    python examples/llama_dropin.py [--steps 20] [--window 8] [--schedule linear]

Builds a small randomly initialised ``LlamaForCausalLM``, switches its attention to
depth-staggered Fibonacci sparse attention with :func:`fibattn.interop.hf_llama.apply_fibattn`
(transformers' attention registry; per-layer alphas from the schedule), checks one
forward pass, then fine-tunes a few steps on the bundled corpus (UTF-8 bytes -> ids
modulo the vocabulary) and prints the loss falling.
"""
from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from fibattn.data import read_corpus
from fibattn.interop.hf_llama import apply_fibattn


def batches(vocab: int, seq_len: int, batch: int, seed: int):
    """Random windows of the corpus as ``(batch, seq_len)`` id tensors."""
    data = torch.frombuffer(bytearray(read_corpus().encode("utf-8")), dtype=torch.uint8).long() % vocab
    gen = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, data.numel() - seq_len, (batch,), generator=gen)
        yield torch.stack([data[s:s + seq_len] for s in starts.tolist()])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--schedule", default="linear", choices=["fixed", "linear", "coprime"])
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg)
    apply_fibattn(model, window=args.window, base="fib:10", schedule=args.schedule)
    for layer in model.model.layers:
        s = layer.self_attn.fibattn_spec
        print(f"layer {s.layer_idx}: alpha {s.alpha:.3f}, distances {s.distances(args.seq_len)}")
    data = batches(cfg.vocab_size, args.seq_len, args.batch, args.seed)
    x = next(data)
    with torch.no_grad():
        print(f"forward: logits {tuple(model(x).logits.shape)}, loss {model(x, labels=x).loss.item():.4f}")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    model.train()
    t0, first = time.perf_counter(), None
    for step in range(1, args.steps + 1):
        x = next(data)
        loss = model(x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        first = loss.item() if first is None else first
        if step == 1 or step % 5 == 0 or step == args.steps:
            print(f"step {step}/{args.steps} | loss {loss.item():.4f} | {time.perf_counter() - t0:.1f}s")
    print(f"loss {first:.4f} -> {loss.item():.4f}")
    return 0 if loss.item() < first else 1


if __name__ == "__main__":
    raise SystemExit(main())
