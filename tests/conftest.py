"""Test-wide settings and shared fixtures.

Without a CUDA device the ``triton`` backend's kernels run on CPU tensors through Triton's
interpreter; it must be switched on before any kernel is defined (fibattn defines them on
first use of the backend). ``-m gpu`` runs the same tests natively on CUDA.
"""
import contextlib
import hashlib
import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# torch.compile's on-disk caches key a graph by its code, not by the fake (meta) implementations of the
# custom ops in it: a graph cached under an older fibattn keeps that version's output shapes (its
# inductor code then fails a size assert). The suite compiles into a folder of its own per version of
# the ops' sources, so it never meets another version's graphs.
_OPS = Path(__file__).resolve().parents[1] / "src" / "fibattn" / "ops"
_KEY = hashlib.sha256(b"".join(f.read_bytes() for f in sorted(_OPS.glob("*.py")))).hexdigest()[:12]
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"fibattn-inductor-{_KEY}"))


@pytest.fixture
def one_thread():
    """One thread: tiny workloads run fastest (and steadiest on a shared CPU)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def dynamo_only(monkeypatch):
    """``torch.compile`` on the ``eager`` backend: dynamo's capture (fullgraph breaks, graphs, recompiles) without
    inductor's code generation (tens of seconds a model on 2 cores), for tests whose point is the capture."""
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "eager"}))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """The bundled corpus prepared once per session with the ``tiny`` preset's data settings
    (byte tokens). Tests must not modify it: copy it first."""
    from fibattn.data import ensure_prepared
    from fibattn.presets import tiny
    dcfg = tiny().data
    dcfg.out_dir = str(tmp_path_factory.mktemp("tiny-data") / "shakespeare")
    ensure_prepared(dcfg, progress=False)
    return Path(dcfg.out_dir)


@contextlib.contextmanager
def own_remote_code_cache(root):
    """Remote code loaded in this process goes to a module cache under ``root`` and leaves ``sys.modules`` with
    it: transformers imports a folder's code as ``transformers_modules.*``, and a package of that name already
    imported from another cache hides the next test's modules."""
    import transformers.dynamic_module_utils as dynamic
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(dynamic, "HF_MODULES_CACHE", str(Path(root) / "modules"))
        mp.syspath_prepend(str(Path(root) / "modules"))
        try:
            yield
        finally:
            for name in [n for n in sys.modules if n.startswith("transformers_modules")]:
                del sys.modules[name]
