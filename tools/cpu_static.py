"""What the ``cpu`` backend's kernels execute on CPUs other than this one, read from their compiled code
(issue 29; the CPU counterpart of ``tools/gpu_static.py``).

    python tools/cpu_static.py [--targets native,x86-64-v3,skylake-avx512] [--cflags=-DX=1] [--json FILE] [--goals]

The float half of ``cpu_kernels.c`` is compiled with the backend's own flags, ``-march=TARGET`` in
place of ``native`` (gcc builds for any x86-64 target on any x86-64 machine), and read back with
``objdump``; ``native`` without ``--cflags`` reads the backend's own library, built that same way. In
each fused kernel (the forward, the backward's two passes) the tool takes the straight-line runs of
code (between branches and branch targets) that hold at least 8 vector FMAs: the unrolled dots and
weighted sums of the vector rows, one run per head size and call site. Over them it counts FMAs,
instructions per FMA and stack references per FMA (``(%rsp)`` / ``(%rbp)`` operands: registers spilled
and reloaded). A run of at most 12 x lanes FMAs is one of head sizes up to 12 vectors (Dh 192 in fp32
with AVX-512, 96 with AVX2); larger heads spill whatever the order. Every run counts once, hot or cold:
on the 2-core AVX2 machine the runs that spill are ones a profile finds no samples in (``perf
annotate`` of pass 1 at 4K: its two hot runs, 39 % and 34 % of its samples, make 2 stack references
between them), so weigh the figures with a profile where the machine itself is at hand.

``--goals``: on the AVX-512 targets, the runs of head sizes up to 12 vectors make at most 0.05 stack
references per FMA. Each of their dots has 16 lanes; taken vector by vector, its 16 row pointers
filled x86-64's 16 general registers and were reloaded from the stack (0.46 and 0.65 stack references
per FMA in the forward and pass 1 of skylake-avx512, before); taken a lane
at a time (``cpu_kernels.c``'s ``FA_LANE_NV``), one pointer is live.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src" / "fibattn" / "ops" / "cpu_kernels.c"
KERNELS = {"forward": "fa_attn_fwd_f32._omp_fn.0", "backward pass 1": "bwd_pass1_f32",
           "backward pass 2": "bwd_pass2_f32"}
AVX512 = ("skylake-avx512", "icelake-server", "sapphirerapids", "x86-64-v4")
MIN_FMAS, MAX_VECTORS, GOAL_STACK = 8, 12, 0.05
_LINE = re.compile(r"^\s*([0-9a-f]+):\t(.*)$")
_FUNC = re.compile(r"^[0-9a-f]+ <(.+)>:$")
_TARGET = re.compile(r"^j\w*\s+([0-9a-f]+)\b")


def compile_object(target: str, out: Path, extra: tuple[str, ...] = ()) -> Path:
    """The float half of the kernels as the backend builds them, for ``-march=target`` (and ``extra`` flags)."""
    sys.path.insert(0, str(ROOT / "src"))
    from fibattn.ops.cpu_backend import _CFLAGS
    flags = [f"-march={target}" if f.startswith("-march=") else f for f in _CFLAGS]
    subprocess.run(["gcc", *flags, *extra, "-DFA_PART=1", "-c", "-o", str(out), str(SOURCE)], check=True,
                   capture_output=True, text=True)
    return out


def functions(disassembly: str) -> dict[str, list[tuple[int, str]]]:
    """``objdump -d --no-show-raw-insn`` text -> each function's (address, instruction) list."""
    out: dict[str, list[tuple[int, str]]] = {}
    name = None
    for line in disassembly.splitlines():
        if m := _FUNC.match(line):
            name = m.group(1)
            out[name] = []
        elif name and (m := _LINE.match(line)):
            out[name].append((int(m.group(1), 16), m.group(2).strip()))
    return out


def runs(code: list[tuple[int, str]]) -> list[list[str]]:
    """Straight-line runs: split after every branch and before every branch target."""
    targets = {int(m.group(1), 16) for _, ins in code if (m := _TARGET.match(ins))}
    out, cur = [], []
    for addr, ins in code:
        if addr in targets and cur:
            out.append(cur)
            cur = []
        cur.append(ins)
        if ins.startswith(("j", "ret")):
            out.append(cur)
            cur = []
    return out + ([cur] if cur else [])


def _fmas(run: list[str]) -> int:
    return sum(ins.startswith("vfmadd") for ins in run)


def summarize(code: list[tuple[int, str]], max_fmas: int, min_fmas: int = MIN_FMAS) -> dict:
    """FMA-dense runs (at least ``min_fmas``) of one function: all of them, and those of at most ``max_fmas``."""
    dense = [r for r in runs(code) if _fmas(r) >= min_fmas]
    out = {}
    for key, sel in (("all", dense), ("small_heads", [r for r in dense if _fmas(r) <= max_fmas])):
        fmas = sum(map(_fmas, sel))
        stack = sum(("(%rsp" in i or "(%rbp" in i) for r in sel for i in r)     # memory operands on the stack
        out[key] = {"runs": len(sel), "fmas": fmas,
                    "instructions_per_fma": round(sum(map(len, sel)) / fmas, 3) if fmas else None,
                    "stack_per_fma": round(stack / fmas, 3) if fmas else None}
    return out


def lanes(target: str) -> int:
    return 16 if target in AVX512 else 8


def native_library() -> Path | None:
    """The backend's own library for this machine (``-march=native``, both halves), built if missing:
    the code that runs here, without a second 15 s compile of it."""
    sys.path.insert(0, str(ROOT / "src"))
    from fibattn.ops import cpu_backend
    path = cpu_backend.library_file()
    # only a library built from this checkout's source (an installed fibattn may be another version)
    return path if path is not None and cpu_backend._SOURCE.resolve() == SOURCE.resolve() else None


def analyse(target: str, workdir: Path, extra: tuple[str, ...] = ()) -> dict:
    obj = native_library() if target == "native" and not extra else None
    obj = obj or compile_object(target, workdir / f"kernels_{target}.o", extra)
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(obj)], check=True,
                          capture_output=True, text=True).stdout
    funcs = functions(text)
    missing = [f for f in KERNELS.values() if f not in funcs]
    if missing:
        raise SystemExit(f"cpu_static: {', '.join(missing)} not in the {target} build (renamed? update KERNELS)")
    return {name: summarize(funcs[f], MAX_VECTORS * lanes(target)) for name, f in KERNELS.items()}


def goals(results: dict) -> list[tuple[str, bool, str]]:
    out = []
    for target, kernels in results.items():
        if target not in AVX512:
            continue
        for name, s in kernels.items():
            v = s["small_heads"]["stack_per_fma"]
            if v is not None:
                out.append((f"{target} {name}: stack references per FMA, heads up to {MAX_VECTORS} vectors",
                            v <= GOAL_STACK, f"{v:.3f} (goal <= {GOAL_STACK})"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", default="native,x86-64-v3,skylake-avx512,sapphirerapids")
    ap.add_argument("--cflags", default="", help="more compiler flags, e.g. --cflags=-DFA_VREGS=4 (every dot "
                    "vector by vector, the order before)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--goals", action="store_true", help="check the AVX-512 goal; exit 1 if it fails")
    args = ap.parse_args(argv)
    for tool in ("gcc", "objdump"):
        if shutil.which(tool) is None:
            print(f"cpu_static: {tool} is not on PATH", file=sys.stderr)
            return 2
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for target in filter(None, args.targets.split(",")):
            results[target] = analyse(target, Path(tmp), tuple(args.cflags.split()))
    for target, kernels in results.items():
        for name, s in kernels.items():
            a, h = s["all"], s["small_heads"]
            print(f"{target:16s} {name:16s} FMA runs {a['runs']:3d}  FMAs {a['fmas']:5d}  "
                  f"instr/FMA {a['instructions_per_fma']}  stack/FMA {a['stack_per_fma']}  "
                  f"(heads <= {MAX_VECTORS} vectors: instr/FMA {h['instructions_per_fma']}, "
                  f"stack/FMA {h['stack_per_fma']})")
    checks = goals(results) if args.goals else []
    for what, ok, value in checks:
        print(f"{'PASS' if ok else 'FAIL'}  {what}: {value}")
    if args.json:
        Path(args.json).write_text(json.dumps({"targets": results, "goals": [
            {"what": w, "ok": ok, "value": v} for w, ok, v in checks]}, indent=1))
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
