"""EleutherAI lm-evaluation-harness adapter: ``lm_eval --model fibattn``.

    python -m fibattn.interop.lm_eval_adapter --model fibattn \\
        --model_args path=RUN_OR_EXPORT,max_length=4096 --tasks wikitext

Importing this module registers the model name ``fibattn`` with lm-eval (when lm-eval is
installed); the ``python -m fibattn.interop.lm_eval_adapter`` wrapper imports it and then runs
lm-eval's own command line with the remaining arguments. From Python, ``import
fibattn.interop.lm_eval_adapter`` before ``lm_eval.simple_evaluate(model="fibattn", ...)``.

The scoring lives in :class:`FibScorer`, which does not need lm-eval:

- ``loglikelihood(context, continuation) -> (logprob, is_greedy)``: the summed log-probs
  of the continuation tokens after the context (left-truncated to ``max_length`` inputs);
  an empty context is replaced by the end-of-document token. Trailing whitespace of the
  context moves to the continuation (the harness's convention for BPE).
- ``loglikelihood_rolling(text)``: the text's tokens after an end-of-document prefix are
  cut into windows of ``max_length`` predictions; every token is scored exactly once. A
  window's inputs are the ``max_length`` tokens before its predictions (the first window
  starts at the prefix; a short last window keeps a full ``max_length`` context).
- ``generate_until(context, gen_kwargs)``: streaming decoding through
  :func:`fibattn.generation.decode.generate` (constant-memory caches), stopping at the first
  ``until`` string (cut off), the end-of-document token or ``max_gen_toks`` tokens; greedy
  unless ``do_sample`` with a ``temperature`` > 0.

A ``model_args`` or generation key the adapter does not read is refused naming the closest one
(:func:`fibattn.checks.check_keys`): a misspelt key left at its default would change the numbers.

Batches: ``batch_size`` (lm-eval's model argument; ``auto`` fills about ``AUTO_TOKENS`` tokens a forward,
``max_batch_size`` caps it) rows of the same input length share a forward, so each request still sees
the positions and distance sets it would alone.

Layout: token id lists; model inputs ``(rows, T)``; continuation logits ``(n, V)``.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..checks import UsageError, check_keys, parse_int
from ..devices import resolve_device as _resolve
from ..storage.runs import parse_step

log = logging.getLogger("fibattn")

MODEL_NAME = "fibattn"
DEFAULT_GEN_TOKS = 256
AUTO_TOKENS = 16384                    # batch_size=auto: the tokens of one forward
# what FibattnLM takes (lm-eval adds batch_size, max_batch_size and device itself) and generate_until honours
MODEL_ARGS = ("path", "max_length", "step", "device", "batch_size", "max_batch_size")
GEN_KEYS = ("until", "max_gen_toks", "do_sample", "temperature", "seed")


@dataclass
class FibScorer:
    """Scores text with a FibLM and its tokenizer; the lm-eval class delegates here."""

    model: torch.nn.Module
    tokenizer: object
    max_length: int
    batch_size: int | str = 1          # rows a forward; "auto": as many as fill AUTO_TOKENS
    max_batch_size: int | None = None

    def __post_init__(self):
        self.max_length = parse_int("max_length", self.max_length, 1)
        self.rows, self.cap = _batch_rows(self.batch_size, self.max_batch_size)
        limit = self.model.cfg.max_seq_len
        if self.max_length > limit:
            raise UsageError(f"max_length must be <= model.max_seq_len={limit}, got {self.max_length}")
        if getattr(self.tokenizer, "eos_id", None) is None:
            raise UsageError("the tokenizer needs an end-of-document id (eos_id)")
        self.eos = int(self.tokenizer.eos_id)

    @classmethod
    def load(cls, path, *, max_length=None, step="latest", device="cpu", batch_size=1,
             max_batch_size=None) -> "FibScorer":
        """From an export folder or a run folder; ``max_length`` defaults to the training length."""
        from ..storage.pretrained import load_model
        model, tok = load_model(path, step=step, device=device)
        if tok is None:
            raise UsageError(f"{path} has no tokenizer; lm-eval needs one (tokenizer.json)")
        return cls(model, tok, model.cfg.seq_len if max_length is None else max_length, batch_size, max_batch_size)

    @property
    def device(self) -> torch.device:
        return self.model.embed.weight.device

    # ------------------------------------------------------------------ helpers
    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation ids; trailing context whitespace moves to the continuation."""
        n = len(context) - len(context.rstrip())
        if n:
            context, continuation = context[:-n], context[-n:] + continuation
        ctx = self.tokenizer.encode(context)
        whole = self.tokenizer.encode(context + continuation)
        if whole[:len(ctx)] != ctx:             # tokenisation changed at the boundary
            return ctx, self.tokenizer.encode(continuation)
        return ctx, whole[len(ctx):]

    def score(self, inputs: list[int], targets: list[int]) -> tuple[float, bool]:
        """Summed log-prob of ``targets`` (the last ``len(targets)`` next-token predictions of
        ``inputs``) and whether each is the argmax."""
        return self.score_many([(inputs, targets)])[0]

    @torch.no_grad()
    def score_many(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """:meth:`score` of each ``(inputs, targets)``, in order. Inputs of one length share a forward, up to
        ``batch_size`` rows: the same length, so the same positions and distance sets as one at a time (only
        the matrix products' rounding may differ, as in any batched harness model)."""
        out: list = [None] * len(pairs)
        by_length: dict[int, list[int]] = {}
        for i, (inputs, _) in enumerate(pairs):
            by_length.setdefault(len(inputs), []).append(i)
        for T, idx in sorted(by_length.items()):
            rows = self.rows or min(max(1, AUTO_TOKENS // T), self.cap or AUTO_TOKENS)
            for at in range(0, len(idx), rows):
                chunk = idx[at:at + rows]
                x = torch.tensor([pairs[i][0] for i in chunk], dtype=torch.long, device=self.device)
                h = self.model.hidden(x)
                ns = [len(pairs[i][1]) for i in chunk]
                last = torch.cat([h[r, T - n:] for r, n in enumerate(ns)])
                logp = F.log_softmax(self.model.logits(last).float(), dim=-1)
                y = torch.tensor([t for i in chunk for t in pairs[i][1]], dtype=torch.long, device=self.device)
                got, hit = logp.gather(1, y[:, None])[:, 0], logp.argmax(-1) == y
                for i, g, k in zip(chunk, got.split(ns), hit.split(ns)):
                    out[i] = (float(g.sum()), bool(k.all()))
        return out

    # ------------------------------------------------------------------ the three requests
    def loglikelihood(self, context: str, continuation: str) -> tuple[float, bool]:
        return self.loglikelihoods([(context, continuation)])[0]

    def loglikelihoods(self, requests: list[tuple[str, str]]) -> list[tuple[float, bool]]:
        """:meth:`loglikelihood` of each ``(context, continuation)``, scored in batches."""
        return self.score_many([self._pair(ctx, cont) for ctx, cont in requests])

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        ctx, cont = self.encode_pair(context, continuation)
        if not cont:
            raise UsageError(f"continuation {continuation!r} encodes to no tokens")
        if not ctx:
            ctx = [self.eos]
        whole = (ctx + cont)[-(self.max_length + 1):]
        return whole[:-1], cont[-min(len(cont), self.max_length):]

    def rolling_windows(self, tokens: list[int]) -> list[tuple[list[int], list[int]]]:
        """``(inputs, targets)`` per window; targets cover ``tokens`` once, in order."""
        seq = [self.eos] + list(tokens)
        L, out = self.max_length, []
        for start in range(0, len(tokens), L):
            end = min(start + L, len(tokens))
            out.append((seq[max(0, end - L):end], list(tokens[start:end])))
        return out

    def loglikelihood_rolling(self, text: str) -> float:
        return self.loglikelihoods_rolling([text])[0]

    def loglikelihoods_rolling(self, texts: list[str]) -> list[float]:
        """:meth:`loglikelihood_rolling` of each text, the windows of all of them scored in batches."""
        windows = [self.rolling_windows(self.tokenizer.encode(text)) for text in texts]
        scores = iter(self.score_many([w for ws in windows for w in ws]))
        return [sum(next(scores)[0] for _ in ws) for ws in windows]

    def generate_until(self, context: str, gen_kwargs: dict | None = None) -> str:
        from ..generation.decode import generate
        from ..generation.text import TextStream
        kw = dict(gen_kwargs or {})
        check_keys("lm-eval generation_kwargs", kw, GEN_KEYS)
        until = kw.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_gen = parse_int("max_gen_toks", kw.pop("max_gen_toks", DEFAULT_GEN_TOKS), 1)
        if max_gen >= self.max_length:
            raise UsageError(f"max_gen_toks must be < max_length={self.max_length}, got {max_gen}")
        temperature = float(kw.pop("temperature", 0.0) or 0.0)
        if not kw.pop("do_sample", False):
            temperature = 0.0
        seed = kw.pop("seed", 1234)
        prompt = (self.tokenizer.encode(context) or [self.eos])[-(self.max_length - max_gen):]
        stream, text = TextStream(self.tokenizer), ""
        for step in generate(self.model, prompt, max_new_tokens=max_gen, temperature=temperature,
                             seed=seed, stop_ids=(self.eos,)):
            text += stream.push(int(step.tokens[0]))
            cut = _first_stop(text, until)
            if cut is not None:
                return text[:cut]
        text += stream.flush()
        cut = _first_stop(text, until)
        return text if cut is None else text[:cut]


def _batch_rows(batch_size, max_batch_size) -> tuple[int | None, int | None]:
    """``(rows, cap)`` from lm-eval's ``batch_size`` and ``max_batch_size``: rows a forward (None for ``auto`` /
    ``auto:N``: then ``AUTO_TOKENS // length`` rows, at most ``cap``)."""
    cap = None if max_batch_size is None else parse_int("max_batch_size", max_batch_size, 1)
    if isinstance(batch_size, str) and batch_size.strip().lower().startswith("auto"):
        log.info("fibattn lm-eval: batch_size %s -> rows of up to %d tokens a forward", batch_size, AUTO_TOKENS)
        return None, cap
    rows = 1 if batch_size is None else parse_int("batch_size", batch_size, 1)     # None: lm-eval's default
    return (rows if cap is None else min(rows, cap)), cap


def _first_stop(text: str, until: list[str]) -> int | None:
    hits = [text.find(s) for s in until if s and s in text]
    return min(hits) if hits else None


# ----------------------------------------------------------------------------- lm-eval glue
def resolve_device(device) -> str:
    """``None``/``auto``: cuda when available. lm-eval's default is ``cuda:0`` even on CPU-only
    machines, so a CUDA device without CUDA becomes ``cpu`` with a logged warning."""
    name = str(device or "auto")
    if name.startswith("cuda") and not torch.cuda.is_available():
        log.warning("fibattn lm-eval: device %s requested (lm-eval's default) but CUDA is not available; "
                    "using cpu (pass --device cpu to choose it explicitly)", name)
        name = "cpu"
    return str(_resolve(name, flag="lm-eval device"))


def _request_args(req) -> tuple:
    return tuple(req.args) if hasattr(req, "args") else tuple(req)


def run_requests(scorer: FibScorer, kind: str, requests) -> list:
    """Answer a list of lm-eval requests (``Instance`` objects or plain argument tuples)."""
    args = [_request_args(r) for r in requests]
    if kind == "loglikelihood":
        return scorer.loglikelihoods(args)
    if kind == "loglikelihood_rolling":
        return scorer.loglikelihoods_rolling([a[0] for a in args])
    if kind == "generate_until":
        return [scorer.generate_until(*a) for a in args]
    raise UsageError(f"kind must be loglikelihood, loglikelihood_rolling or generate_until, got {kind!r}")


def _build_lm_class():
    from lm_eval.api.model import LM

    class FibattnLM(LM):
        """lm-eval model ``fibattn``: ``--model_args path=RUN_OR_EXPORT[,max_length=N][,step=N][,device=D]``."""

        def __init__(self, path: str | None = None, max_length=None, step="latest", device="cpu",
                     batch_size=1, max_batch_size=None, **unknown):
            super().__init__()
            check_keys("lm-eval model_args", unknown, MODEL_ARGS)    # a misspelt key would change the scores
            if not path:
                raise UsageError("fibattn lm-eval model needs model_args path=RUN_OR_EXPORT")
            step = parse_step(step or "latest", "model_args step")
            self.scorer = FibScorer.load(path, max_length=max_length, step=step, device=resolve_device(device),
                                         batch_size=batch_size, max_batch_size=max_batch_size)

        @property
        def max_length(self) -> int:
            return self.scorer.max_length

        def loglikelihood(self, requests, disable_tqdm: bool = False):
            return run_requests(self.scorer, "loglikelihood", requests)

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            return run_requests(self.scorer, "loglikelihood_rolling", requests)

        def generate_until(self, requests, disable_tqdm: bool = False):
            return run_requests(self.scorer, "generate_until", requests)

    return FibattnLM


def register() -> type | None:
    """Register ``fibattn`` with lm-eval (idempotent); ``None`` when lm-eval is not installed."""
    try:
        from lm_eval.api import registry
    except ImportError:
        return None
    try:
        import lm_eval.models  # noqa: F401  (lm-eval's own models register lazily; keep them findable)
    except ImportError:
        pass
    known = registry.MODEL_REGISTRY
    if MODEL_NAME in known:
        return known.get(MODEL_NAME)
    cls = _build_lm_class()
    registry.register_model(MODEL_NAME)(cls)
    return cls


FibattnLM = register()


PROG = "fibattn lm-eval"


def main(argv=None) -> int:
    """``python -m fibattn.interop.lm_eval_adapter <lm_eval args>``: register, then run lm-eval's CLI. A mistake
    of the user's (a missing folder, an unknown ``model_args`` key, a corrupt file, ...) is one line and exit 2,
    as in fibattn's own command line (:func:`fibattn.entry.error_line`); a bug keeps its traceback."""
    from ..entry import check_text, error_line, setup_streams
    setup_streams()
    argv = list(sys.argv[1:] if argv is None else argv)
    if FibattnLM is None:
        print(f"{PROG}: error: lm-eval is not installed: pip install 'fibattn[eval]'", file=sys.stderr)
        return 2
    try:
        check_text(argv)
        from lm_eval.__main__ import cli_evaluate
        sys.argv = ["lm_eval", *argv]
        return cli_evaluate() or 0
    except BrokenPipeError:
        return 0
    except Exception as exc:
        told = error_line(exc)
        if told is None:
            raise
        print(f"{PROG}: error: {told[1]}", file=sys.stderr)
        return told[0]


if __name__ == "__main__":
    import fibattn.interop.lm_eval_adapter as _registered      # the importable module registers the name once
    raise SystemExit(_registered.main())
