"""Mutation check: does the test suite catch the one-line bugs that matter?

    python tools/mutations.py [--only NAME[,NAME...]] [--list] [--keep]

Each mutation below replaces one exact piece of source (it must occur exactly once, or the
mutation is reported *stale*: move it with the code) in a fresh copy of ``src/``, ``tests/``
and ``pyproject.toml``, then runs the tests that should notice. A mutation is *caught* when
those tests fail. The run prints each verdict, then ``caught N/M`` and the survivors, and
exits 1 unless every mutation is caught. Run on demand (minutes), not in CI.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    kind: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]         # pytest arguments: files, node ids, -k expressions


OPS = "src/fibattn/ops/"
C = OPS + "cpu_kernels.c"
TK = OPS + "triton_kernels.py"
DEFS = "tests/test_ops_definitions.py"

MUTATIONS = [
    # ---------------------------------------------------------------- the attended set (method.md §1, §3)
    Mutation("round-half-up", "distance rounding", "src/fibattn/schedules.py",
             "        d = round(alpha * b)\n", "        d = math.floor(alpha * b + 0.5)\n", (DEFS,)),
    Mutation("integer-cap+1", "cap", "src/fibattn/schedules.py",
             "        if window < d <= cap:\n", "        if window < d <= cap + 1:\n", (DEFS,)),
    Mutation("interpolated-cap+1", "cap", "src/fibattn/schedules.py",
             "lo > cap or lo <= window", "lo > cap + 1 or lo <= window", (DEFS,)),
    Mutation("rung-duplicates-kept", "cap", "src/fibattn/schedules.py",
             "or lo <= window or lo in seen:", "or lo <= window:", (DEFS,)),
    Mutation("triton-plan-rounds", "distance rounding", TK,
             "    lo = t.to(tl.int64)                      # t >= 0: truncation is floor\n",
             "    lo = (t + 0.5).to(tl.int64)\n", ("tests/test_ops_triton.py", "-k", "interpolated")),
    # ---------------------------------------------------------------- scale
    Mutation("default-scale", "scale", OPS + "__init__.py",
             "return 1.0 / math.sqrt(head_dim) if head_dim else 1.0", "return 1.0 / head_dim if head_dim else 1.0",
             (DEFS,)),
    Mutation("decode-scale", "scale", "src/fibattn/kvcache.py",
             "    scale = 1.0 / math.sqrt(Dh)\n", "    scale = 1.0 / Dh\n", ("tests/test_generate.py",)),
    # ---------------------------------------------------------------- grouped heads
    Mutation("c-dkdv-one-head", "GQA reduction", C,
             "for (i64 m = i0; m < i1; m++) SFX(zero)(dkb + m * D, D), SFX(zero)(dvb + m * D, D);\n"
             "                for (i64 gh = 0; gh < g; gh++) {",
             "for (i64 m = i0; m < i1; m++) SFX(zero)(dkb + m * D, D), SFX(zero)(dvb + m * D, D);\n"
             "                for (i64 gh = 0; gh < 1; gh++) {", ("tests/test_ops.py", "-k", "cpu")),
    Mutation("triton-dkdv-one-head", "GQA reduction", TK,
             "    gm_ok = (rq // BLOCK_M) < GROUP\n", "    gm_ok = (rq // BLOCK_M) < 1\n",
             ("tests/test_ops_triton.py", "-k", "integer_fp32")),
    # ---------------------------------------------------------------- kernel offsets and bounds
    Mutation("c-dot-vector-offset", "kernel offsets", C,
             "            const SFX(vec) xe = VLD(x + e);\n", "            const SFX(vec) xe = VLD(x);\n",
             ("tests/test_ops.py", "-k", "production")),
    Mutation("c-column-one-row-late", "kernel bounds", C,
             "while (nv < C && lo[nv] <= i) nv++;\n                        SFX(fwd_row)",
             "while (nv < C && lo[nv] < i) nv++;\n                        SFX(fwd_row)", ("tests/test_ops.py", "-k", "cpu")),
    Mutation("c-backward-drops-last-row", "kernel bounds", C,
             "        if (i >= T) break;\n", "        if (i >= T - 1) break;\n", ("tests/test_ops.py", "-k", "cpu")),
    Mutation("c-dfrac-sign", "kernel offsets", C,
             "(ws->d2[j + 1] - ws->d2[j])", "(ws->d2[j] - ws->d2[j + 1])",
             ("tests/test_ops.py", "-k", "interpolated and cpu")),
    Mutation("torch-clamped-row-dropped", "kernel bounds", OPS + "torch_backend.py",
             "            out[..., 0, :] += (pg[..., :c, j, None] * xg[..., :c, :]).sum((2, 3))\n",
             "            out[..., 0, :] += 0\n", ("tests/test_ops.py", "-k", "torch")),
    Mutation("torch-mix-weights-swapped", "kernel offsets", OPS + "torch_backend.py",
             "            mix[c, where[lo]] += cols.wlo[c]\n            mix[c, where[lo + 1]] += cols.whi[c]\n",
             "            mix[c, where[lo]] += cols.whi[c]\n            mix[c, where[lo + 1]] += cols.wlo[c]\n",
             ("tests/test_ops.py", "-k", "interpolated and torch")),
    Mutation("triton-last-row", "kernel bounds", TK,
             "    return b, hk, i0, m, hk * GROUP + g, (g < GROUP) & (i0 + m < T)\n",
             "    return b, hk, i0, m, hk * GROUP + g, (g < GROUP) & (i0 + m < T - 1)\n",
             ("tests/test_ops_triton.py", "-k", "integer_fp32")),
    Mutation("triton-clamped-tap-dropped", "kernel bounds", TK,
             "wlo + whi * (kr == 0).to(ACC)[:, None]", "wlo + 0.0 * (kr == 0).to(ACC)[:, None]",
             ("tests/test_ops_triton.py", "-k", "interpolated")),
    Mutation("triton-key-pass-extra-row", "kernel tiles", TK,
             "j0 + BLOCK_M + lo + 0 * xg", "j0 + BLOCK_M - 1 + lo + 0 * xg",
             ("tests/test_ops_triton.py", "-k", "interpolated or tile")),
    Mutation("triton-key-pass-band-edge", "kernel tiles", TK,
             "        ok = (d >= 0) & (d <= WB) & ok_i[None, :] & k_ok[:, None]\n",
             "        ok = (d >= 0) & (d < WB) & ok_i[None, :] & k_ok[:, None]\n",
             ("tests/test_ops_triton.py", "-k", "integer_fp32 or tile")),
    Mutation("triton-second-tap-weight", "kernel offsets", TK,
             "_dot_p(p * whi[None, :], v2, IN, DOT)", "_dot_p(p * wlo[None, :], v2, IN, DOT)",
             ("tests/test_ops_triton.py", "-k", "interpolated")),
    Mutation("triton-dfrac-value-term", "kernel offsets", TK,
             "ds * (s2 - s1) * sm_scale + p * (dp2 - dp1)", "ds * (s2 - s1) * sm_scale",
             ("tests/test_ops_triton.py", "-k", "interpolated or finite")),
    # ---------------------------------------------------------------- precision
    Mutation("no-fp32-upcast", "upcasting", OPS + "columns.py",
             "    return torch.float32 if dtype in _LOW_PRECISION else dtype\n", "    return dtype\n",
             ("tests/test_ops.py", "-k", "bf16")),
    # ---------------------------------------------------------------- the model and training
    Mutation("rope-frequency", "RoPE frequency", "src/fibattn/rope.py",
             "* 2 / head_dim)", "/ head_dim)", ("tests/test_attention_module.py", "-k", "rope")),
    Mutation("no-grad-clipping", "clipping", "src/fibattn/train.py",
             "clip_grad_norm_(self.params, clip)", "clip_grad_norm_(self.params, float(\"inf\"))",
             ("tests/test_train.py", "-k", "clip")),
    Mutation("dalpha-ignores-base", "kernel offsets", OPS + "columns.py",
             "return (dfrac.to(torch.float64) * b).sum()", "return (dfrac.to(torch.float64) * 1.0).sum()",
             ("tests/test_model.py", "-k", "learned")),
    Mutation("learned-alpha-straight-through", "alpha gradient", "src/fibattn/schedules.py",
             "        return self.a_min + (self.a_max - self.a_min) * torch.sigmoid(self.theta)\n",
             "        return self.a_min + (self.a_max - self.a_min) * "
             "((torch.sigmoid(self.theta) - self.theta).detach() + self.theta)\n",
             ("tests/test_schedules.py", "-k", "learned")),
    Mutation("hf-key-detached", "gradients", "src/fibattn/hf.py",
             "out = sparse_attention(query, key, value,", "out = sparse_attention(query, key.detach(), value,",
             ("tests/test_hf_dropin.py",)),
    Mutation("tracker-import-error-uncaught", "trackers", "src/fibattn/trainer/logs.py",
             "import SummaryWriter\n            except ImportError:",
             "import SummaryWriter\n            except AttributeError:", ("tests/test_trackers.py",)),
    Mutation("checkpoint-tmp-kept", "crash safety", "src/fibattn/checkpoint.py",
             "    if tmp.exists():\n        shutil.rmtree(tmp)", "    if False:\n        shutil.rmtree(tmp)",
             ("tests/test_reliability_faults.py", "-k", "kill9")),
    Mutation("loader-skips-on-resume", "loader resume", "src/fibattn/data/loader.py",
             "self.cursor = int(state[\"cursor\"]) if same",
             "self.cursor = int(state[\"cursor\"]) + self.world_size * self.micro_batch if same",
             ("tests/test_data_loader.py",)),
]


def _copy_tree(dest: Path) -> None:
    for name in ("src", "tests"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


def apply(m: Mutation, tree: Path) -> str | None:
    """Mutate ``tree`` in place; the reason it could not be done, or None."""
    path = tree / m.file
    text = path.read_text()
    n = text.count(m.old)
    if n != 1:
        return f"stale: the original text occurs {n} times in {m.file}"
    path.write_text(text.replace(m.old, m.new))
    return None


def check(m: Mutation, cache: Path, keep: bool) -> tuple[str, float, str]:
    """``(verdict, seconds, detail)`` with verdict caught | SURVIVED | stale."""
    tree = Path(tempfile.mkdtemp(prefix=f"fibattn-mut-{m.name}-"))
    try:
        _copy_tree(tree)
        why = apply(m, tree)
        if why:
            return "stale", 0.0, why
        env = dict(os.environ, PYTHONPATH=str(tree / "src"), FIBATTN_CACHE=str(cache), PYTHONDONTWRITEBYTECODE="1")
        t0 = time.monotonic()
        res = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *m.tests],
                             cwd=tree, env=env, capture_output=True, text=True)
        secs = time.monotonic() - t0
        tail = (res.stdout.strip().splitlines() or [""])[-1]
        if res.returncode == 0:
            return "SURVIVED", secs, tail
        if res.returncode in (1,):
            return "caught", secs, tail
        return "SURVIVED", secs, f"pytest exit {res.returncode} (not a test failure): {tail}"
    finally:
        if not keep:
            shutil.rmtree(tree, ignore_errors=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", help="comma-separated mutation names")
    p.add_argument("--list", action="store_true", help="list the mutations and exit")
    p.add_argument("--keep", action="store_true", help="keep each mutated copy (its path is printed)")
    args = p.parse_args(argv)
    chosen = MUTATIONS
    if args.only:
        names = {n.strip() for n in args.only.split(",") if n.strip()}
        unknown = names - {m.name for m in MUTATIONS}
        if unknown:
            print(f"--only: unknown mutation(s) {', '.join(sorted(unknown))}; see --list", file=sys.stderr)
            return 2
        chosen = [m for m in MUTATIONS if m.name in names]
    if args.list:
        for m in chosen:
            print(f"{m.name:<32} {m.kind:<18} {m.file}")
        return 0
    cache = Path(tempfile.gettempdir()) / "fibattn-mutation-kernels"
    survivors = []
    for m in chosen:
        verdict, secs, detail = check(m, cache, args.keep)
        print(f"{verdict:<9} {m.name:<32} {m.kind:<18} {secs:6.1f}s  {detail}", flush=True)
        if verdict != "caught":
            survivors.append(m.name)
    print(f"caught {len(chosen) - len(survivors)}/{len(chosen)}")
    if survivors:
        print("not caught: " + ", ".join(survivors))
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
