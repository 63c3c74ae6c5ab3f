"""The mutations that ``tools/mutations.py`` runs: each names one exact piece of source (it must occur
exactly once, or the entry is *stale*: move it with the code), its one-line replacement, and the
tests that should notice it. Grouped by the file they mutate."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path


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
TRITON = "tests/test_ops_triton.py"
BAND = (TRITON, "-k", "band_wider")
PPL = "src/fibattn/eval/perplexity.py"
HEADLINE = "src/fibattn/study/headline.py"
RETRO = "src/fibattn/study/retrofit_report.py"
RECIPE = "src/fibattn/trainer/init_recipe.py"
TRAINER = "src/fibattn/trainer/trainer.py"
NAMES = "src/fibattn/model/llama_names.py"
INIT_SOURCE = "src/fibattn/storage/init_source.py"
EDGES = "tests/test_eval_edges.py"
EQUIV = "tests/test_equivalences.py"
THRESH = "tests/test_check_thresholds.py"
LLAMA = "tests/test_llama_independent.py"
DOCS = "tests/test_documents.py"
CP = "src/fibattn/parallel/context.py"
HALO = "src/fibattn/parallel/halo.py"
CP_PLAN = "tests/test_context_parallel_plan.py"
DURABLE = "tests/test_durability.py"
RANKS = "tests/test_resume_ranks.py"
LM_EVAL = "src/fibattn/interop/lm_eval_adapter.py"
LM_EVAL_T = "tests/test_lm_eval_adapter.py"
RUN_FOLDER = "src/fibattn/eval/run_folder.py"
EVAL_T = "tests/test_evaluate.py"
FAST = "tests/test_fast_variants.py"
ROPS = "tests/test_reliability_ops.py"

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
    Mutation("decode-scale", "scale", "src/fibattn/generation/kvcache.py",
             "    scale = 1.0 / math.sqrt(Dh)\n", "    scale = 1.0 / Dh\n", ("tests/test_generate.py",)),
    # ---------------------------------------------------------------- grouped heads
    Mutation("c-dkdv-one-head", "GQA reduction", C,
             "    for (i64 gh = 0; gh < g; gh++) {\n"
             "        const i64 h = (bh / Hk) * a->H + (bh % Hk) * g + gh;\n"
             "        const i64 o = h * T * D, oc = h * T * C, op = h * a->PH;\n"
             "        const REAL *qh = a->q + o, *gh_ = a->dout + o, *ph = a->P + op, *dsh",
             "    for (i64 gh = 0; gh < 1; gh++) {\n"
             "        const i64 h = (bh / Hk) * a->H + (bh % Hk) * g + gh;\n"
             "        const i64 o = h * T * D, oc = h * T * C, op = h * a->PH;\n"
             "        const REAL *qh = a->q + o, *gh_ = a->dout + o, *ph = a->P + op, *dsh",
             ("tests/test_ops.py", "-k", "cpu")),
    Mutation("triton-dkdv-one-head", "GQA reduction", TK,
             "    gm_ok = (rq // BLOCK_M) < GROUP\n", "    gm_ok = (rq // BLOCK_M) < 1\n",
             ("tests/test_ops_triton.py", "-k", "integer_fp32")),
    # ---------------------------------------------------------------- kernel offsets and bounds
    Mutation("c-dot-vector-offset", "kernel offsets", C,
             "        const SFX(vec) xc = VLD(x + c * FA_VL);\n", "        const SFX(vec) xc = VLD(x);\n",
             ("tests/test_ops.py", "-k", "production")),
    Mutation("c-block-drops-last-row", "kernel bounds", C,
             "while (n && m + a->L->toff[n - 1] >= end) n--;", "while (n && m + a->L->toff[n - 1] >= end - 1) n--;",
             ("tests/test_ops.py", "-k", "production")),
    Mutation("c-lanes-one-column-too-many", "kernel bounds", C,
             "return VLD(L->idx + g * FA_VL) < fnv; }", "return VLD(L->idx + g * FA_VL) <= fnv; }",
             ("tests/test_ops_cpu_tiled.py",)),
    Mutation("c-lanes-second-tap-weight", "kernel offsets", C,
             "VLD(L->wlo + g * FA_VL) * d[g] + VLD(L->whi + g * FA_VL) * SFX(dhi)(d, L, g)",
             "VLD(L->wlo + g * FA_VL) * d[g] + VLD(L->wlo + g * FA_VL) * SFX(dhi)(d, L, g)",
             ("tests/test_ops_cpu_tiled.py",)),
    Mutation("c-lanes-dfrac-sign", "kernel offsets", C,
             "p[g] * (SFX(dhi)(d, L, g) - d[g])", "p[g] * (d[g] - SFX(dhi)(d, L, g))",
             ("tests/test_ops_cpu_tiled.py",)),
    Mutation("c-lanes-slope-sign", "kernel offsets", C,
             "SFX(dhi)(s, L, g) - s[g], (SFX(vec)){0})", "s[g] - SFX(dhi)(s, L, g), (SFX(vec)){0})",
             ("tests/test_ops_cpu_tiled.py",)),
    Mutation("c-lanes-last-group-lane-dropped", "kernel bounds", C,
             "for (int l = 0; l < n; l++) {       /*", "for (int l = 0; l + 1 < n; l++) {       /*",
             ("tests/test_ops_cpu_tiled.py", "-k", "two_tap")),
    Mutation("c-lanes-second-taps-apart-taken", "kernel offsets", C,
             "if (c0 >= 0 && !two[c - 1]) return;", "if (0) return;", ("tests/test_ops_cpu_tiled.py", "-k", "two_tap")),
    Mutation("c-lanes-second-tap-lane-off-by-one", "kernel offsets", C,
             "L->hsh = c0 < 0 ? 0 : C1 - c0;", "L->hsh = c0 < 0 ? 0 : C1 - c0 + 1;",
             ("tests/test_ops_cpu_tiled.py", "-k", "two_tap")),
    Mutation("c-sums-skip-weighted-second-taps", "kernel offsets", C,
             "if (hi && tp->w[t] == 0) continue;", "if (hi && tp->w[t] != 0) continue;",
             ("tests/test_ops_cpu_tiled.py", "-k", "two_tap or whole_distances")),
    Mutation("c-dots-reach-from-sums-taps", "kernel offsets", C,
             "L->maxoff = tp->off[tp->end[C1 - 1] - 1]", "L->maxoff = L->toff[n - 1]",
             ("tests/test_ops_cpu_tiled.py", "-k", "two_tap or whole_distances")),
    Mutation("c-ktile-readers-by-all-taps", "kernel offsets", C,
             "while (n && m + a->L->toff[n - 1] >= end) n--;", "while (n && m + tp->off[n - 1] >= end) n--;",
             ("tests/test_ops_cpu_tiled.py", "-k", "two_tap or whole_distances")),
    Mutation("c-rows-slope-sign", "kernel offsets", C,
             "gi[tp->col[t]] = ws->d[t + 1] - ws->d[t]", "gi[tp->col[t]] = ws->d[t] - ws->d[t + 1]",
             ("tests/test_ops_cpu_tiled.py", "-k", "slopes")),
    Mutation("pool-hands-out-a-held-region", "memory reuse", "src/fibattn/ops/host_pages.py",
             "region = self.free.pop(found) if found is not None else None",
             "region = self.free[found] if found is not None else None", ("tests/test_host_pages.py",)),
    Mutation("pool-reuses-live-memory", "memory reuse", "src/fibattn/ops/host_pages.py",
             "ref = weakref.ref(view, region.returned)", "ref = weakref.ref(view, region.returned); _pool.give(region)",
             ("tests/test_host_pages.py",)),
    Mutation("pool-maps-shared-memory", "memory reuse", "src/fibattn/ops/host_pages.py",
             "flags=_PRIVATE)", "flags=mmap.MAP_SHARED)", ("tests/test_host_pages.py",)),
    Mutation("pool-lock-kept-across-fork", "memory reuse", "src/fibattn/ops/host_pages.py",
             "os.register_at_fork(after_in_child=_pool.after_fork)", "pass", ("tests/test_host_pages.py",)),
    Mutation("c-bwd-lag-one-block-short", "kernel bounds", C,
             "lag = (FA_BLOCK - 1 + maxoff) / FA_BLOCK;", "lag = maxoff / FA_BLOCK;",
             ("tests/test_ops_cpu_tiled.py", "-k", "schedules")),
    Mutation("c-delta-drops-last-group", "kernel bounds", C,
             "for (int g = 0; g < ng; g++) pdp += p[g] * ds[g];",
             "for (int g = 0; g + 1 < ng; g++) pdp += p[g] * ds[g];",
             ("tests/test_ops_cpu_tiled.py",)),
    Mutation("c-head-size-96-left-generic", "kernel bounds", C,
             "    case 12: { const int NV = 12; __VA_ARGS__; } break;", "",
             ("tests/test_ops_cpu_tiled.py", "-k", "head_sizes")),
    Mutation("c-tapsums-last-tap-dropped", "kernel bounds", C,
             "    for (i64 t = 0; t < nt; t++) {  ", "    for (i64 t = 0; t + 1 < nt; t++) {",
             ("tests/test_ops_cpu_tiled.py",)),
    Mutation("c-streamed-row-one-vector", "kernel offsets", C,
             "for (int c = 0; c < nc; c++) VSTNT(y + (c0 + c) * FA_VL, a[c]);",
             "for (int c = 0; c < nc; c++) VSTNT(y + c0 * FA_VL, a[c]);",
             ("tests/test_ops_cpu_tiled.py", "-k", "stream")),
    Mutation("c-dkdv-every-head-starts-over", "GQA reduction", C,
             "a->L, i0, i1, nm, C, gh == 0,", "a->L, i0, i1, nm, C, 1,",
             ("tests/test_ops_cpu_tiled.py", "-k", "stream")),
    Mutation("c-dkdv-clamped-rows-not-zeroed", "kernel bounds", C,
             "if (!a->nvx || nm[m - i0] < 0) SFX(zero)", "if (!a->nvx) SFX(zero)",
             ("tests/test_ops_cpu_tiled.py", "-k", "stream")),
    Mutation("eager-no-grad-saves-state", "saved state", OPS + "eager.py",
             "return kern.forward(q, k, v, spec, alpha, scale, save=False)[0]",
             "return kern.forward(q, k, v, spec, alpha, scale)[0]", ("tests/test_ops_cpu_tiled.py", "-k", "without")),
    Mutation("compiled-no-grad-saves-state", "saved state", OPS + "custom_ops.py",
             "forward(q, k, v, _spec(dists), None, scale, save=False, **docs(off))[0]",
             "forward(q, k, v, _spec(dists), None, scale, **docs(off))[0]", ("tests/test_compile.py", "-k", "without")),
    Mutation("needs-state-ignores-grad-mode", "saved state", OPS + "custom_ops.py",
             "return torch.is_grad_enabled() and any(", "return any(", ("tests/test_compile.py", "-k", "without")),
    Mutation("c-rows-forward-stores-no-state", "saved state", C,
             "for (i64 c = 0; pi && c < nv; c++) pi[c] = s[c];", "for (i64 c = 0; 0 && c < nv; c++) pi[c] = s[c];",
             ("tests/test_ops_cpu_tiled.py",)),
    Mutation("c-tapsums-clamp-checks-first-tap", "document bounds", C,
             "const int clamp = lims && nt > 0 && -xo[nt - 1] > lim;",
             "const int clamp = lims && nt > 0 && -xo[0] > lim;",
             ("tests/test_ops_documents_cpu.py",)),
    Mutation("c-vblock-dots-one-row", "kernel offsets", C,
             "d[g] = SFX(dotv_n)(x + m * D, base + m * D, ln + g * FA_VL,",
             "d[g] = SFX(dotv_n)(x + i0 * D, base + m * D, ln + g * FA_VL,",
             ("tests/test_ops_cpu_tiled.py", "-k", "streamed")),
    Mutation("c-vblock-clamps-too-few-rows", "kernel bounds", C,
             "if (lims && lims[m - i0] < L->maxoff)\n", "if (lims && lims[m - i0] < L->maxoff - 8)\n",
             ("tests/test_ops_cpu_tiled.py", "-k", "streamed")),
    Mutation("c-vblock-drops-dfrac", "kernel offsets", C,
             "dsh, dqh, part, pb, a->L, ws->blk,", "dsh, dqh, NULL, pb, a->L, ws->blk,",
             ("tests/test_ops_cpu_tiled.py",)),
    Mutation("c-avx512-tree-lanes-swapped", "vector width", C,       # the 16-lane add tree (AVX-512 fp32)
             "#define FA_REV {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15}",
             "#define FA_REV {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 15, 7}",
             ("tests/test_cpu_vector_width.py",)),
    Mutation("c-avx512-max-half-lanes", "vector width", C,          # a 16-lane row max over 8 of its lanes
             "    a = FA_MAX(a, __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));"
             "\n", "", ("tests/test_cpu_vector_width.py",)),
    Mutation("c-lane-dots-drop-last-vector", "vector width", C,     # the dots a lane at a time
             "            for (int c = 0; c < NV; c++) s += xs[c] * rj[c];",
             "            for (int c = 0; c < NV - 1; c++) s += xs[c] * rj[c];", ("tests/test_cpu_vector_width.py",)),
    Mutation("c-avx512-dots-vector-by-vector", "vector width", C,   # the order whose row pointers spill
             "#define FA_LANE_NV (FA_VREGS - 4 - FA_VL)", "#define FA_LANE_NV 0", ("tests/test_cpu_static.py",)),
    Mutation("c-key-pass-never-waits", "work split", C,       # pass 2 before the pass 1 of its readers
             "        if (!__atomic_load_n(done + w, __ATOMIC_ACQUIRE)) return 0;",
             "        if (!__atomic_load_n(done + w, __ATOMIC_ACQUIRE)) return 1;", ("tests/test_cpu_balance.py",)),
    Mutation("c-columns-never-restart", "kernel bounds", C,
             "    if (nv && lo[nv - 1] > lim) nv = 0;\n", "    if (0 && nv && lo[nv - 1] > lim) nv = 0;\n",
             ("tests/test_ops_documents_cpu.py",)),
    Mutation("c-backward-drops-last-row", "kernel bounds", C,
             "        if (i >= end) break;\n", "        if (i >= end - 1) break;\n", ("tests/test_ops.py", "-k", "cpu")),
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
    # (the kernel's own store mask, `own`, is not mutated: a program writing its last row too races with the next
    # program on a GPU, and the interpreter, running programs in order, always lets the right one win)
    Mutation("triton-key-pass-owns-its-last-row", "kernel tiles", OPS + "triton_backend.py",
             "return block_m - 1 if two_tap else block_m", "return block_m",
             ("tests/test_ops_triton.py", "-k", "interpolated or tile")),
    Mutation("triton-key-pass-band-edge", "kernel tiles", TK,
             "        ok = (d >= 0) & (d <= WB) & ok_i[None, :] & k_ok[:, None]\n",
             "        ok = (d >= 0) & (d < WB) & ok_i[None, :] & k_ok[:, None]\n",
             ("tests/test_ops_triton.py", "-k", "integer_fp32 or tile")),
    Mutation("triton-second-tap-weight", "kernel offsets", TK,
             "p * whi[None, :], v2, IN, DOT)", "p * wlo[None, :], v2, IN, DOT)",
             ("tests/test_ops_triton.py", "-k", "interpolated")),
    Mutation("triton-dfrac-value-term", "kernel offsets", TK,
             "ds * sd * sm_scale + p * dpd", "ds * sd * sm_scale",
             ("tests/test_ops_triton.py", "-k", "interpolated or finite")),
    # ---------------------------------------------------------------- precision
    Mutation("no-fp32-upcast", "upcasting", OPS + "columns.py",
             "    return torch.float32 if dtype in _LOW_PRECISION else dtype\n", "    return dtype\n",
             ("tests/test_ops.py", "-k", "bf16")),
    # ---------------------------------------------------------------- the model and training
    Mutation("rope-frequency", "RoPE frequency", "src/fibattn/model/rope.py",
             "* 2 / head_dim)", "/ head_dim)", ("tests/test_attention_module.py", "-k", "rope")),
    Mutation("rope-range-misread", "RoPE frequency", "src/fibattn/model/rope.py",
             "return hit[start - lo:end - lo]", "return hit[start:end - lo]",
             ("tests/test_rope_scaling.py", "-k", "any_order")),
    Mutation("no-grad-clipping", "clipping", "src/fibattn/trainer/trainer.py",
             "clip_grad_norm_(self.params, clip)", "clip_grad_norm_(self.params, float(\"inf\"))",
             ("tests/test_train.py", "-k", "clip")),
    Mutation("dalpha-ignores-base", "kernel offsets", OPS + "columns.py",
             "total = sum(x * y for x, y", "total = sum(x * 1.0 for x, y",
             ("tests/test_model.py", "-k", "learned")),
    Mutation("learned-alpha-straight-through", "alpha gradient", "src/fibattn/schedules.py",
             "        return self.a_min + (self.a_max - self.a_min) * torch.sigmoid(self.theta)\n",
             "        return self.a_min + (self.a_max - self.a_min) * "
             "((torch.sigmoid(self.theta) - self.theta).detach() + self.theta)\n",
             ("tests/test_schedules.py", "-k", "learned")),
    Mutation("hf-key-detached", "gradients", "src/fibattn/interop/hf_llama.py",
             "out = sparse_attention(query, key, value, dists, scale=scaling, backend=spec.backend)",
             "out = sparse_attention(query, key.detach(), value, dists, scale=scaling, backend=spec.backend)",
             ("tests/test_hf_dropin.py",)),
    Mutation("hf-remote-shared-impl-name", "interop", "src/fibattn/interop/hf_remote/modeling_fibattn_llama.py",
             'IMPL = "fibattn_llama_" + hashlib.sha256(f"{__name__} {__file__}".encode()).hexdigest()[:12]',
             'IMPL = "fibattn_llama"', ("tests/test_hf_packed.py", "-k", "own_code")),
    Mutation("hf-padded-rows-ignore-gaps", "interop", "src/fibattn/interop/hf_batch.py",
             "if bool((n != (last - first + 1).clamp(min=0)).any()):", "if False:",
             ("tests/test_hf_dropin.py", "-k", "2d_mask")),
    Mutation("hf-pads-joining-documents-seen", "interop", "src/fibattn/interop/hf_llama.py",
             "if real is not None and documents is not None and pads_apart(documents[0], real):",
             "if real is not None and documents is not None:", ("tests/test_hf_dropin.py", "-k", "packed_document")),
    Mutation("hf-mask-function-drops-overlays", "interop", "src/fibattn/interop/hf_batch.py",
             'if kwargs.get("mask_function", mu.causal_mask_function) is not mu.causal_mask_function or args:',
             "if args:", ("tests/test_hf_dropin.py", "-k", "causal_mask_only")),
    Mutation("hf-deferred-mask-trusted", "interop", "src/fibattn/interop/hf_batch.py",
             "return bool((inside & ~seen.to(torch.bool)).any())", "return False",
             ("tests/test_hf_packed.py", "-k", "deferred")),
    Mutation("hf-packed-mask-built-whole", "interop", "src/fibattn/interop/hf_batch.py",
             "return DeferredMask(kwargs) if whole else mu.sdpa_mask(*args, **kwargs)",
             "return mu.sdpa_mask(*args, **kwargs)", ("tests/test_hf_packed.py", "-k", "no_t_by_t")),
    Mutation("hf-documents-share-one-set", "interop", "src/fibattn/interop/hf_documents.py",
             "return tuple(full) if own == [d for d in full if d < n] else tuple(own)", "return tuple(full)",
             ("tests/test_hf_dropin.py", "-k", "own_sets or right_padded")),
    Mutation("hf-packed-sets-last-call-wins", "interop", "src/fibattn/interop/hf_documents.py",
             "out = got if out is None else torch.where(mine, got, out)", "out = got",
             ("tests/test_hf_packed.py", "-k", "own_logits")),
    Mutation("hf-cached-step-sees-pads", "interop", "src/fibattn/interop/hf_documents.py",
             "        valid = valid & real[:, at]\n", "        pass\n",
             ("tests/test_hf_dropin.py", "-k", "gather_their_columns")),
    Mutation("hf-cached-step-own-set-ignored", "interop", "src/fibattn/interop/hf_documents.py",
             "sets = [_set_for(spec, full, n) for n in real.sum(-1).clamp(min=1).tolist()]",
             "sets = [tuple(full) for n in real.sum(-1).clamp(min=1).tolist()]",
             ("tests/test_hf_dropin.py", "-k", "attended_keys")),
    Mutation("hf-fibcache-compaction-drops-values", "interop",
             "src/fibattn/interop/hf_remote/modeling_fibattn_llama.py",
             "                v[..., :end - start, :] = v[..., start:end, :].clone()\n", "",
             ("tests/test_hf_cache.py", "-k", "buffer")),
    Mutation("hf-fibcache-keeps-every-row", "interop", "src/fibattn/interop/hf_remote/modeling_fibattn_llama.py",
             "self._keep_rows(max(start, end + new - self.keep), end + new)", "self._keep_rows(start, end + new)",
             ("tests/test_hf_cache.py", "-k", "buffer")),
    Mutation("lm-eval-batch-reads-first-row", "interop", "src/fibattn/interop/lm_eval_adapter.py",
             "last = torch.cat([h[r, T - n:] for r, n in enumerate(ns)])",
             "last = torch.cat([h[0, T - n:] for r, n in enumerate(ns)])",
             ("tests/test_lm_eval_adapter.py", "-k", "one_at_a_time")),
    Mutation("hf-remote-pads-seen", "interop", "src/fibattn/interop/hf_remote/modeling_fibattn_llama.py",
             "allowed = allowed & valid.to(dev)[:, at]", "allowed = allowed",
             ("tests/test_hf_remote_columns.py", "-k", "gathered_columns")),
    Mutation("hf-remote-rope-float32", "interop", "src/fibattn/interop/hf_remote/modeling_fibattn_llama.py",
             "freqs = position_ids[..., None].to(dev, torch.float64) * inv",
             "freqs = (position_ids[..., None].float() * inv.float()).to(dev, torch.float64)",
             ("tests/test_hf_remote_columns.py", "-k", "rope")),
    Mutation("tracker-import-error-uncaught", "trackers", "src/fibattn/trainer/logs.py",
             "import SummaryWriter\n            except ImportError:",
             "import SummaryWriter\n            except AttributeError:", ("tests/test_trackers.py",)),
    Mutation("checkpoint-tmp-kept", "crash safety", "src/fibattn/storage/checkpoint.py",
             "    if tmp.exists():\n        shutil.rmtree(tmp)", "    if False:\n        shutil.rmtree(tmp)",
             ("tests/test_checkpoint.py", "tests/test_reliability_faults.py", "-k", "kill9 or stale_tmp")),
    Mutation("grad-reduce-bucket-order", "resume order", "src/fibattn/trainer/grad_reduce.py",
             "for p, g in zip(b.parameters(), b.gradients())), key=lambda t: t[0])",
             "for p, g in zip(b.parameters(), b.gradients())), key=lambda t: 0)",
             ("tests/test_grad_reduce.py",)),
    Mutation("loader-skips-on-resume", "loader resume", "src/fibattn/data/loader.py",
             "self.cursor = int(state[\"cursor\"]) if same",
             "self.cursor = int(state[\"cursor\"]) + self.world_size * self.micro_batch if same",
             ("tests/test_data_loader.py",)),
    # ================================================================ round two (issue 24): one block per kind
    # ---------------------------------------------------------------- 1. constants that coincide in tests
    Mutation("recipe-lr-reads-steps-fraction", "coinciding consts", RECIPE,
             't.lr = float(f"{t.lr * t.min_lr_ratio:.6g}")', 't.lr = float(f"{t.lr * STEPS_FRACTION:.6g}")',
             ("tests/test_recipe_constants.py",)),
    Mutation("recipe-warmup-steps-fraction", "coinciding consts", RECIPE,
             "max(1, round(WARMUP_FRACTION * t.steps))", "max(1, round(STEPS_FRACTION * t.steps))",
             ("tests/test_recipe_constants.py",)),
    Mutation("lr-floor-reads-weight-decay", "coinciding consts", "src/fibattn/trainer/optim.py",
             "    low = t.lr * t.min_lr_ratio\n", "    low = t.lr * t.weight_decay\n",
             ("tests/test_recipe_constants.py",)),
    Mutation("headline-factor-hardcoded", "coinciding consts", HEADLINE,
             "r.get(dataset, factor * r.train_len)", "r.get(dataset, 4 * r.train_len)", (THRESH,)),
    Mutation("retrofit-long-hardcoded", "coinciding consts", RETRO,
             "    return factor * x.run.train_len\n", "    return 4 * x.run.train_len\n", (THRESH,)),
    Mutation("eval-targets-shifted", "coinciding consts", PPL,
             "    targets = arr[1:n + 1]\n", "    targets = arr[:n]\n", (EDGES, "-k", "scored_record")),
    # ---------------------------------------------------------------- 2. kernel tiles (Triton band blocks, rungs)
    Mutation("triton-fwd-band-last-block", "kernel tiles", TK,
             "range(i0 - WB, i0 + BLOCK_M, BLOCK_N):        # the band",
             "range(i0 - WB, i0 + BLOCK_M - 1, BLOCK_N):        # the band", BAND),
    Mutation("triton-dq-band-last-block", "kernel tiles", TK,
             "range(i0 - WB, i0 + BLOCK_M, BLOCK_N):\n", "range(i0 - WB, i0 + BLOCK_M - 1, BLOCK_N):\n", BAND),
    Mutation("triton-dkdv-band-last-block", "kernel tiles", TK,
             "range(j0, j0 + BLOCK_M + WB, BLOCK_Q)", "range(j0, j0 + BLOCK_M + WB - 1, BLOCK_Q)", BAND),
    Mutation("triton-dq-odd-rung-dropped", "kernel tiles", TK,
             "    for r0 in range(0, nr, RB):\n", "    for r0 in range(0, nr - 1, RB):\n", BAND),
    Mutation("triton-product-drops-its-accumulator", "kernel tiles", OPS + "triton_tiles.py",
             'return tl.dot(a, b, acc, input_precision="ieee")', 'return tl.dot(a, b, input_precision="ieee")',
             (TRITON, "-k", "integer_fp32")),
    Mutation("triton-per-rung-value-of-the-wrong-rung", "kernel offsets", OPS + "triton_tiles.py",
             "tl.where(n // BLOCK_M == j,", "tl.where(n // BLOCK_M == j - 1,", (TRITON, "-k", "integer_fp32")),
    Mutation("triton-documents-forward-band-step-ignored", "kernel tiles", OPS + "triton_backend.py",
             'return dims["BLOCK_N_TWO_TAP_DOCS"] if two_tap and docs else dims["BLOCK_N"]', 'return dims["BLOCK_N"]',
             (TRITON, "-k", "tiles_keep")),
    # ---------------------------------------------------------------- 3. records compared only with themselves
    Mutation("eval-sha-of-native-dtype", "self-compared", PPL,
             "hashlib.sha256(targets.astype(np.int64).tobytes())", "hashlib.sha256(targets.tobytes())",
             (EDGES, "-k", "scored_record")),
    Mutation("data-id-ignores-weights", "self-compared", "src/fibattn/data/loader.py",
             'rec = [(s["name"], s["weight"], [r["sha256"]', 'rec = [(s["name"], [r["sha256"]',
             (EQUIV, "-k", "changed_training_data")),
    Mutation("llama-gate-up-swapped", "self-compared", NAMES,
             '"ffn.gate": "mlp.gate_proj", "ffn.up": "mlp.up_proj"',
             '"ffn.gate": "mlp.up_proj", "ffn.up": "mlp.gate_proj"', (LLAMA, "-k", "exported")),
    Mutation("llama-norms-swapped", "self-compared", NAMES,
             '"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"',
             '"attn_norm": "post_attention_layernorm", "ffn_norm": "input_layernorm"', (LLAMA, "-k", "exported")),
    # ---------------------------------------------------------------- 4. equivalences
    Mutation("accum-loss-not-averaged", "equivalence", TRAINER,
             "(loss / self.accum).backward()", "loss.backward()", (EQUIV, "-k", "accumulation")),
    Mutation("accum-logged-loss-summed", "equivalence", TRAINER,
             "torch.stack([loss_sum / self.accum,", "torch.stack([loss_sum,", (EQUIV, "-k", "accumulation")),
    Mutation("batch-seed-not-per-row", "equivalence", "src/fibattn/generation/arguments.py",
             "seeds = [seed + r for r in range(batch)]", "seeds = [seed for r in range(batch)]",
             (EQUIV, "-k", "seed")),
    Mutation("next-global-own-cursor", "equivalence", "src/fibattn/data/loader.py",
             '"next_global": self.cursor - self.rank * self.micro_batch', '"next_global": self.cursor',
             (EQUIV, "-k", "global_position")),
    # ---------------------------------------------------------------- 5. edge arithmetic in evaluation
    Mutation("bucket-count-not-capped", "eval edges", PPL,
             "    nb = min(buckets, length)\n", "    nb = buckets\n", (EDGES, "-k", "bucket")),
    Mutation("bucket-edges-integer-step", "eval edges", PPL,
             "return [round(i * length / nb) for i in range(nb + 1)]",
             "return [i * (length // nb) for i in range(nb + 1)]", (EDGES, "-k", "bucket")),
    Mutation("bucket-count-per-window", "eval edges", PPL,
             "buckets=position_buckets(pos_sum, pos_count, buckets)",
             "buckets=position_buckets(pos_sum, windows, buckets)",
             (EDGES, "-k", "bucket")),
    Mutation("budget-boundary-strict", "eval edges", PPL,
             "    if n < longest:\n", "    if n <= longest:\n", (EDGES, "-k", "boundary")),
    Mutation("budget-counts-input-token", "eval edges", PPL,
             "n = (min(tokens, available - 1) // longest)", "n = (min(tokens, available) // longest)",
             (EDGES, "-k", "boundary")),
    # ---------------------------------------------------------------- 6. pass/fail checks on both sides
    Mutation("headline-dense-strict", "threshold sides", HEADLINE,
             "ch >= dense_goal", "ch > dense_goal", (THRESH,)),
    Mutation("headline-sparse-no-abs", "threshold sides", HEADLINE,
             "abs(ch) <= sparse_tol", "ch <= sparse_tol", (THRESH,)),
    Mutation("headline-factor-needs-3x", "threshold sides", HEADLINE,
             "m >= 2}", "m > 2}", (THRESH,)),
    Mutation("demo-verdict-any-pass", "threshold sides", "src/fibattn/study/demo.py",
             "if all(c.passed for c in checks)", "if any(c.passed for c in checks)", (THRESH,)),
    Mutation("retrofit-gap-strict", "threshold sides", RETRO,
             "gap <= GAP_GOAL_PCT", "gap < GAP_GOAL_PCT", (THRESH,)),
    Mutation("retrofit-dense-strict", "threshold sides", RETRO,
             "rise >= DENSE_GOAL_PCT", "rise > DENSE_GOAL_PCT", (THRESH,)),
    Mutation("retrofit-share-strict", "threshold sides", RETRO,
             "x.share <= GOAL_SHARE + 1e-9", "x.share < GOAL_SHARE", (THRESH,)),
    # ---------------------------------------------------------------- 7. defaults for keys foreign files omit
    Mutation("llama-rope-theta-default", "foreign defaults", INIT_SOURCE,
             'get("rope_theta", NUMBER, 1e4)', 'get("rope_theta", NUMBER, 5e5)', (LLAMA, "-k", "default")),
    Mutation("llama-rms-eps-default", "foreign defaults", INIT_SOURCE,
             'get("rms_norm_eps", NUMBER, 1e-6)', 'get("rms_norm_eps", NUMBER, 1e-5)', (LLAMA, "-k", "default")),
    Mutation("llama-tied-default", "foreign defaults", INIT_SOURCE,
             'get("tie_word_embeddings", bool, False)', 'get("tie_word_embeddings", bool, True)',
             (LLAMA, "-k", "default")),
    Mutation("llama-kv-heads-default", "foreign defaults", INIT_SOURCE,
             'get("num_key_value_heads", int, heads, null_ok=True) or heads',
             'get("num_key_value_heads", int, 1, null_ok=True) or 1', (LLAMA, "-k", "default")),
    # ---------------------------------------------------------------- packed documents (method.md §8)
    Mutation("doc-clamp-one-row-late", "document bounds", OPS + "torch_backend.py",
             "self.start = torch.arange(T, device=off.device) - off.long()",
             "self.start = torch.arange(T, device=off.device) - off.long() + (off > 0).long()",
             (DOCS, "-k", "packed_row and torch")),
    Mutation("doc-start-shifted", "document bounds", OPS + "documents.py",
             "    first[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]\n",
             "    first[:, :-1] = document_ids[:, 1:] != document_ids[:, :-1]\n", (DOCS, "-k", "converters")),
    Mutation("doc-reference-excludes-start", "document bounds", OPS + "reference.py",
             "else off[:, None, :].long()     # position in the document",
             "else off[:, None, :].long() - 1", (DOCS, "-k", "packed_row and reference")),
]

# the later audits' mutations (issues 58 and 59), in a file of their own; they use the names above
sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutation_list_audits import AUDITS  # noqa: E402

MUTATIONS += AUDITS
