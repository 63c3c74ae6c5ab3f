"""The training step as a GPU runs it (issue 54's offline goals): it reads nothing back from the device
outside the steps that log, evaluate or checkpoint, so the host can run ahead of the GPU; a skipped
(non-finite) step is decided on the device; ``train.compile`` traces the model whole (``fullgraph``), with
no recompilation from step to step, and gives eager's losses.

What counts as a read back: tests/readbacks.py. The same tests run on CUDA with ``-m gpu``, where each read is
a real synchronisation.
"""
import pytest
import torch

from fibattn.trainer import trainer as T
from fibattn.trainer.trainer import train
from readbacks import recording
from run_helpers import micro_config


@pytest.fixture
def count_reads(monkeypatch):
    """Wraps ``Trainer.train_step`` so that each call's read backs are recorded, per step, and
    ``Trainer._settle`` so that the steps at which the loop reads its pending values are recorded."""
    per_step, settled = [], []
    real_step, real_settle = T.Trainer.train_step, T.Trainer._settle

    def step(self):
        with recording() as seen:
            out = real_step(self)
        per_step.append(seen)
        return out

    def settle(self, pending, *args):
        settled.append([s for s, *_ in pending])
        return real_settle(self, pending, *args)
    monkeypatch.setattr(T.Trainer, "train_step", step)
    monkeypatch.setattr(T.Trainer, "_settle", settle)
    return per_step, settled


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


@pytest.mark.parametrize("loss_head", ["plain", "chunked"])
@pytest.mark.parametrize("device", DEVICES)
def test_a_step_reads_nothing_back_outside_the_log_steps(tmp_path, tiny_data, count_reads, device, loss_head):
    """8 steps of 2 micro-batches, a line every 4 steps, a checkpoint at step 6: no step reads anything back
    (with the plain head or the chunked one), and the loop reads its steps' values at steps 4, 6 and 8 only,
    in one batch each."""
    per_step, settled = count_reads
    cfg = micro_config(tmp_path / "run", tiny_data, n_layers=2, steps=8, batch_tokens=128, micro_batch=2,
                       log_every=4, ckpt_every=6, eval_tokens=64, threads=1, device=device, results_db="off",
                       loss_head=loss_head)
    res = train(cfg)
    assert res.status == "finished" and len(res.losses) == 8
    assert per_step == [[]] * 8, per_step
    assert settled == [[1, 2, 3, 4], [5, 6], [7, 8]]
    assert [s for s, _ in res.losses] == list(range(1, 9))


def test_nonfinite_steps_are_skipped_on_the_device(tmp_path, tiny_data, count_reads, monkeypatch):
    """A NaN loss at steps 2 and 3 (of 6, one line at the end): both updates are skipped inside the fused AdamW
    kernel without a read back, the weights after step 3 equal those after step 1, and the skipped steps are
    reported in order once the loop reads them (the log's records and the run's count)."""
    import json
    per_step, settled = count_reads
    nan = float("nan")
    seen = {}

    def hook(step, loss):
        return loss * nan if step in (2, 3) else loss
    real = T.Trainer.save

    def save(self):
        seen[self.step] = {k: v.clone() for k, v in self.model.state_dict().items()}
        return real(self)
    cfg = micro_config(tmp_path / "s", tiny_data, steps=6, batch_tokens=128, micro_batch=2, log_every=6,
                       ckpt_every=1, eval_tokens=64, threads=1, results_db="off")
    monkeypatch.setattr(T.Trainer, "save", save)
    res = train(cfg, loss_hook=hook)
    assert res.skipped_steps == 2 and res.status == "finished"
    assert per_step == [[]] * 6
    for name, value in seen[1].items():
        assert torch.equal(seen[3][name], value), name
        assert not torch.equal(seen[4][name], value) or "alpha" in name or value.dim() < 2
    recs = [json.loads(line) for line in (tmp_path / "s" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if r.get("skipped") == 1.0] == [2, 3]
    assert [s for s, _ in res.losses] == list(range(1, 7))


def test_compile_auto_is_eager_on_cpu(tmp_path, tiny_data, monkeypatch, caplog):
    """``train.compile=auto`` (the default) does not compile on a CPU, and says so once."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda *a, **k: calls.append(k) or a[0])
    cfg = micro_config(tmp_path / "r", tiny_data, steps=1, batch_tokens=64, micro_batch=2, eval_tokens=32,
                       threads=1, results_db="off")
    with caplog.at_level("INFO", logger="fibattn"):
        train(cfg)
    assert not calls and cfg.train.compile == "auto"
    assert caplog.text.count("train.compile auto -> eager (cpu") == 1


@pytest.mark.parametrize("loss_head", ["plain", "chunked"])
def test_compiled_training_traces_whole_and_never_recompiles(tmp_path, tiny_data, monkeypatch, caplog, loss_head):
    """``train.compile=true``: the model is compiled with ``fullgraph=True`` (a graph break would raise), one
    graph for all training steps (learning rate, step count and loss window change without a recompile),
    the first step's compile time logged, and the losses equal eager's bit for bit (the plain head, and the
    chunked one whose loop is traced). The graphs go through
    AOTAutograd (forward and backward, the custom ops inside) to the ``aot_eager`` backend, which runs them
    without inductor's code generation (nothing fused differently, so the same bits; 1.5 s instead of 26 s):
    what is tested is the trace; tests/test_compile.py runs inductor."""
    real = torch.compile
    graphs, options, per_step = [], [], []

    def counting(gm, example_inputs):
        graphs.append(gm)
        from torch._dynamo.backends.debugging import aot_eager
        return aot_eager(gm, example_inputs)

    def fake_compile(model, **kw):
        options.append(kw)
        return real(model, **{**kw, "backend": counting})
    monkeypatch.setattr(torch, "compile", fake_compile)
    real_step = T.Trainer.train_step

    def step(self):
        out = real_step(self)
        per_step.append(len(graphs))
        return out
    monkeypatch.setattr(T.Trainer, "train_step", step)
    torch._dynamo.reset()
    runs = {}
    for mode in ("true", "false"):
        cfg = micro_config(tmp_path / mode, tiny_data, n_layers=2, steps=5, batch_tokens=128, micro_batch=2,
                           warmup_steps=2, log_every=2, eval_tokens=64, threads=1, results_db="off", compile=mode,
                           loss_head=loss_head)
        with caplog.at_level("INFO", logger="fibattn"):
            runs[mode] = train(cfg)
    assert options == [{"fullgraph": True}]
    assert per_step[:5] == [1] * 5, per_step                  # compiled once, at the first step
    assert "first step" in caplog.text and "compiling the model" in caplog.text
    compiled, eager = ([v for _, v in runs[m].losses] for m in ("true", "false"))
    assert compiled == eager
