"""``fibattn bench hf-generate``: tokens/s of the transformers remote-code export's ``generate()`` (its
``FibattnCache``) next to fibattn's own ``generate`` on the same weights (issue 55 item 4).

A random FibLM of the ``tiny`` or ``paper`` shape (static fib-linear distances, W=12, 15 rungs: what
``--format hf`` exports) is saved as a remote-code folder in a temporary directory and loaded back with
``AutoModelForCausalLM.from_pretrained(trust_remote_code=True)``. For each context ``N``, one random prompt of
``N - --new`` tokens is continued greedily twice per side: ``1`` new token (the prefill) and ``--new`` tokens;
decode tokens/s = ``(--new - 1) / (t_new - t_1)``, each the best of ``--reps`` runs. fibattn's side runs
``generate_tokens`` with ``--decode`` (``auto``: the compiled, captured step on CUDA). Reported beside them:
whether both gave the same tokens (bfloat16 on CUDA may differ late in a long run; float32 on a CPU should not).
"""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from ..checks import UsageError, int_flag
from ..devices import resolve_device, synchronize
from ..generation.decode import generate_tokens
from ..generation.static import DECODE_MODES
from .generate import DTYPES, build, check_fits


def configure_parser(parser) -> None:
    parser.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto")
    parser.add_argument("--shape", default="tiny", choices=("tiny", "paper"), help="model shape (default tiny)")
    parser.add_argument("--contexts", default="512,2048", help="contexts N: prompt + new tokens (default 512,2048)")
    parser.add_argument("--new", type=int_flag(2), default=32, help="greedy tokens generated (default 32)")
    parser.add_argument("--reps", type=int_flag(1), default=2, help="timed runs per side, the best kept (default 2)")
    parser.add_argument("--decode", default="auto", choices=DECODE_MODES, help="fibattn's decode step (default auto)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _timed(run) -> tuple[float, list]:
    t0 = time.perf_counter()
    out = run()
    return time.perf_counter() - t0, out


def _side(run_n, new: int, reps: int, device) -> tuple[float, list]:
    """Decode tokens/s of ``run_n(n)`` (which generates ``n`` tokens after the prefill), and its ``new`` tokens."""
    run_n(new)                                   # warm-up: kernels, compiled graphs, caches
    best_1 = best_n = float("inf")
    tokens = None
    for _ in range(reps):
        synchronize(device)
        t1, _ = _timed(lambda: (run_n(1), synchronize(device)))
        tn, (tokens, _) = _timed(lambda: (run_n(new), synchronize(device)))
        best_1, best_n = min(best_1, t1), min(best_n, tn)
    return (new - 1) / max(best_n - best_1, 1e-9), tokens


def measure(shape: str, contexts: list[int], new: int, reps: int, device, decode: str) -> list[dict]:
    import transformers

    from ..interop.hf_export import save_model
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    model = build(shape, "static", device, DTYPES["bfloat16" if dtype == torch.bfloat16 else "float32"])
    records = []
    with tempfile.TemporaryDirectory(prefix="fibattn-hf-generate-") as tmp:
        folder = Path(tmp) / "export"
        folder.mkdir()
        save_model(model.float().cpu(), folder)
        model.to(device=device, dtype=dtype)
        hf = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=dtype)
        hf = hf.to(device).eval()
        for n in contexts:
            prompt = torch.randint(0, model.cfg.vocab_size, (1, n - new), generator=torch.Generator().manual_seed(n))

            def hf_run(k):
                with torch.no_grad():
                    out = hf.generate(prompt.to(device), max_new_tokens=k, min_new_tokens=k, do_sample=False,
                                      pad_token_id=0)
                return out[0, prompt.shape[1]:].tolist()

            def fib_run(k):
                return generate_tokens(model, prompt.tolist(), max_new_tokens=k, temperature=0, decode=decode)[0]

            hf_tok_s, hf_tokens = _side(hf_run, new, reps, device)
            fib_tok_s, fib_tokens = _side(fib_run, new, reps, device)
            records.append(dict(context=n, new=new, hf_tok_s=hf_tok_s, fibattn_tok_s=fib_tok_s,
                                fibattn_over_hf=fib_tok_s / hf_tok_s, tokens_equal=hf_tokens == fib_tokens,
                                dtype=str(dtype).replace("torch.", ""), decode=decode))
    return records


def format_table(records: list[dict]) -> str:
    lines = [f"{'context':>8} {'transformers tok/s':>19} {'fibattn tok/s':>14} {'fibattn / hf':>13}  tokens equal"]
    for r in records:
        lines.append(f"{r['context']:>8} {r['hf_tok_s']:>19.1f} {r['fibattn_tok_s']:>14.1f} "
                     f"{r['fibattn_over_hf']:>13.2f}  {r['tokens_equal']}")
    lines.append("decode tokens/s after the prompt, greedy, batch 1: the remote-code export's generate() "
                 "(FibattnCache) and fibattn's generate on the same weights")
    return "\n".join(lines)


def run(args) -> int:
    device = resolve_device(args.device, flag="--device")
    try:
        contexts = sorted({int(x) for x in args.contexts.split(",") if x.strip()})
    except ValueError:
        raise UsageError(f"--contexts must be a comma-separated list of integers, got {args.contexts!r}") from None
    if not contexts or contexts[0] <= args.new:
        raise UsageError(f"--contexts must list integers > --new ({args.new}), got {args.contexts!r}")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise UsageError("fibattn bench hf-generate needs transformers: pip install 'fibattn[hf]'") from None
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    check_fits(args.shape, ["static"], contexts, contexts, SimpleNamespace(device=str(device), dtype=dtype, batch=1))
    records = measure(args.shape, contexts, args.new, args.reps, device, args.decode)
    if args.json:
        print(json.dumps(dict(settings=dict(shape=args.shape, contexts=contexts, new=args.new, device=str(device)),
                              results=records), indent=2))
    else:
        print(format_table(records))
    return 0

