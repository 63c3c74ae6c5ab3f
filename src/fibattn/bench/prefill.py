"""``fibattn bench generate``'s prefill timing (:mod:`fibattn.bench.generate`): a prompt of random tokens through
``DecodeSession.prefill``, eager (with the attention core's share) or compiled, on all blocks or a few of a
deep model scaled to its depth."""
from __future__ import annotations

import time
import types

import torch

from ..devices import synchronize
from ..generation.decode import DecodeSession
from ..generation.static import rope_tables
from ..model.lm import FibLM


def _shallow(model: FibLM, layers: int):
    L = len(model.blocks)
    if L <= 4 or layers >= L:
        return model, 1.0
    picks = [L // 2] if layers == 1 else sorted({round(i * (L - 1) / (layers - 1)) for i in range(layers)})
    view = types.SimpleNamespace(embed=model.embed, norm=model.norm, cfg=model.cfg, logits=model.logits,
                                 blocks=[model.blocks[i] for i in picks])
    return view, L / len(picks)


@torch.no_grad()
def prefill_time(model: FibLM, length: int, layers: int, compiled: bool = False,
                 chunk: int | None = None) -> tuple[float, float | None, int]:
    """Seconds to prefill ``length`` random tokens and, of those, seconds in the attention
    core (both scaled to full depth; the core None when ``compiled``: it is inside the graphs), and the number
    of blocks run. ``compiled``: through :meth:`DecodeSession.compile_prefill`, after one untimed run that
    compiles the chunks' graphs. ``chunk``: prompt tokens per pass (default the session's)."""
    view, scale = _shallow(model, layers)
    device = model.embed.weight.device
    ids = torch.randint(0, model.cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
    if compiled:
        for _ in range(2):              # the first run compiles: the second is timed
            session = DecodeSession(view, 1, length + 1, prefill_chunk=chunk)
            session.compile_prefill(rope_tables(session))
            synchronize(device)
            t0 = time.perf_counter()
            session.prefill([0], ids.to(device))
            synchronize(device)
        return (time.perf_counter() - t0) * scale, None, len(view.blocks)
    session = DecodeSession(view, 1, length + 1, prefill_chunk=chunk)
    core, spent = session._prefill_core, [0.0]

    def timed_core(*args):
        synchronize(device)
        t = time.perf_counter()
        out = core(*args)
        synchronize(device)
        spent[0] += time.perf_counter() - t
        return out

    session._prefill_core = timed_core
    synchronize(device)
    t0 = time.perf_counter()
    session.prefill([0], ids.to(device))
    synchronize(device)
    return (time.perf_counter() - t0) * scale, spent[0] * scale, len(view.blocks)
