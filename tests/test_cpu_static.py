"""``tools/cpu_static.py``: its run finder on hand-written ``objdump`` text, and the whole analysis of
today's kernels compiled for an AVX-512 target on this machine, with issue 29's static goal, so that
a change that makes the AVX-512 dots spill again, or renames the kernels the tool reads, fails here."""
import json
import platform
import shutil
import subprocess
import sys

import pytest

from tool_helpers import TOOLS, load_tool

cs = load_tool("cpu_static")


# objdump -d --no-show-raw-insn: a dense run split by a branch target, a loop, a spill reload
DISASSEMBLY = """
0000000000000000 <toy_f32>:
   0:\tvmovups (%rsi),%zmm0
   6:\tvfmadd231ps (%rax),%zmm0,%zmm1
   c:\tvfmadd231ps 0x40(%rax),%zmm0,%zmm2
  12:\tmov    0x10(%rsp),%rax
  17:\tvfmadd231ps (%rax),%zmm0,%zmm3
  1d:\tvfmadd231ps 0x40(%rax),%zmm0,%zmm4
  23:\tvfmadd231ps (%rdx),%zmm0,%zmm5
  29:\tjne    1d <toy_f32+0x1d>
  2b:\tvaddps %zmm1,%zmm2,%zmm1
  31:\tret

0000000000000040 <other>:
  40:\tvfmadd231ps (%rdx),%zmm0,%zmm5
"""


def test_runs_split_at_branches_and_their_targets():
    funcs = cs.functions(DISASSEMBLY)
    assert list(funcs) == ["toy_f32", "other"] and len(funcs["toy_f32"]) == 10
    runs = cs.runs(funcs["toy_f32"])
    assert [len(r) for r in runs] == [5, 3, 2]                  # 0x0-0x17 | 0x1d (the target)-0x29 | 0x2b-0x31
    s = cs.summarize(funcs["toy_f32"], max_fmas=2, min_fmas=2)
    assert s["all"] == {"runs": 2, "fmas": 5, "instructions_per_fma": 1.6, "stack_per_fma": 0.2}
    assert s["small_heads"] == {"runs": 1, "fmas": 2, "instructions_per_fma": 1.5, "stack_per_fma": 0.0}


def test_goals_read_the_avx512_targets_only():
    small = {"small_heads": {"stack_per_fma": 0.3}}
    res = {"x86-64-v3": {"forward": small}, "skylake-avx512": {"forward": {"small_heads": {"stack_per_fma": 0.01}},
                                                               "backward pass 1": small}}
    assert [(w.split(":")[0], ok) for w, ok, _ in cs.goals(res)] == [
        ("skylake-avx512 forward", True), ("skylake-avx512 backward pass 1", False)]


TOOLCHAIN = platform.machine() in ("x86_64", "AMD64") and shutil.which("gcc") and shutil.which("objdump")


@pytest.mark.skipif(not TOOLCHAIN, reason="needs gcc and objdump for x86-64")
def test_todays_avx512_dots_do_not_spill(tmp_path):
    out = tmp_path / "static.json"
    cmd = [sys.executable, str(TOOLS / "cpu_static.py"), "--targets", "skylake-avx512", "--goals", "--json", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    data = json.loads(out.read_text())
    kernels = data["targets"]["skylake-avx512"]
    assert set(kernels) == {"forward", "backward pass 1", "backward pass 2"}
    assert kernels["forward"]["all"]["fmas"] > 0 and kernels["backward pass 1"]["all"]["fmas"] > 0
    assert data["goals"] and all(g["ok"] for g in data["goals"])


@pytest.mark.skipif(not TOOLCHAIN, reason="needs gcc and objdump for x86-64")
def test_native_reads_the_library_the_backend_runs(tmp_path, monkeypatch):
    """``native`` without extra flags reads the backend's own library (no second compile of it); with
    extra flags it compiles its own object."""
    from fibattn.ops import cpu_backend
    if cpu_backend.library_file() is None:
        pytest.skip("cpu kernels unavailable")
    assert cs.native_library() == cpu_backend.library_file()
    compiled = []
    monkeypatch.setattr(cs, "compile_object", lambda *a: compiled.append(a) or pytest.fail("compiled native"))
    kernels = cs.analyse("native", tmp_path)
    assert not compiled and set(kernels) == set(cs.KERNELS)
    assert kernels["forward"]["all"]["fmas"] > 0 and kernels["backward pass 2"]["all"]["fmas"] > 0
    with pytest.raises(pytest.fail.Exception):
        cs.analyse("native", tmp_path, ("-DFA_VREGS=4",))
