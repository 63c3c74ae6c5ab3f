"""``fibattn train``: train a :class:`fibattn.model.lm.FibLM` from a preset plus overrides.

    fibattn train --preset tiny [--set model.window=8 ...] [--out DIR] [--resume auto|never|PATH]
    torchrun --nproc_per_node 4 -m fibattn.cli train --preset paper ...       # DDP, same command

Python API: ``train(cfg, resume="auto") -> TrainResult``.

One optimiser step consumes ``train.batch_tokens`` tokens over all processes:
``accum = batch_tokens / (micro_batch * seq_len * world_size)`` micro-batches per process.
Each step is checked before the update: a non-finite loss or gradient norm skips the
update (logged); ``train.max_bad_steps`` such steps in a row abort the run, leaving the
last checkpoint intact. Outputs in ``OUT``: ``config.json``, ``metrics.jsonl``,
``checkpoints/step-N/`` (see :mod:`fibattn.trainer.state`); metrics also go to the
results database (:mod:`fibattn.storage.results`). SIGTERM stops at the next step boundary
with a checkpoint (status ``stopped``; ``--resume auto`` continues). Multi-node runs need
``OUT`` on a filesystem shared by all nodes (every rank writes its RNG and loader state
into the checkpoint folder).
"""
from __future__ import annotations

import contextlib
import copy
import logging
import math
import signal
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from .. import config as C
from ..checks import UsageError
from ..config import RunConfig
from ..validation import fit_warmup, validate
from ..model.lm import FibLM
from ..ops.backends import check_model_runs
from ..storage.init_source import describe, load_into
from ..storage.results import resolve_db_path, run_key
from . import distributed as D
from . import state as S
from .grad_reduce import attach as attach_ordered_reduce
from .init_weights import open_init
from .batches import BatchForward, build_mesh, to_device, validation_losses
from .logs import MetricSinks, ProgressBar, progress_line
from .micro_batch import resolve as resolve_micro_batch
from .outcome import TrainingAborted, TrainResult, settle  # noqa: F401 (TrainingAborted: imported from here)
from .optim import build_optimizer, lr_at, param_names, set_lr
from .pace import Pace, estimate_lines
from .throughput import announce, eval_line, mfu
from .setup import (accum_steps, autocast_for, check_data, check_fits, check_out_dir, compile_cache, compile_wanted,
                    document_kwargs, load_data, lock_run, loss_head_for, prepare_out_dir, seed_all, keep_threads,
                    sequences_per_rank, set_threads, tokenizer_file, warn_disk_space)

log = logging.getLogger("fibattn")


# ------------------------------------------------------------------------------ trainer
class Trainer:
    def __init__(self, cfg: RunConfig, dist: D.DistInfo, data, loss_hook, init=None):
        self.cfg, self.dist, self.loss_hook, self.init = cfg, dist, loss_hook, init
        t = cfg.train
        self.out = Path(t.out_dir)
        check_model_runs(cfg.model, dist.device, grad=True)
        self.mesh = build_mesh(cfg, dist)                # data x context parallel ranks
        per_rank = sequences_per_rank(cfg, self.mesh.dp_size)
        self.loss_head = loss_head_for(t.loss_head, dist.device, dist.is_main)
        check_fits(cfg, dist.device, self.loss_head)
        self.lock = None                             # the run folder's writer lock, taken in run()
        check_out_dir(self.out, t.results_db, dist)
        set_threads(t, dist)
        seed_all(t.seed)
        self.data = data if data is not None else load_data(cfg, dist)
        check_data(cfg, self.data, dist)
        self.model = FibLM(cfg.model).to(dist.device).set_activation_checkpointing(t.activation_checkpointing)
        self.model.set_loss_head(self.loss_head)
        self.autocast = autocast_for(t.precision, dist.device)
        if t.micro_batch == 0:                           # auto: tried on the model before any state exists
            t.micro_batch = resolve_micro_batch(cfg, self.model, dist, self.autocast, per_rank)
        self.accum = accum_steps(cfg, self.mesh.dp_size)
        self.names = param_names(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = build_optimizer(self.model, t)
        with D.together(dist, "verifying the training shards"):
            self.loader = self.data.train_loader(cfg.model.seq_len, t.micro_batch, seed=t.seed,
                                                 rank=self.mesh.dp_rank, world_size=self.mesh.dp_size)
        self.step, self.tokens, self.skipped, self.bad, self.elapsed = 0, 0, 0, 0, 0.0
        self.stop_requested = False          # set by SIGTERM on this process
        self.stop_agreed = False             # any rank asked to stop (all-reduced each step)
        self.resumed_from: Path | None = None
        self.tokenizer_file = tokenizer_file(self.data)
        self.forward = BatchForward(self.model, self.mesh, document_kwargs(t.document_masking, self.data))

    # ------------------------------------------------------------------ resume / wrap
    def resume(self, resume: str) -> None:
        self.window = S.new_window()
        self.resume_changed: list[str] = []
        self.resume_window: dict | None = None       # the checkpoint's partial loss window, when not continued
        path = S.find_resume(self.out, resume, self.dist)
        if path is None:
            return
        saved = S.saved_config(path)
        changed = S.check_compatible(saved, self.cfg, path)
        if changed and self.dist.is_main:
            log.warning("fibattn: resuming with changed settings: %s", ", ".join(changed))
        self.resumed_from = path
        tr = S.restore(path, model=self.model, optimizer=self.opt, names=self.names, loader=self.loader,
                       dist=self.dist)
        self.step, self.tokens = int(tr["step"]), int(tr["tokens"])
        self.skipped, self.bad, self.elapsed = int(tr["skipped"]), int(tr["bad"]), float(tr["elapsed"])
        keep_threads(self.cfg.train, tr.get("threads"), self.dist)
        # the loss window of the steps since the last progress line: continued when nothing changed (the log
        # then equals an uninterrupted run's), restarted when settings changed (the marker record keeps its mean)
        saved_window = S.saved_window(tr.get("window"))
        self.resume_changed = changed
        if saved_window is not None and not changed:
            self.window = saved_window
        elif saved_window is not None and saved_window["steps"]:
            self.resume_window = saved_window
        if self.dist.is_main:
            log.info("fibattn: resumed from %s (step %d)", path, self.step)

    def wrap(self) -> None:
        self.compiled = compile_wanted(self.cfg.train, self.dist.device, self.dist.is_main)
        # fullgraph: a graph break would hand control back to Python mid-model on every step, which compiling
        # is meant to remove (the custom ops trace whole); the inductor caches on disk make a resume quick
        if self.compiled:
            self.model.warm()
        fwd = torch.compile(self.model, fullgraph=True) if self.compiled else self.model
        self.eval_model = fwd
        if self.dist.distributed:
            from torch.nn.parallel import DistributedDataParallel as DDP
            ids = [self.dist.device.index] if self.dist.device.type == "cuda" else None
            fwd = DDP(fwd, device_ids=ids)
            if attach_ordered_reduce(fwd, self.model.parameters()) and self.dist.is_main:
                log.info("fibattn: gradients all-reduced once per step in parameter order (%d processes: "
                         "the same sums after a resume)", self.dist.world_size)
        self.fwd = fwd

    # ------------------------------------------------------------------ one step
    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One optimiser step, decided on the device: returns 0-d tensors (the loss summed over ranks, this
        rank's grad norm, whether the update was applied) that nothing here reads back, so the host runs
        ahead of the GPU (:meth:`_settle` reads them, at log, eval and checkpoint steps). A non-finite loss or
        grad norm skips the update inside the fused AdamW kernel (its ``found_inf``, as ``GradScaler`` uses
        it): the weights, moments and step count stay as they were."""
        self.fwd.train()
        set_lr(self.opt, lr_at(self.step, self.cfg.train))
        device = self.dist.device
        loss_sum = torch.zeros((), device=device, dtype=torch.float32)
        for i in range(self.accum):
            x, y = self.loader.next()
            x, y = to_device(x, device), to_device(y, device)
            sync = self.dist.distributed and i < self.accum - 1
            with (self.fwd.no_sync() if sync else contextlib.nullcontext()):
                with self.autocast():
                    loss = self.forward(self.fwd, x, y)[0]
                if self.loss_hook is not None:
                    loss = self.loss_hook(self.step + 1, loss)
                (loss / self.accum).backward()
            loss_sum += loss.detach().float()
        clip = self.cfg.train.grad_clip if self.cfg.train.grad_clip > 0 else float("inf")
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, clip).float()
        flags = torch.stack([loss_sum / self.accum, (~torch.isfinite(gnorm)).float(),
                             torch.full((), float(self.stop_requested), device=device)])
        D.all_reduce_sum(self.dist, flags)
        ok = torch.isfinite(flags[0]) & (flags[1] == 0)
        self.opt.found_inf = (~ok).float()
        try:
            self.opt.step()
        finally:
            self.opt.found_inf = None
        self.opt.zero_grad(set_to_none=True)
        self._agree_on_stop(flags[2])
        return flags[0], gnorm, ok

    def _agree_on_stop(self, stop: torch.Tensor) -> None:
        """Whether every rank stops now. One process reads its own flag; under torchrun the ranks' all-reduced
        flags are read one step late (by then that step is done, so the read does not stall the queue), and
        every rank reads the same value: no rank leaves the loop alone."""
        if not self.dist.distributed:
            self.stop_agreed = self.stop_requested
            return
        before, self._stop_flag = getattr(self, "_stop_flag", None), stop
        self.stop_agreed = before is not None and bool(before > 0)

    def evaluate(self) -> dict[str, float]:
        return validation_losses(self)

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path:
        state = {"tokens": self.tokens, "skipped": self.skipped, "bad": self.bad, "elapsed": self.elapsed,
                 "window": dict(getattr(self, "window", None) or S.new_window()), "threads": torch.get_num_threads()}
        return S.save(self.out, self.step, model=self.model, optimizer=self.opt, names=self.names,
                      loader=self.loader, trainer=state, cfg=self.cfg, dist=self.dist, keep=self.cfg.train.keep_ckpts,
                      tokenizer_file=self.tokenizer_file)

    # ------------------------------------------------------------------ loop
    def run(self, resume: str, stop_at: int | None) -> TrainResult:
        t, dist = self.cfg.train, self.dist
        with D.together(dist, "locking train.out_dir"):
            if dist.is_main and self.out.is_dir():  # before resume() tidies its checkpoints folder
                self.lock = lock_run(self.out)
        self.resume(resume)
        if self.init is not None and self.resumed_from is None:     # a fresh start from trained weights
            parts = load_into(self.model, self.init)
            if dist.is_main:
                log.info("fibattn: %s", describe(self.init, parts))
        self.init = None                                            # free the source's tensors
        with D.together(dist, "preparing train.out_dir"):
            if dist.is_main:        # the results DB was checked in __init__, before the data was prepared
                warn_disk_space(self.out, self.model.num_params(False), t.keep_ckpts)
                from .logs import metrics_to_keep
                metrics_to_keep(self.out / "metrics.jsonl", self.step)    # a damaged log fails before anything runs
                prepare_out_dir(self.out)
                if self.lock is None:           # a new folder: locked once it exists, before anything is written
                    self.lock = lock_run(self.out)
        self.wrap()
        self.peak, self.flops = announce(self.cfg, self.model, dist)      # size, budget, lr plan, flops
        warned = False
        if dist.is_main:                    # what the run costs here, and a warning when that is days
            lines, warned = estimate_lines(t.steps - self.step, self.flops * t.batch_tokens / dist.world_size,
                                           dist.device, self.peak)
            for line in lines:
                (log.warning if "WARNING" in line else log.info)("%s", line)
        self.pace = Pace(t.steps, t.log_every, dist.device, warned, self.compiled)
        sinks = None
        if dist.is_main:
            C.save(self.cfg, self.out / "config.json")              # only the settings that act
            sinks = MetricSinks(self.out, run_key(self.out), resolve_db_path(self.out, t.results_db),
                                tensorboard=t.tensorboard, wandb=t.wandb, wandb_project=t.wandb_project,
                                config=C.to_dict(self.cfg))
        status = "failed"
        try:
            if sinks is not None:
                if sinks.db is not None:
                    sinks.db.start_run(run_key(self.out), config=C.to_dict(self.cfg),
                                       out_dir=str(self.out.resolve()), label=self.cfg.name, fresh=self.step == 0)
                sinks.truncate(self.step)
                if self.resumed_from is not None:
                    sinks.mark_resume(self.step, self.resumed_from, self.resume_changed, self.resume_window)
            result = self._loop(sinks, stop_at)
            status = result.status
            return result
        finally:
            if sinks is not None:
                sinks.close(status)

    def _log_eval(self, sinks, result: TrainResult, bar: ProgressBar) -> None:
        val = self.evaluate()
        result.val_loss = val
        if sinks is not None and val:
            values = {}
            for name, v in val.items():
                values[f"val/{name}/loss"] = v
                values[f"val/{name}/ppl"] = math.exp(min(v, 50.0))
            sinks.log(self.step, values)
            bar.println(eval_line(self.step, val, self.data, self.cfg))

    def _settle(self, pending: list, sinks, result: TrainResult, bar: ProgressBar) -> float:
        return settle(self, pending, sinks, result, bar)

    def _loop(self, sinks, stop_at: int | None) -> TrainResult:
        t, dist = self.cfg.train, self.dist
        total, tokens_per_step = t.steps, t.batch_tokens
        result = TrainResult(self.out, "finished", self.step, self.tokens, skipped_steps=self.skipped)
        bar = ProgressBar(total, silent=not dist.is_main)
        learned = self.cfg.model.attention == "sparse" and self.cfg.model.schedule == "learned"
        win = self.window                    # loss/time window since the last progress line (saved in checkpoints)
        last_saved = self.resumed_from
        pending: list = []                   # (step, loss, grad norm, applied) on the device, not read yet
        shown_loss = float("nan")            # the progress bar's loss: the last one read

        def going() -> bool:
            return self.step < total and (stop_at is None or self.step < stop_at) and not self.stop_agreed
        while going():
            t0 = time.perf_counter()
            loss, gnorm, ok = self.train_step()
            dt = time.perf_counter() - t0
            lr = self.opt.param_groups[0]["lr"]
            self.step += 1
            self.tokens += tokens_per_step
            self.elapsed += dt
            win["time"] += dt
            win["steps"] += 1
            pending.append((self.step, loss, gnorm, ok))
            if self.compiled and len(result.losses) + len(pending) == 1 and dist.is_main:
                log.info("fibattn: first step %.1f s, compiling the model's forward and backward included (%s)",
                         dt, compile_cache())
            log_now = self.step % t.log_every == 0 or self.step == total
            eval_now = bool(t.eval_every) and self.step % t.eval_every == 0 and self.step != total
            ckpt_now = self.step % t.ckpt_every == 0 and self.step != total
            if log_now or eval_now or ckpt_now or not going():     # every other step leaves the device alone
                gnorm_v = self._settle(pending, sinks, result, bar)
                shown_loss = result.losses[-1][1]
            eta = (total - self.step) * (win["time"] / max(win["steps"], 1))
            bar.update(self.step, shown_loss, eta)
            for line in self.pace.after(self.step, win["time"] / max(win["steps"], 1), eta, log_now):
                bar.println(line)               # a slow step's own line until the progress lines take over
            if log_now:
                mean = win["loss"] / win["n"] if win["n"] else float("nan")
                tok_s = win["steps"] * tokens_per_step / max(win["time"], 1e-9)
                util = mfu(tok_s, self.flops, self.peak, dist.world_size)
                bar.println(progress_line(self.step, total, mean, lr, gnorm_v, tok_s, eta, util))
                if sinks is not None:
                    sinks.log(self.step, {"loss": mean, "lr": lr, "grad_norm": gnorm_v, "tok_s": tok_s,
                                          "tokens": float(self.tokens), **({"mfu": util} if util else {})},
                              alphas=self.model.alphas() if learned else None)
                win.update(S.new_window())
            if eval_now:
                self._log_eval(sinks, result, bar)
            if ckpt_now:
                last_saved = self.save()
            if sinks is not None and sinks.db_error is not None:
                self.stop_requested = True   # stop at the next step boundary, with a checkpoint (all ranks agree)
        if self.step >= total:
            self._log_eval(sinks, result, bar)
        else:
            result.status = "stopped"
            bar.println(f"stopped at step {self.step}/{total}; continue with --resume auto")
        if last_saved is None or S.ck.step_dir(S.ck.ckpt_root(self.out), self.step) != last_saved:
            last_saved = self.save()
        bar.clear()
        if sinks is not None and sinks.db_error is not None:
            from ..storage.results import ResultsDBError
            raise ResultsDBError(f"{sinks.db_error}. Training {result.status} at step {self.step} with checkpoint "
                                 f"{last_saved} (metrics.jsonl has every record); fix the database, then continue "
                                 f"with --resume auto")
        result.step, result.tokens, result.skipped_steps = self.step, self.tokens, self.skipped
        result.checkpoint, result.elapsed_s = last_saved, self.elapsed
        return result


# ------------------------------------------------------------------------------ API / CLI
def train(cfg: RunConfig, *, resume: str = "auto", stop_at: int | None = None, data=None,
          loss_hook: Callable[[int, torch.Tensor], torch.Tensor] | None = None) -> TrainResult:
    """Train ``cfg`` (a copy is validated and used); returns a :class:`TrainResult`.

    ``resume``: ``auto`` (newest verified checkpoint in ``OUT/checkpoints``, if any),
    ``never`` (refuse when checkpoints exist) or a checkpoint folder. ``stop_at``: stop
    after this global step with a checkpoint (status ``stopped``). ``data``: a
    ``TokenData``-like object instead of ``cfg.data``. ``loss_hook(step, loss)``: a
    debugging/testing hook that may replace each micro-batch loss of step ``step``
    (1-based, as logged) before backward.
    """
    if not isinstance(cfg, RunConfig):
        raise UsageError(f"train() expects a fibattn.config.RunConfig, got {type(cfg).__name__}")
    if not isinstance(resume, (str, Path)) or not str(resume):
        raise UsageError(f"resume must be 'auto', 'never' or a checkpoint folder, got {resume!r}")
    if stop_at is not None and (isinstance(stop_at, bool) or not isinstance(stop_at, int) or stop_at < 1):
        raise UsageError(f"stop_at must be an integer >= 1, got {stop_at!r}")
    with D.starting():                       # under torchrun: a rank's refusal here reaches every rank
        cfg = validate(copy.deepcopy(cfg))
        note = fit_warmup(cfg.train)         # the CLI refused a given one; a preset's is cut to the run
        if note:
            log.info(note)
        if str(resume) not in ("auto", "never"):
            try:
                S.ck.verify(Path(resume))    # a bad --resume fails before the data is prepared
            except S.ck.CheckpointError as exc:     # named as the flag the user gave
                raise S.ck.CheckpointError(f"--resume {resume}: {exc}") from None
        init = open_init(cfg, str(resume))   # so does a source that does not fit the model
        dist = D.plan(cfg.train)
    dist = D.connect(dist)
    trainer = old = None
    try:
        D.check_same(dist, {**C.to_dict(cfg), "--resume": str(resume), "--stop-at": stop_at},
                     "resolved config")                            # before anything is written
        trainer = Trainer(cfg, dist, data, loss_hook, init)
        if threading.current_thread() is threading.main_thread():
            def on_term(signum, frame):
                trainer.stop_requested = True
            old = signal.signal(signal.SIGTERM, on_term)
        result = trainer.run(str(resume), stop_at)
        D.barrier(dist)      # the ranks tear down together: gloo's destructors wait on a peer that already left
        return result
    except RuntimeError as exc:
        lost = D.peer_lost(dist, exc)       # a gloo/nccl error because a peer died: one line, not its traceback
        if lost is None:
            raise
        raise lost from None
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
        if trainer is not None and trainer.lock is not None:
            trainer.lock.release()
        trainer = None       # the model and its DDP reducer go before the process group they use
        D.shutdown(dist)
