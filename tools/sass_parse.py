"""SASS text (``cuobjdump -sass`` / ``nvdisasm``) as instructions and loops, for ``gpu_static.py``:
the functions in a listing, a function's body without its padding, the loops by their back-edge
branches (grouped by the source loop they come from), and an instruction mix.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

TENSOR_OPS = {"HMMA", "IMMA", "DMMA", "BMMA", "HGMMA", "IGMMA", "QGMMA", "BGMMA"}
MIX = ("FFMA", "FMUL", "FADD", "MUFU", "SHFL", "BAR", "LDG", "LDS", "STS", "LDSM", "STG", "LDL/STL", "MMA", "other")
_MIX_OF = {"LDGSTS": "LDG", "UTMALDG": "LDG", "LDL": "LDL/STL", "STL": "LDL/STL",
           **{op: "MMA" for op in TENSOR_OPS}, **{op: op for op in MIX}}


class LoopMismatch(RuntimeError):
    """The SASS's outermost loops do not match a kernel's ``loop_trips``."""


# ----------------------------------------------------------------------------- SASS parsing
@dataclass
class Instr:
    addr: int
    opcode: str                 # full opcode with modifiers, e.g. "HMMA.16816.F32.BF16"
    text: str
    target: int | None = None   # branch target address
    loc: str | None = None      # source location (nvdisasm -g / -gi), when present

    @property
    def base(self) -> str:
        return self.opcode.split(".", 1)[0]


@dataclass
class Loop:
    start: int
    end: int                    # address of the back-edge branch
    loc: str | None             # source location of the back-edge branch
    body: list[Instr] = field(default_factory=list)
    nested: int = 0             # loops inside this one (counted once per iteration)


_INSTR = re.compile(r"/\*([0-9a-fA-F]+)\*/\s+([^;]*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L\w*):")
_LOC = re.compile(r'^\s*//## File "([^"]*)", line (\d+)(.*)$')
_FUNC = re.compile(r"^\s*Function\s*:\s*(\S+)|^\.text\.(\S+):")
_TARGET = re.compile(r"(0x[0-9a-fA-F]+)|`\((\.L\w*)\)")


def _split_instr(text: str) -> tuple[str, str]:
    toks = text.split()
    if toks and toks[0].startswith("@"):
        toks = toks[1:]
    return (toks[0] if toks else ""), " ".join(toks[1:])


def parse_sass(text: str) -> dict[str, list[Instr]]:
    """Instructions per function of ``cuobjdump -sass`` or ``nvdisasm [-g|-gi]`` output.

    Branch targets are resolved to addresses (hex operands or ``.L`` labels); each
    instruction carries the source location annotated before it, if any. NOPs are kept
    here (see :func:`function_body`)."""
    funcs: dict[str, list[Instr]] = {}
    labels: dict[str, int] = {}
    pending_labels: list[str] = []
    name, cur, loc, fresh_loc = None, None, None, False
    unresolved: list[tuple[Instr, dict, str]] = []
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            name = m.group(1) or m.group(2)
            cur = funcs.setdefault(name, [])
            labels, pending_labels, loc = {}, [], None
            continue
        m = _LOC.match(line)
        if m:
            if not fresh_loc:       # -gi prints the full inlining chain first, then the outer frame
                loc = f"{m.group(1)}:{m.group(2)}{m.group(3)}"
                fresh_loc = True
            continue
        m = _LABEL.match(line)
        if m:
            pending_labels.append(m.group(1))
            continue
        m = _INSTR.search(line)
        if not m:
            continue
        if cur is None:
            name, cur = "", funcs.setdefault("", [])
        addr = int(m.group(1), 16)
        opcode, operands = _split_instr(m.group(2))
        ins = Instr(addr, opcode, m.group(2), loc=loc)
        fresh_loc = False
        for lab in pending_labels:
            labels[lab] = addr
        pending_labels = []
        if ins.base in ("BRA", "JMP", "BRX", "JMX"):
            t = _TARGET.search(operands)
            if t and t.group(1):
                ins.target = int(t.group(1), 16)
            elif t:
                unresolved.append((ins, labels, t.group(2)))     # this function's labels, resolved below
        cur.append(ins)
    for ins, labs, lab in unresolved:
        ins.target = labs.get(lab)
    return funcs


def function_body(instrs: list[Instr]) -> list[Instr]:
    """The executed part of a function: up to (not including) the terminal self-branch
    ``BRA`` to its own address, without NOPs."""
    out = []
    for ins in instrs:
        if ins.base == "BRA" and ins.target == ins.addr:
            break
        if ins.base != "NOP":
            out.append(ins)
    return out


def find_loops(body: list[Instr]) -> list[Loop]:
    """Outermost loops of a function body, in address order (see the module docstring)."""
    edges = sorted((ins.target, ins.addr, ins.loc) for ins in body
                   if ins.target is not None and ins.target <= ins.addr)
    outer: list[list] = []                              # [start, end, loc of the last back-edge, members]
    for start, end, loc in edges:
        if outer and start <= outer[-1][1]:             # nested in or overlapping the previous one
            if end >= outer[-1][1]:
                outer[-1][1], outer[-1][2] = end, loc
            outer[-1][3] += 1
        else:
            outer.append([start, end, loc, 1])
    loops = []
    for start, end, loc, members in outer:
        loops.append(Loop(start, end, loc, [i for i in body if start <= i.addr <= end], nested=members - 1))
    return loops


def source_loops(loops: list[Loop]) -> list[list[Loop]]:
    """Outermost machine loops grouped into source loops: adjacent loops whose back-edges
    carry the same (known) source location are one loop that ptxas split."""
    groups: list[list[Loop]] = []
    for loop in loops:
        if groups and loop.loc is not None and groups[-1][-1].loc == loop.loc:
            groups[-1].append(loop)
        else:
            groups.append([loop])
    return groups


def mix(instrs: list[Instr]) -> dict[str, int]:
    out = dict.fromkeys(MIX, 0)
    for ins in instrs:
        out[_MIX_OF.get(ins.base, "other")] += 1
    return {k: v for k, v in out.items() if v}
