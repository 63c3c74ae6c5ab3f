"""What an evaluation returns: one :class:`EvalRecord` per (dataset, length, mode), gathered in
an :class:`EvalReport` with its settings, its table and its fairness statement."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class EvalRecord:
    """One (dataset, length, mode) result. ``mode``: see :func:`fibattn.eval.modes.mode_name`;
    ``rope_factor``: the RoPE scaling factor used at this length (1.0: unscaled here)."""

    dataset: str
    length: int
    reach: str
    mode: str
    tokens: int
    windows: int
    nll: float
    ppl: float
    bpb: float | None
    bytes: int | None
    dense_window: int | None
    train_len: int | None
    scored_sha256: str
    buckets: list = field(default_factory=list)
    seconds: float = 0.0
    rope_scaling: str | None = None
    rope_factor: float | None = None
    document_masking: bool = False

    def key(self) -> tuple:
        return (self.dataset, self.length, self.mode)


@dataclass
class EvalReport:
    records: list = field(default_factory=list)
    datasets: dict = field(default_factory=dict)     # name -> {tokens, bytes, sha256, first, last}
    settings: dict = field(default_factory=dict)

    def record(self, dataset: str, length: int) -> EvalRecord:
        for r in self.records:
            if r.dataset == dataset and r.length == length:
                return r
        raise KeyError(f"no result for dataset {dataset!r} at length {length}")

    def fairness_lines(self) -> list[str]:
        all_lengths = list(self.settings.get("lengths", []))
        lengths = ", ".join(str(n) for n in all_lengths)
        lines = []
        for name, d in self.datasets.items():
            tails = [n for n in all_lengths if d["tokens"] % n]
            how = "every window position is scored" if not tails else (
                f"every window position is scored, except that at length {', '.join(str(n) for n in tails)} "
                f"(not dividing {d['tokens']}) the last {d['tokens']} mod L targets are scored by one more window "
                f"ending at target {d['last']}, its earlier positions context only")
            lines.append(f"{name}: scored the same {d['tokens']} target tokens (split positions {d['first']}.."
                         f"{d['last']}, sha256 {d['sha256'][:12]}) at every length ({lengths}); {how}")
        return lines

    def table(self) -> str:
        scaled = any(r.rope_scaling for r in self.records)        # a RoPE column only when one was scaled
        rope_head = " RoPE scaling |" if scaled else ""
        rows = ["| dataset | length | mode |" + rope_head + " tokens | windows | ppl | bpb |",
                "|---|---|---|" + ("---|" if scaled else "") + "---|---|---|---|"]
        for r in self.records:
            bpb = "—" if r.bpb is None else f"{r.bpb:.4f}"
            rope = f" {r.rope_scaling or 'none'} ×{r.rope_factor or 1:g} |" if scaled else ""
            rows.append(f"| {r.dataset} | {r.length} | {r.mode} |{rope} {r.tokens} | {r.windows} | {r.ppl:.3f} | "
                        f"{bpb} |")
        return "\n".join(rows)

    def to_dict(self) -> dict:
        return {"settings": self.settings, "datasets": self.datasets, "results": [asdict(r) for r in self.records]}
