"""``tools/gpu_static.py``: its SASS loop finder on hand-written SASS, and the whole analysis of
today's kernels compiled for sm_90 without a device: its structure, and issue 22's offline goals
(``--goals``), so that a change that loses the tensor cores, spills or costs more instructions
fails here, on a machine with no GPU."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tool_helpers import load_tool

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "gpu_static.py"


@pytest.fixture(scope="module")
def gs():
    return load_tool("gpu_static")


# cuobjdump -sass style: a forward branch, an outer loop holding a nested loop, a second loop,
# the exit, the terminal self-branch and NOP padding.
SASS = """
\tcode for sm_90a
\t\tFunction : toy_kernel
        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */
                                                                           /* 0x000ff00000000800 */
        /*0010*/                   S2R R0, SR_TID.X ;                      /* 0x0000000000007919 */
        /*0020*/              @P0 BRA 0x50 ;                               /* 0x0000000000000947 */
        /*0030*/                   FADD R2, R2, R3 ;                       /* 0x0000000000000000 */
        /*0040*/                   FMUL R2, R2, R3 ;                       /* 0x0000000000000000 */
        /*0050*/                   LDG.E R4, desc[UR4][R2.64] ;            /* 0x0000000000000000 */
        /*0060*/                   HMMA.16816.F32.BF16 R8, R4, R6, R8 ;    /* 0x0000000000000000 */
        /*0070*/                   FFMA R5, R4, R4, R5 ;                   /* 0x0000000000000000 */
        /*0080*/                   SHFL.BFLY PT, R6, R5, 0x1, 0x1f ;       /* 0x0000000000000000 */
        /*0090*/              @P1 BRA 0x70 ;                               /* 0x0000000000000000 */
        /*00a0*/                   NOP ;                                   /* 0x0000000000000000 */
        /*00b0*/              @P2 BRA 0x50 ;                               /* 0x0000000000000000 */
        /*00c0*/                   MUFU.EX2 R7, R7 ;                       /* 0x0000000000000000 */
        /*00d0*/                   LDS R9, [R1] ;                          /* 0x0000000000000000 */
        /*00e0*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;           /* 0x0000000000000000 */
        /*00f0*/              @P3 BRA 0xd0 ;                               /* 0x0000000000000000 */
        /*0100*/                   STG.E desc[UR4][R2.64], R7 ;            /* 0x0000000000000000 */
        /*0110*/                   EXIT ;                                  /* 0x0000000000000000 */
        /*0120*/                   BRA 0x120;                              /* 0x0000000000000000 */
        /*0130*/                   NOP;                                    /* 0x0000000000000000 */
        /*0140*/                   NOP;                                    /* 0x0000000000000000 */
\t\t..........
"""

# nvdisasm -gi style: one source loop that ptxas split into an unrolled loop and its remainder.
NVDISASM = """
.text.toy:
\t//## File "k.py", line 10
        /*0000*/                   MOV R0, RZ ;
.L_x_0:
\t//## File "k.py", line 12 inlined at "k.py", line 20
\t//## File "k.py", line 20
        /*0010*/                   FADD R0, R0, R1 ;
        /*0020*/                   FADD R0, R0, R1 ;
\t//## File "k.py", line 11
        /*0030*/               @P0 BRA `(.L_x_0) ;
.L_x_1:
\t//## File "k.py", line 12 inlined at "k.py", line 20
        /*0040*/                   FADD R0, R0, R1 ;
\t//## File "k.py", line 11
        /*0050*/               @P1 BRA `(.L_x_1) ;
\t//## File "k.py", line 30
        /*0060*/               @P2 BRA `(.L_x_2) ;
        /*0070*/                   EXIT ;
.L_x_2:
        /*0080*/                   BRA `(.L_x_2);
"""


def test_sass_loops(gs):
    funcs = gs.parse_sass(SASS)
    assert list(funcs) == ["toy_kernel"]
    body = gs.function_body(funcs["toy_kernel"])
    assert [i.addr for i in body][-1] == 0x110 and all(i.base != "NOP" for i in body)
    assert body[2].target == 0x50                               # the forward branch
    loops = gs.find_loops(body)
    assert [(lp.start, lp.end, lp.nested, len(lp.body)) for lp in loops] == [(0x50, 0xb0, 1, 6), (0xd0, 0xf0, 0, 3)]
    a = gs.analyse_sass("toy_kernel", SASS, [5, 7])
    assert a["loop_bodies"] == [6, 3] and a["machine_loops"] == [1, 1]
    assert a["straight_line"] == 8                              # 0x00-0x40, 0xc0, 0x100, 0x110
    assert a["tensor_core_instructions"] == a["tensor_core_instructions_in_loops"] == 1
    assert a["loop_mix"][0] == {"FFMA": 1, "SHFL": 1, "LDG": 1, "MMA": 1, "other": 2}
    assert a["loop_mix"][1] == {"BAR": 1, "LDS": 1, "other": 1}
    with pytest.raises(gs.LoopMismatch, match="toy_kernel.*1 outermost.*has 2"):
        gs.analyse_sass("toy_kernel", SASS, [5])


def test_split_loop_is_one_source_loop(gs):
    a = gs.analyse_sass("toy", NVDISASM, [9])
    assert a["machine_loops"] == [2] and a["loop_bodies"] == [2]    # the remainder loop: one iteration
    assert a["straight_line"] == 3
    assert a["loop_mix"] == [{"FADD": 1, "other": 1}]


def _nvidia_tools() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    spec = importlib.util.find_spec("triton")
    base = Path(spec.origin).parent / "backends" / "nvidia"
    return (base / "compiler.py").exists() and (base / "bin" / "cuobjdump").exists()


@pytest.mark.slow          # tests/test_gpu_check.py's quick check runs the same static step in the default suite
def test_todays_kernels(tmp_path):
    if not _nvidia_tools():
        pytest.skip("triton without its NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "gpu_static.json"
    res = subprocess.run([sys.executable, str(TOOL), "--json", str(out), "--goals"], check=False, capture_output=True,
                         text=True, env=env, timeout=300, cwd=ROOT)
    if res.returncode and "nvidia" in res.stderr and "No module" in res.stderr:
        pytest.skip("triton without its NVIDIA backend")
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    assert "thread-instructions per (query, head, column)" in res.stdout
    count = ("import sys; sys.path.insert(0, 'tools'); import gpu_static as g; "
             "from fibattn.ops import triton_static as t; G = g.GOAL; "
             "print(*(len(t.static_kernels(G['heads'] // G['kv_heads'], G['head_dim'], G['window'], "
             "g.goal_rungs(two), two)) for two in (False, True)))")
    counts = subprocess.run([sys.executable, "-c", count], check=False, capture_output=True, text=True, env=env,
                            timeout=120, cwd=ROOT)
    assert counts.returncode == 0, counts.stderr[-2000:]
    n_int, n_interp = (int(x) for x in counts.stdout.split())

    data = json.loads(out.read_text())
    for key in ("kernels", "thread_instructions_per_query_head_column", "estimate_ms", "fa2_estimate_ms",
                "interpolated", "ratio_interpolated_to_integer"):
        assert key in data, key
    for op, n in ((data, n_int), (data["interpolated"], n_interp)):
        assert len(op["kernels"]) == len(op["details"]) == n > 0
        for k in op["kernels"]:
            assert set(k) == {"name", "registers", "spill_bytes", "tensor_core_instructions",
                              "loop_instructions_per_thread"}
            assert 0 < k["registers"] <= 255 and k["spill_bytes"] >= 0 and k["tensor_core_instructions"] >= 0
            assert all(b > 0 for b in k["loop_instructions_per_thread"])
        for d in op["details"]:
            assert len(d["loop_trips"]) == len(d["machine_loops"]) == len(d["loop_mix"])
            assert d["straight_line_instructions"] > 0 and d["dynamic_instructions_per_thread"] > 0
        assert op["thread_instructions_per_query_head_column"] > 0
        assert set(op["estimate_ms"]) == set(op["fa2_estimate_ms"]) == {"4096", "16384", "65536"}
        assert all(v > 0 for v in list(op["estimate_ms"].values()) + list(op["fa2_estimate_ms"].values()))
    assert data["ratio_interpolated_to_integer"] > 0
    # issue 56 item 3's compiled side: the stages add up to the op's count; the traffic share and the count that
    # would reach the goal follow from the estimate
    for op in ("integer", "interpolated"):
        total = data if op == "integer" else data["interpolated"]
        assert sum(data["stages"][op].values()) == pytest.approx(total["thread_instructions_per_query_head_column"],
                                                                abs=1.0)
    tr = data["traffic"]
    assert tr["T"] == 65536 and tr["estimate_ms"] == pytest.approx(data["estimate_ms"]["65536"], rel=1e-3)
    assert 0 < tr["share_of_copy"] < 1 and tr["goal"] == 0.4
    assert tr["instructions_for_goal"] == pytest.approx(
        data["thread_instructions_per_query_head_column"] * tr["share_of_copy"] / tr["goal"], rel=0.01)
    assert "FAIL" not in res.stdout and res.stdout.count("PASS") == 8, res.stdout[-2000:]
