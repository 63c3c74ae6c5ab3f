"""Tile choices that the compiled code decides: registers, resident warps, and the step each kernel takes.

Some of a kernel's tile choices trade instructions for registers: two rungs a step cost fewer instructions
than one, but hold twice the float32 score blocks. Whether the extra registers cost resident warps — the
latency hiding a GPU lives on — depends on the kernel, its head size and group, the dtype, the Triton and
ptxas at hand, and no rule on the tile's sizes alone predicts it (issue 56: such a rule was right in 4 of 8
settings after one kernel change). So such a choice is made on the compiled code itself: each candidate is
compiled for the device's architecture, and the first (the largest step, the fewest instructions) is taken
unless its registers leave fewer warps resident than another candidate's, counted up to
:data:`TARGET_WARPS_PER_SM` (beyond which more warps gain nothing: ``tools/gpu_static.py``'s calibrated model),
or it spills where another does not (under a register cap, ``FIBATTN_TRITON_MAXNREG``). A candidate a few
registers over the count that would keep one more program per SM is also compiled capped there
(:func:`next_cap`), and the capped variant, if it does not spill, competes as the next candidate.

Used by ``triton_backend`` at a launch on CUDA (once per kernel and setting; the choice is logged) and by
``triton_static`` for ``tools/gpu_static.py`` (sm_90, offline: Triton's own ptxas, no device).
"""
from __future__ import annotations

import functools
import logging
import os
import subprocess
import tempfile

log = logging.getLogger("fibattn")

REGISTERS_PER_SM = 65536
MAX_PROGRAMS_PER_SM, MAX_WARPS_PER_SM = 32, 64        # Hopper's limits (and Ampere's)
WARP = 32
TARGET_WARPS_PER_SM = 12        # 3 per scheduler: the model's issue efficiency is flat from there (gpu_static)

_ACC_POINTERS = ("LSE", "DELTA", "PR", "DSR", "DFRAC")
_TENSOR_ARGS = {"Q", "K", "V", "OUT", "DO", "DQ", "DK", "DV"}
_FIXED_POINTERS = {"RLO": "*i32", "RN": "*i32", "OFF": "*i32", "FLAGS": "*i32", "RWLO": "*fp64", "RWHI": "*fp64",
                   "RBASE": "*fp64", "ALPHA": "*fp32", "BASE": "*fp64"}
_SCALES = ("qk_scale", "sm_scale", "qk_lo", "sm_lo")


def resident_warps(registers: int, num_warps: int) -> int:
    """Warps an SM holds of a kernel at ``registers`` per thread (allocated in units of 8): as many programs as
    the register file allows, at least one (shared memory, which these kernels use little of, aside)."""
    regs = -(-max(registers, 1) // 8) * 8
    programs = min(REGISTERS_PER_SM // (regs * WARP * num_warps), MAX_PROGRAMS_PER_SM,
                   MAX_WARPS_PER_SM // num_warps)
    return max(programs, 1) * num_warps


def pick(registers: list[int], num_warps: int, stack: list[int] | None = None) -> int:
    """Index of the candidate to take, the candidates in order of preference (fewest instructions first): the
    first whose resident warps, counted up to :data:`TARGET_WARPS_PER_SM`, are the most any candidate keeps —
    among those that do not spill (``stack`` bytes, under a register cap), if any does not."""
    score = [(min(resident_warps(r, num_warps), TARGET_WARPS_PER_SM), not (stack and stack[i]))
             for i, r in enumerate(registers)]
    score = [(spill_free, warps) if any(ok for _, ok in score) else (True, warps) for warps, spill_free in score]
    return score.index(max(score))


def signature(fn, constexprs: dict, dtype: str, head_dim: int) -> tuple[dict, dict]:
    """``(signature, attrs)`` of a compile of kernel ``fn`` as a launch gives it: ``dtype`` (``bf16``, ``fp16``,
    ``fp32``, ``fp64``) the inputs', statistics in the accumulation dtype, 16-byte aligned pointers and, when
    ``head_dim`` is a multiple of 16, strides and ``DH`` divisible by 16 (``T`` is never specialized)."""
    acc = "fp64" if dtype == "fp64" else "fp32"

    def kind(a: str) -> str:
        if a in constexprs:
            return "constexpr"
        if a in _TENSOR_ARGS:
            return f"*{dtype}"
        if a in _ACC_POINTERS:
            return f"*{acc}"
        return _FIXED_POINTERS.get(a, "fp32" if a in _SCALES else "i32")
    sig = {a: kind(a) for a in fn.arg_names}
    attrs = {(n,): [["tt.divisibility", 16]] for n, a in enumerate(fn.arg_names)
             if sig[a].startswith("*") or (sig[a] == "i32" and (a[0] == "s" or a == "DH") and head_dim % 16 == 0)}
    return sig, attrs


def compile_kernel(fn, constexprs: dict, dtype: str, head_dim: int, options: dict, target):
    """``fn`` compiled by Triton for ``target`` (a ``GPUTarget``) without a launch, with the signature a launch
    gives it (:func:`signature`): a ``CompiledKernel``."""
    sig, attrs = signature(fn, constexprs, dtype, head_dim)
    return compile_source(fn, sig, constexprs, attrs, options, target)


def compile_source(fn, sig: dict, constexprs: dict, attrs: dict | None, options: dict, target):
    """``triton.compile`` of ``fn`` with this signature, for ``target``: the one place fibattn compiles without a
    launch (here and ``tools/gpu_static.py``)."""
    import triton
    from triton.compiler import ASTSource
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs), target=target,
                          options=options)


def nvidia_tool(name: str) -> str:
    """A tool Triton's NVIDIA backend ships (``ptxas``, ``cuobjdump``, ``nvdisasm``)."""
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def resources(kernel) -> tuple[int, int]:
    """``(registers per thread, stack bytes)`` of a compiled kernel: read from its cubin by ``cuobjdump``, or, where
    this Triton ships none, from the kernel loaded on the current CUDA device."""
    if os.path.exists(nvidia_tool("cuobjdump")):
        return cubin_resources(kernel.asm["cubin"])
    import torch
    if not torch.cuda.is_available():
        raise FileNotFoundError(f"no {nvidia_tool('cuobjdump')} and no CUDA device to load the kernel on")
    kernel._init_handles()
    return int(kernel.n_regs), int(kernel.n_spills)


def cubin_resources(cubin: bytes) -> tuple[int, int]:
    """``(registers per thread, stack bytes)`` of a one-kernel cubin (``cuobjdump -res-usage``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        res = subprocess.run([nvidia_tool("cuobjdump"), "-res-usage", fh.name], capture_output=True, text=True,
                             check=True)
    fields = dict(tok.split(":", 1) for tok in res.stdout.split() if tok.startswith(("REG:", "STACK:")))
    return int(fields["REG"]), int(fields["STACK"])


def choose(fn, key, candidates: tuple, constexprs: dict, dtype: str, head_dim: int, options: dict, target,
           caps: bool = True) -> tuple:
    """``(value, options)``: the value of constexpr ``key`` to launch ``fn`` with, of ``candidates`` (preference
    order; see the module docstring), the other constexprs ``constexprs``, and the launch options it takes beyond
    ``options`` (``{"maxnreg": N}`` for a capped variant: :func:`next_cap`; ``caps`` False: none tried). ``key`` a
    tuple of names: each candidate a tuple of their values. One candidate, or no ``target`` (the interpreter, a
    trace without a device): the first, nothing compiled."""
    if len(candidates) == 1 or target is None:
        return candidates[0], {}
    frozen = tuple(sorted(constexprs.items(), key=lambda kv: kv[0]))
    return _choose(fn, key, tuple(candidates), frozen, dtype, head_dim, tuple(sorted(options.items())), target,
                   caps and "maxnreg" not in options)


def next_cap(registers: int, num_warps: int) -> int | None:
    """The register cap at which a kernel of ``registers`` per thread keeps one more program per SM, if that is
    within 1/8 of what it holds (ptxas often takes a few registers more than a kernel needs; a cap further down
    spills): or None."""
    programs = resident_warps(registers, num_warps) // num_warps
    cap = REGISTERS_PER_SM // ((programs + 1) * WARP * num_warps) // 8 * 8
    fits = resident_warps(cap, num_warps) // num_warps > programs and cap * 9 >= registers * 8
    return cap if fits and resident_warps(registers, num_warps) < TARGET_WARPS_PER_SM else None


@functools.lru_cache(maxsize=64)
def _choose(fn, key, candidates, frozen, dtype, head_dim, options, target, caps):
    opts = dict(options)
    names = key if isinstance(key, tuple) else (key,)
    name = ",".join(names)

    def compiled(c, extra):
        consts = {**dict(frozen), **dict(zip(names, c if isinstance(key, tuple) else (c,)))}
        return resources(compile_kernel(fn, consts, dtype, head_dim, {**opts, **extra}, target))
    try:
        variants = []                  # (candidate, extra options, registers, stack), in order of preference
        for c in candidates:
            regs, stack = compiled(c, {})
            variants.append((c, {}, regs, stack))
            cap = next_cap(regs, opts["num_warps"]) if caps and not stack else None
            capped = _capped(compiled, c, cap) if cap is not None else None
            if capped is not None and not capped[1]:      # a capped variant only where it does not spill
                variants.append((c, {"maxnreg": cap}, *capped))
    except Exception as exc:           # a tool or compile failing must not stop the op: take the first
        log.warning("fibattn: %s %s not chosen by registers (%s: %s); taking %s", fn.__name__, name,
                    type(exc).__name__, exc, candidates[0])
        return candidates[0], {}
    regs, stack = [v[2] for v in variants], [v[3] for v in variants]
    chosen, extra = variants[pick(regs, opts["num_warps"], stack)][:2]
    log.info("fibattn: %s %s=%s%s of %s (registers %s, stack bytes %s, %d warps a program, %s)", fn.__name__, name,
             chosen, f" maxnreg={extra['maxnreg']}" if extra else "",
             [v[0] if not v[1] else f"{v[0]} maxnreg={v[1]['maxnreg']}" for v in variants], regs, stack,
             opts["num_warps"], dtype)
    return chosen, extra


def _capped(compiled, candidate, cap: int):
    """``compiled(candidate, {"maxnreg": cap})``, or None where that compile fails (a Triton that takes no register
    cap): the uncapped candidates still decide."""
    try:
        return compiled(candidate, {"maxnreg": cap})
    except Exception as exc:
        log.info("fibattn: no variant capped at %d registers (%s: %s)", cap, type(exc).__name__, exc)
        return None


@functools.lru_cache(maxsize=8)
def device_target(index: int):
    """The ``GPUTarget`` of CUDA device ``index``."""
    import torch
    from triton.backends.compiler import GPUTarget
    major, minor = torch.cuda.get_device_capability(index)
    return GPUTarget("cuda", major * 10 + minor, WARP)
