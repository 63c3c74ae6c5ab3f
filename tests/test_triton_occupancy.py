"""Tile choices made by the compiled code (``fibattn.ops.triton_occupancy``, issue 56): the occupancy rule, the
choice's fallbacks, the int64 indexing rule as compiled, and one real offline compile for sm_90 with Triton's own ptxas
(no device needed)."""
import json
import logging
import os
import subprocess
import sys

import pytest

from fibattn.ops import triton_backend, triton_occupancy as occ


@pytest.mark.parametrize("registers, warps, resident", [
    (128, 4, 16), (168, 4, 12), (170, 4, 8), (255, 4, 8), (256, 8, 8), (128, 8, 16), (129, 8, 8), (16, 4, 64),
    (1, 1, 32)])
def test_resident_warps(registers, warps, resident):
    """Registers are allocated in units of 8; at most 32 programs and 64 warps an SM."""
    assert occ.resident_warps(registers, warps) == resident


@pytest.mark.parametrize("registers, warps, index", [
    ([160, 115], 4, 0),     # both keep 12 warps (3 a scheduler): the larger step
    ([188, 140], 4, 1),     # 8 against 12
    ([184, 178], 4, 0),     # both 8: occupancy is lost either way, the larger step does less
    ([157, 128], 8, 1),     # 8 against 16 (counted as 12)
    ([90, 200, 60], 4, 0)])
def test_pick_takes_the_first_that_keeps_the_most_warps(registers, warps, index):
    assert occ.pick(registers, warps) == index
    assert occ.pick(registers, warps, [0] * len(registers)) == index


def test_pick_takes_a_candidate_that_does_not_spill():
    """Under a register cap both fit: the one that spills loses, unless all do."""
    assert occ.pick([168, 160], 4, [96, 0]) == 1
    assert occ.pick([168, 168], 4, [96, 16]) == 0
    assert occ.pick([168, 120], 4, [0, 0]) == 0


def test_one_candidate_or_no_target_compiles_nothing(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("compiled")
    monkeypatch.setattr(occ, "compile_kernel", boom)
    fn = triton_backend.kernels().bwd_dq_kernel
    assert occ.choose(fn, "RB", (1,), {}, "bf16", 64, {"num_warps": 4}, target=object()) == (1, {})
    assert occ.choose(fn, "RB", (2, 1), {}, "bf16", 64, {"num_warps": 4}, target=None) == (2, {})


def test_a_failed_compile_takes_the_first_and_says_so(monkeypatch, caplog):
    def fail(*a, **k):
        raise RuntimeError("no ptxas here")
    monkeypatch.setattr(occ, "compile_kernel", fail)
    fn = triton_backend.kernels().bwd_dq_kernel
    with caplog.at_level(logging.WARNING, logger="fibattn"):
        assert occ.choose(fn, ("MC", "RB"), ((4, 4), (16, 1)), {"TWO_TAP": True}, "bf16", 32, {"num_warps": 4},
                          target="t") == ((4, 4), {})
    assert "bwd_dq_kernel MC,RB not chosen by registers (RuntimeError: no ptxas here); taking (4, 4)" in caplog.text


_OFFLINE = """
import json, logging
from triton.backends.compiler import GPUTarget
from fibattn.ops import triton_occupancy as occ, triton_static as t
from fibattn.ops.triton_config import config
logging.basicConfig(level=logging.INFO)
k = t.static_kernels(4, 64, 12, 10, True, docs=True)
dq = k[1]
opts = {"num_warps": dq["num_warps"], "num_stages": dq["num_stages"]}
def res(mc, rb, extra):
    kern = occ.compile_kernel(dq["fn"], {**dq["constexprs"], "MC": mc, "RB": rb}, "bf16", 64, {**opts, **extra},
                              GPUTarget(*t.SM90))
    return occ.cubin_resources(kern.asm["cubin"])
variants = []
for mc, rb in config(4, 64, 12)["RUNGS"]:
    regs, stack = res(mc, rb, {})
    variants.append([mc, rb, 0, regs, stack])
    cap = occ.next_cap(regs, opts["num_warps"]) if not stack else None
    if cap is not None and not res(mc, rb, {"maxnreg": cap})[1]:
        variants.append([mc, rb, cap, *res(mc, rb, {"maxnreg": cap})])
print(json.dumps({"variants": variants, "warps": dq["num_warps"],
                  "chosen": [dq["constexprs"]["MC"], dq["constexprs"]["RB"], dq.get("maxnreg", 0)],
                  "bn": k[0]["constexprs"]["BLOCK_N"]}))
"""


def test_the_static_kernels_make_their_choices_from_compiled_registers():
    """The goal setting's two-tap query pass with documents: each candidate (and a capped variant where
    :func:`next_cap` gives one that does not spill) compiled for sm_90 as a launch would (Triton's own ptxas,
    outside the interpreter), its registers read back, and the choice is :func:`pick`'s on them — so a kernel change
    that moves registers moves the choice with it, and ``tools/gpu_static.py`` reports what a launch would take.
    Fails when the compile or the register read goes stale."""
    pytest.importorskip("triton")
    if not os.path.exists(occ.nvidia_tool("cuobjdump")):
        pytest.skip("this Triton ships no cuobjdump")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _OFFLINE], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "not chosen by registers" not in res.stderr
    assert "bwd_dq_kernel MC,RB=" in res.stderr and "fwd_kernel BLOCK_N,MC,RB=" in res.stderr      # logged
    got = json.loads(res.stdout.strip().splitlines()[-1])
    variants = got["variants"]
    assert all(40 <= v[3] <= 255 for v in variants), got
    assert got["chosen"] == variants[occ.pick([v[3] for v in variants], got["warps"], [v[4] for v in variants])][:3]
    assert got["bn"] in (32, 16)


def test_next_cap_keeps_one_more_program_only_a_few_registers_down():
    """A cap is offered only where it keeps one more program of 4 warps per SM (170 registers for 3, 128 for 4)
    within 1/8 of the registers the kernel holds, and never past the warps the model counts."""
    assert occ.next_cap(178, 4) == 168 and occ.next_cap(172, 4) == 168
    assert occ.next_cap(238, 4) is None              # 168 would be 30 % fewer: it spills
    assert occ.next_cap(144, 4) is None              # 3 programs (12 warps) already
    assert occ.next_cap(136, 8) == 128               # 8 warps a program: 1 -> 2 programs


def test_resources_without_cuobjdump_come_from_the_loaded_kernel(monkeypatch):
    """A Triton that ships no ``cuobjdump``: on a CUDA machine the kernel loaded on the device gives its registers
    and spills; with no device either, an error (which :func:`choose` turns into its warning and first pick)."""
    import torch

    class Loaded:
        n_regs, n_spills = 0, 0

        def _init_handles(self):
            self.n_regs, self.n_spills = 160, 8
    monkeypatch.setattr(occ, "nvidia_tool", lambda name: "/nonexistent/" + name)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert occ.resources(Loaded()) == (160, 8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(FileNotFoundError, match="no /nonexistent/cuobjdump and no CUDA device"):
        occ.resources(Loaded())


def test_a_failed_capped_compile_leaves_the_uncapped_choice(monkeypatch, caplog):
    """A Triton that takes no register cap: the capped variant's compile fails, the uncapped candidates decide
    (here the first, 172 registers against 180) and no warning says the choice fell back."""
    def compile_kernel(fn, consts, dtype, head_dim, options, target):
        if "maxnreg" in options:
            raise TypeError("unexpected option maxnreg")
        return {"RB": consts["RB"]}
    monkeypatch.setattr(occ, "compile_kernel", compile_kernel)
    monkeypatch.setattr(occ, "resources", lambda k: ({2: 172, 1: 180}[k["RB"]], 0))
    occ._choose.cache_clear()
    fn = triton_backend.kernels().bwd_dq_kernel
    with caplog.at_level(logging.INFO, logger="fibattn"):
        assert occ.choose(fn, "RB", (2, 1), {"TWO_TAP": True}, "bf16", 48, {"num_warps": 4}, target="t") == (2, {})
    assert "no variant capped at 168 registers" in caplog.text and "not chosen by registers" not in caplog.text
    occ._choose.cache_clear()


def test_a_capped_variant_that_does_not_spill_is_taken(monkeypatch):
    """The first candidate at 172 registers (2 programs of 4 warps per SM) compiles capped at 168 without spilling
    (3): that variant is taken, with its cap, over a smaller step at 150; capped with a spill it is not."""
    def compile_kernel(fn, consts, dtype, head_dim, options, target):
        return (consts["RB"], options.get("maxnreg"))
    fn = triton_backend.kernels().bwd_dq_kernel
    for spill, want in ((0, (2, {"maxnreg": 168})), (16, (1, {}))):
        table = {(2, None): (172, 0), (2, 168): (168, spill), (1, None): (150, 0)}
        monkeypatch.setattr(occ, "compile_kernel", compile_kernel)
        monkeypatch.setattr(occ, "resources", lambda k, table=table: table[k])
        occ._choose.cache_clear()
        assert occ.choose(fn, "RB", (2, 1), {"TWO_TAP": True}, "bf16", 48, {"num_warps": 4}, target="t") == want
        assert occ.choose(fn, "RB", (2, 1), {"TWO_TAP": False}, "bf16", 48, {"num_warps": 4}, target="t",
                          caps=False) == (1, {})
    occ._choose.cache_clear()


_WIDE_IR = """
from triton.backends.compiler import GPUTarget
from fibattn.ops import triton_occupancy as occ, triton_static as t
from fibattn.ops.triton_config import kernels
fn = kernels().flags_kernel
for wide in (False, True):
    consts = dict(BLOCK_R=64, BLOCK_D=64, WIDE=wide)
    sig = {a: "constexpr" if a in consts else {"K": "*bf16", "V": "*bf16", "FLAGS": "*i32"}.get(a, "i32")
           for a in fn.arg_names}
    print(occ.compile_source(fn, sig, consts, None, {"num_warps": 4}, GPUTarget(*t.SM90)).asm["ttir"].count("i64"))
"""


def test_wide_indexes_in_int64_and_only_then():
    """``WIDE`` (``triton_tiles._program``) as compiled, outside the interpreter: the program's batch, head and rows
    are extended to int64 and every offset from them is; without it the kernel holds no int64 value at all (the
    forced-WIDE tests against the reference cannot tell int32 from int64 on small tensors)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _WIDE_IR], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    narrow, wide = (int(x) for x in res.stdout.split())
    assert narrow == 0 and wide > 0
