/* fibattn CPU kernels: banded (Toeplitz) sparse attention with OpenMP.
 *
 * Compiled on first use by cpu_backend.py (gcc -O2 -march=native -fopenmp) and loaded
 * with ctypes. Every kernel exists for float (suffix _f32) and double (_f64): this file
 * includes itself once per type with REAL / SFX / EXPR defined (keep its name cpu_kernels.c).
 *
 * Layout (all contiguous, row-major): q, x, out ``(B, H, T, D)``; k, v ``(B, Hk, T, D)``;
 * weights ``(B, H, T, n)``. Query head h = b*H + hk*g + gh reads key head bh = b*Hk + hk,
 * g = H / Hk. Rows below 0 are clamped to row 0 (see torch_backend.py for the maths).
 *
 * Fused kernels work on *columns*: column c at query row i reads
 *     wlo[c] * x[i - lo[c]] + whi[c] * x[max(i - lo[c] - 1, 0)]     (second tap if two[c])
 * and is valid when i >= lo[c]; lo is sorted ascending, so the valid columns of row i are
 * a prefix. Invalid columns get probability 0. An integer distance d is the column
 * (lo=d, wlo=1, two=0); an interpolated rung is (lo, 1-frac, frac, two=1).
 *
 * Packed documents: dpos (B, T) int32, or NULL for one document per row, holds each row's
 * position inside its document. A row's *limit* is lim = dpos[b, i] (i without documents):
 * column c is valid when lim >= lo[c], and a tap at distance d reads row i - min(d, lim),
 * i.e. taps clamp at the document start instead of row 0.
 *
 * Nothing is scattered: every output row is written by exactly one thread (the gradient
 * of k and v is computed in gather form, y[m] = sum over rows m + d that read row m).
 *
 * Tiled rows (issue 29; head size 2-16 SIMD vectors, fast != 0): the same per-row structure
 * with the head size a compile-time constant (FA_WITH_NV): register accumulators, the dots of
 * FA_VL taps summed by one transposing add tree, far rows prefetched before the work that
 * precedes their use; the backward keeps P and dS by column so that the key-row pass goes tap
 * by tap over consecutive rows (bwd_block). d/d frac is summed per (head, block) and then in a
 * fixed order, so it is bit-identical for any thread count.
 */
#ifndef FA_BODY
#define FA_BODY
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;
#define FA_BLOCK 64
#define FA_INLINE static inline __attribute__((always_inline))

/* SIMD width in bytes for the GCC vector types of the hot loops (lowered to what the CPU has). */
#if defined(__AVX512F__)
#define FA_VBYTES 64
#else
#define FA_VBYTES 32
#endif
#define FA_VL (FA_VBYTES / FA_RBYTES)

static inline i64 fa_max0(i64 x) { return x < 0 ? 0 : x; }
static inline i64 fa_min(i64 a, i64 b) { return a < b ? a : b; }

int fa_abi_version(void) { return 11; }

/* ends[b, m]: one past the last row of the document holding row m (a document starts where
 * dpos is 0); NULL when out of memory. */
static i64 *fa_doc_ends(const int32_t *dpos, i64 B, i64 T) {
    i64 *ends = malloc(sizeof(i64) * (B * T > 0 ? B * T : 1));
    if (ends)
        for (i64 b = 0; b < B; b++)
            for (i64 m = T - 1; m >= 0; m--)
                ends[b * T + m] = m + 1 == T || dpos[b * T + m + 1] == 0 ? m + 1 : ends[b * T + m + 1];
    return ends;
}

#define REAL float
#define FA_RBYTES 4
#define SFX(x) x##_f32
#define EXPR expf
#include "cpu_kernels.c" /* this file again, with REAL defined */
#undef REAL
#undef FA_RBYTES
#undef SFX
#undef EXPR

#define REAL double
#define FA_RBYTES 8
#define SFX(x) x##_f64
#define EXPR exp
#include "cpu_kernels.c" /* this file again, with REAL defined */
#undef REAL
#undef FA_RBYTES
#undef SFX
#undef EXPR

#else /* ---------------------------------------------------------------- typed body */

/* Vector types: ``vec`` holds FA_VL values; ``uvec`` is its unaligned, aliasing twin for loads. */
typedef REAL SFX(vec) __attribute__((vector_size(FA_VBYTES)));
typedef REAL SFX(uvec) __attribute__((vector_size(FA_VBYTES), aligned(FA_RBYTES), may_alias));
typedef REAL SFX(half) __attribute__((vector_size(FA_VBYTES / 2)));
typedef REAL SFX(quarter) __attribute__((vector_size(FA_VBYTES / 4)));
#define VLD(p) (*(const SFX(uvec) *)(p))
#define VST(p, x) (*(SFX(uvec) *)(p) = (x))

FA_INLINE REAL SFX(hsum)(SFX(vec) a) {
#if FA_VL == 16
    SFX(half) h = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
                  __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    SFX(quarter) r = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
    return (r[0] + r[2]) + (r[1] + r[3]);
#elif FA_VL == 8
    SFX(half) h = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (h[0] + h[2]) + (h[1] + h[3]);
#else
    return (a[0] + a[2]) + (a[1] + a[3]);
#endif
}

FA_INLINE void SFX(zero)(REAL *restrict y, i64 D) { memset(y, 0, sizeof(REAL) * D); }

/* out[t] = x . base[rows[t]] for t < n: four rows at a time into independent vector
 * accumulators, the head dim in SIMD chunks plus a scalar tail. */
static void SFX(dots)(const REAL *restrict x, const REAL *restrict base, const i64 *restrict rows, i64 n, i64 D,
                      REAL *restrict out) {
    const i64 DV = D - D % FA_VL;
    i64 t = 0;
    for (; t + 4 <= n; t += 4) {
        const REAL *r0 = base + rows[t] * D, *r1 = base + rows[t + 1] * D;
        const REAL *r2 = base + rows[t + 2] * D, *r3 = base + rows[t + 3] * D;
        SFX(vec) a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (i64 e = 0; e < DV; e += FA_VL) {
            const SFX(vec) xe = VLD(x + e);
            a0 += xe * VLD(r0 + e), a1 += xe * VLD(r1 + e), a2 += xe * VLD(r2 + e), a3 += xe * VLD(r3 + e);
        }
        REAL s0 = SFX(hsum)(a0), s1 = SFX(hsum)(a1), s2 = SFX(hsum)(a2), s3 = SFX(hsum)(a3);
        for (i64 e = DV; e < D; e++) s0 += x[e] * r0[e], s1 += x[e] * r1[e], s2 += x[e] * r2[e], s3 += x[e] * r3[e];
        out[t] = s0, out[t + 1] = s1, out[t + 2] = s2, out[t + 3] = s3;
    }
    for (; t < n; t++) {
        const REAL *r0 = base + rows[t] * D;
        SFX(vec) a0 = {0};
        for (i64 e = 0; e < DV; e += FA_VL) a0 += VLD(x + e) * VLD(r0 + e);
        REAL s0 = SFX(hsum)(a0);
        for (i64 e = DV; e < D; e++) s0 += x[e] * r0[e];
        out[t] = s0;
    }
}

FA_INLINE REAL SFX(dot)(const REAL *restrict a, const REAL *restrict b, i64 D) {
    const i64 zero = 0;
    REAL s;
    SFX(dots)(a, b, &zero, 1, D, &s);
    return s;
}

/* acc += sum_t coef[t] * base[rows[t]], four rows at a time. */
static void SFX(gather)(REAL *restrict acc, const REAL *restrict base, const i64 *restrict rows,
                        const REAL *restrict coef, i64 n, i64 D) {
    const i64 DV = D - D % FA_VL;
    i64 t = 0;
    for (; t + 4 <= n; t += 4) {
        const REAL *r0 = base + rows[t] * D, *r1 = base + rows[t + 1] * D;
        const REAL *r2 = base + rows[t + 2] * D, *r3 = base + rows[t + 3] * D;
        const REAL c0 = coef[t], c1 = coef[t + 1], c2 = coef[t + 2], c3 = coef[t + 3];
        for (i64 e = 0; e < DV; e += FA_VL)
            VST(acc + e, VLD(acc + e) + c0 * VLD(r0 + e) + c1 * VLD(r1 + e) + c2 * VLD(r2 + e) + c3 * VLD(r3 + e));
        for (i64 e = DV; e < D; e++) acc[e] += c0 * r0[e] + c1 * r1[e] + c2 * r2[e] + c3 * r3[e];
    }
    for (; t < n; t++) {
        const REAL *r0 = base + rows[t] * D, c0 = coef[t];
        for (i64 e = 0; e < DV; e += FA_VL) VST(acc + e, VLD(acc + e) + c0 * VLD(r0 + e));
        for (i64 e = DV; e < D; e++) acc[e] += c0 * r0[e];
    }
}

/* ---------------------------------------------------------------- fixed head size
 * The same two primitives with the head size a compile-time constant (NV vectors of FA_VL;
 * the callers pass literals so each size gets its own fully unrolled copy): accumulators stay
 * in registers, and the dots of FA_VL taps are summed by one transposing add tree instead of
 * a horizontal sum per tap. */

/* Lane l of the result = the sum of a[rev(l)] (rev: bit reversal of the lane index), so the
 * callers store tap t in a[rev(t)]. Each level halves the vector count with two shuffles. */
#if FA_VL == 16
#define FA_REV {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15}
#define FA_L1(x, y) (__builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) + \
                     __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31))
#define FA_L2(x, y) (__builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) + \
                     __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31))
#define FA_L3(x, y) (__builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) + \
                     __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31))
#define FA_L4(x, y) (__builtin_shufflevector(x, y, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) + \
                     __builtin_shufflevector(x, y, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31))
#elif FA_VL == 8
#define FA_REV {0, 4, 2, 6, 1, 5, 3, 7}
#define FA_L1(x, y) (__builtin_shufflevector(x, y, 0, 1, 2, 3, 8, 9, 10, 11) + \
                     __builtin_shufflevector(x, y, 4, 5, 6, 7, 12, 13, 14, 15))
#define FA_L2(x, y) (__builtin_shufflevector(x, y, 0, 1, 8, 9, 4, 5, 12, 13) + \
                     __builtin_shufflevector(x, y, 2, 3, 10, 11, 6, 7, 14, 15))
#define FA_L3(x, y) (__builtin_shufflevector(x, y, 0, 8, 2, 10, 4, 12, 6, 14) + \
                     __builtin_shufflevector(x, y, 1, 9, 3, 11, 5, 13, 7, 15))
#else
#define FA_REV {0, 2, 1, 3}
#define FA_L1(x, y) (__builtin_shufflevector(x, y, 0, 1, 4, 5) + __builtin_shufflevector(x, y, 2, 3, 6, 7))
#define FA_L2(x, y) (__builtin_shufflevector(x, y, 0, 4, 2, 6) + __builtin_shufflevector(x, y, 1, 5, 3, 7))
#endif

FA_INLINE SFX(vec) SFX(tree)(const SFX(vec) *a) {
    SFX(vec) w[FA_VL / 2];
    for (int j = 0; j < FA_VL / 2; j++) w[j] = FA_L1(a[2 * j], a[2 * j + 1]);
#if FA_VL >= 8
    SFX(vec) x[FA_VL / 4];
    for (int j = 0; j < FA_VL / 4; j++) x[j] = FA_L2(w[2 * j], w[2 * j + 1]);
#if FA_VL == 16
    SFX(vec) y[2] = {FA_L3(x[0], x[1]), FA_L3(x[2], x[3])};
    return FA_L4(y[0], y[1]);
#else
    return FA_L3(x[0], x[1]);
#endif
#else
    return FA_L2(w[0], w[1]);
#endif
}

/* out[t] = x . base[rows[t]] for t < n, written in whole vectors (out holds n rounded up to
 * FA_VL; the lanes past n dot row rows[0] and are never read). */
FA_INLINE void SFX(dotsN)(const REAL *restrict x, const REAL *restrict base, const i64 *restrict rows, i64 n,
                          REAL *restrict out, const int NV) {
    static const int rev[FA_VL] = FA_REV;
    const i64 D = (i64)NV * FA_VL;
    for (i64 t0 = 0; t0 < n; t0 += FA_VL) {
        const REAL *r[FA_VL];
        SFX(vec) a[FA_VL];
#pragma GCC unroll 16
        for (int j = 0; j < FA_VL; j++)
            r[j] = base + rows[t0 + rev[j] < n ? t0 + rev[j] : 0] * D, a[j] = (SFX(vec)){0};
#pragma GCC unroll 16
        for (int c = 0; c < NV; c++) {
            const SFX(vec) xc = VLD(x + c * FA_VL);
#pragma GCC unroll 16
            for (int j = 0; j < FA_VL; j++) a[j] += xc * VLD(r[j] + c * FA_VL);
        }
        VST(out + t0, SFX(tree)(a));
    }
}
#undef FA_REV
#undef FA_L1
#undef FA_L2
#undef FA_L3
#undef FA_L4

/* Prefetch base[rows[t]] for t < n (far rows miss the caches; issued before the dots that precede
 * their gather, their latency overlaps that work). */
FA_INLINE void SFX(prefetch)(const REAL *base, const i64 *rows, i64 n, const int NV) {
    const i64 D = (i64)NV * FA_VL;
    for (i64 t = 0; t < n; t++)
        for (i64 e = 0; e < D; e += 64 / FA_RBYTES) __builtin_prefetch(base + rows[t] * D + e);
}

/* y = sum_t coef[t] * base[rows[t]] (y += ... when add), in register blocks of at most 8 vectors. */
FA_INLINE void SFX(gatherN)(REAL *restrict y, const REAL *restrict base, const i64 *restrict rows,
                            const REAL *restrict coef, i64 n, const int add, const int NV) {
    const i64 D = (i64)NV * FA_VL;
    enum { CH = 8 };
    for (int c0 = 0; c0 < NV; c0 += CH) {
        const int nc = NV - c0 < CH ? NV - c0 : CH;
        SFX(vec) a[CH];
#pragma GCC unroll 8
        for (int c = 0; c < nc; c++) a[c] = add ? (SFX(vec))VLD(y + (c0 + c) * FA_VL) : (SFX(vec)){0};
        for (i64 t = 0; t < n; t++) {
            const REAL *r = base + rows[t] * D + c0 * FA_VL;
            const REAL ct = coef[t];
#pragma GCC unroll 8
            for (int c = 0; c < nc; c++) a[c] += ct * VLD(r + c * FA_VL);
        }
#pragma GCC unroll 8
        for (int c = 0; c < nc; c++) VST(y + (c0 + c) * FA_VL, a[c]);
    }
}

/* Per-thread scratch: tap lists (row, column, weight) and per-tap / per-column values. */
typedef struct {
    i64 *row, *col;
    REAL *w, *d, *d2, *cf, *cf2, *s;
} SFX(ws_t);

static int SFX(ws_init)(SFX(ws_t) *ws, i64 C) {
    const i64 n = 3 * C + 4 + 2 * FA_VL;            /* dotsN writes whole vectors */
    ws->row = malloc(sizeof(i64) * 2 * n);
    ws->w = malloc(sizeof(REAL) * 6 * n);
    if (!ws->row || !ws->w) {
        free(ws->row), free(ws->w);
        ws->row = NULL, ws->w = NULL;
        return 1;
    }
    ws->col = ws->row + n;
    ws->d = ws->w + n, ws->d2 = ws->w + 2 * n, ws->cf = ws->w + 3 * n, ws->cf2 = ws->w + 4 * n;
    ws->s = ws->w + 5 * n;
    return 0;
}

static void SFX(ws_free)(SFX(ws_t) *ws) { free(ws->row), free(ws->w); }

/* ---------------------------------------------------------------- generic primitives */

/* out[h,i,j] = q[h,i] . k[bh, max(i - d_j, 0)] */
int SFX(fa_scores)(const REAL *q, const REAL *k, REAL *out, i64 B, i64 H, i64 Hk, i64 T, i64 D, const i64 *d,
                   i64 n, int nt) {
    const i64 g = H / Hk, nb = (T + FA_BLOCK - 1) / FA_BLOCK;
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        SFX(ws_t) ws = {0};
        const int bad = SFX(ws_init)(&ws, n);
#pragma omp for collapse(2) schedule(dynamic)
        for (i64 bh = 0; bh < B * Hk; bh++)
            for (i64 blk = 0; blk < nb; blk++) {
                if (bad) continue;
                const REAL *kb = k + bh * T * D;
                const i64 i0 = blk * FA_BLOCK, i1 = fa_min(T, i0 + FA_BLOCK);
                for (i64 gh = 0; gh < g; gh++) {
                    const i64 h = (bh / Hk) * H + (bh % Hk) * g + gh;
                    const REAL *qh = q + h * T * D;
                    REAL *oh = out + h * T * n;
                    for (i64 i = i0; i < i1; i++) {
                        for (i64 j = 0; j < n; j++) ws.row[j] = fa_max0(i - d[j]);
                        SFX(dots)(qh + i * D, kb, ws.row, n, D, oh + i * n);
                    }
                }
            }
        if (bad) {
#pragma omp atomic write
            failed = 1;
        } else SFX(ws_free)(&ws);
    }
    return failed;
}

/* out[h,i] = sum_j p[h,i,j] v[bh, max(i - d_j, 0)] */
int SFX(fa_wsum)(const REAL *p, const REAL *v, REAL *out, i64 B, i64 H, i64 Hk, i64 T, i64 D, const i64 *d,
                 i64 n, int nt) {
    const i64 g = H / Hk, nb = (T + FA_BLOCK - 1) / FA_BLOCK;
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        SFX(ws_t) ws = {0};
        const int bad = SFX(ws_init)(&ws, n);
#pragma omp for collapse(2) schedule(dynamic)
        for (i64 bh = 0; bh < B * Hk; bh++)
            for (i64 blk = 0; blk < nb; blk++) {
                if (bad) continue;
                const REAL *vb = v + bh * T * D;
                const i64 i0 = blk * FA_BLOCK, i1 = fa_min(T, i0 + FA_BLOCK);
                for (i64 gh = 0; gh < g; gh++) {
                    const i64 h = (bh / Hk) * H + (bh % Hk) * g + gh;
                    const REAL *ph = p + h * T * n;
                    REAL *oh = out + h * T * D;
                    for (i64 i = i0; i < i1; i++) {
                        for (i64 j = 0; j < n; j++) ws.row[j] = fa_max0(i - d[j]);
                        SFX(zero)(oh + i * D, D);
                        SFX(gather)(oh + i * D, vb, ws.row, ph + i * n, n, D);
                    }
                }
            }
        if (bad) {
#pragma omp atomic write
            failed = 1;
        } else SFX(ws_free)(&ws);
    }
    return failed;
}

/* Adjoint of wsum in v: y[bh,m] = sum_{gh,j} p[h,m+d_j,j] x[h,m+d_j]  (+ the clamped rows at m = 0). */
int SFX(fa_wsum_t)(const REAL *p, const REAL *x, REAL *out, i64 B, i64 H, i64 Hk, i64 T, i64 D, const i64 *d,
                   i64 n, int nt) {
    const i64 g = H / Hk, nb = (T + FA_BLOCK - 1) / FA_BLOCK;
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        SFX(ws_t) ws = {0};
        const int bad = SFX(ws_init)(&ws, n);
#pragma omp for collapse(2) schedule(dynamic)
        for (i64 bh = 0; bh < B * Hk; bh++)
            for (i64 blk = 0; blk < nb; blk++) {
                if (bad) continue;
                const i64 i0 = blk * FA_BLOCK, i1 = fa_min(T, i0 + FA_BLOCK);
                REAL *yb = out + bh * T * D;
                for (i64 m = i0; m < i1; m++) SFX(zero)(yb + m * D, D);
                for (i64 gh = 0; gh < g; gh++) {
                    const i64 h = (bh / Hk) * H + (bh % Hk) * g + gh;
                    const REAL *ph = p + h * T * n, *xh = x + h * T * D;
                    for (i64 m = i0; m < i1; m++) {
                        i64 cnt = 0;
                        for (i64 j = 0; j < n; j++) {
                            const i64 i = m + d[j];
                            if (i < T) ws.row[cnt] = i, ws.cf[cnt++] = ph[i * n + j];
                        }
                        SFX(gather)(yb + m * D, xh, ws.row, ws.cf, cnt, D);
                    }
                }
            }
        /* rows i < d_j were clamped to row 0 (after the barrier above; one thread per head) */
#pragma omp for schedule(static)
        for (i64 bh = 0; bh < B * Hk; bh++)
            for (i64 gh = 0; gh < g && !bad; gh++) {
                const i64 h = (bh / Hk) * H + (bh % Hk) * g + gh;
                const REAL *ph = p + h * T * n, *xh = x + h * T * D;
                for (i64 j = 0; j < n; j++)
                    for (i64 i = 0; i < fa_min(d[j], T); i++) {
                        const REAL c = ph[i * n + j];
                        const REAL *xi = xh + i * D;
                        REAL *y0 = out + bh * T * D;
#pragma omp simd
                        for (i64 e = 0; e < D; e++) y0[e] += c * xi[e];
                    }
            }
        if (bad) {
#pragma omp atomic write
            failed = 1;
        } else SFX(ws_free)(&ws);
    }
    return failed;
}

/* ---------------------------------------------------------------- fused attention */

/* The taps of a column set: tap t reads row i - off[t] of column col[t] with weight w[t].
 * Taps are ordered by column (so off ascends); end[c] = number of taps of columns 0..c.
 * The table is the same for every row (Toeplitz); a row uses the prefix of valid columns. */
typedef struct {
    i64 n, *off, *col, *end;
    REAL *w;
    int one; /* every column has a single tap (the integer op) */
} SFX(taps_t);

static int SFX(taps_init)(SFX(taps_t) *tp, i64 C, const i64 *lo, const REAL *wlo, const REAL *whi,
                          const int *two) {
    tp->off = malloc(sizeof(i64) * (5 * C + 1));
    tp->w = malloc(sizeof(REAL) * (2 * C + 1));
    if (!tp->off || !tp->w) {
        free(tp->off), free(tp->w);
        return 1;
    }
    tp->col = tp->off + 2 * C, tp->end = tp->off + 4 * C;
    i64 t = 0;
    tp->one = 1;
    for (i64 c = 0; c < C; c++) {
        tp->off[t] = lo[c], tp->col[t] = c, tp->w[t] = two[c] ? wlo[c] : 1, t++;
        if (two[c]) tp->off[t] = lo[c] + 1, tp->col[t] = c, tp->w[t] = whi[c], t++, tp->one = 0;
        tp->end[c] = t;
    }
    tp->n = t;
    return 0;
}

static void SFX(taps_free)(SFX(taps_t) *tp) { free(tp->off), free(tp->w); }

/* Valid columns of a row with limit lim (lo ascending), from the previous row's count nv:
 * the limit grows by one per row except at a document start, where the prefix restarts. */
FA_INLINE i64 SFX(nvalid)(i64 nv, i64 lim, i64 C, const i64 *lo) {
    if (nv && lo[nv - 1] > lim) nv = 0;
    while (nv < C && lo[nv] <= lim) nv++;
    return nv;
}

/* s[c] = exp(scale * (s[c] - max)) / sum for c < n (n >= 1). */
static void SFX(softmax)(REAL *restrict s, i64 n, REAL scale) {
    REAL mx = s[0], sum = 0;
    for (i64 c = 1; c < n; c++) mx = s[c] > mx ? s[c] : mx;
#if FA_RBYTES == 4
    /* float: a vectorised exp (Cody-Waite reduction, degree-6 polynomial; ~1 ulp for x <= 0) */
    typedef int32_t SFX(ivec) __attribute__((vector_size(FA_VBYTES)));
    for (i64 c0 = 0; c0 < n; c0 += FA_VL) {
        SFX(vec) x;
        for (i64 l = 0; l < FA_VL; l++) {
            const REAL xl = c0 + l < n ? (s[c0 + l] - mx) * scale : -87.0f;
            x[l] = xl < -87.0f ? -87.0f : xl;
        }
        /* k = round(x / ln 2) by the 1.5 * 2^23 trick (|x / ln 2| < 2^22) */
        const SFX(vec) k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
        const SFX(vec) r = x - k * 0.693359375f + k * 2.12194440e-4f;
        SFX(vec) y = 1.9875691500e-4f * r + 1.3981999507e-3f;
        y = y * r + 8.3334519073e-3f;
        y = y * r + 4.1665795894e-2f;
        y = y * r + 1.6666665459e-1f;
        y = y * r + 5.0000001201e-1f;
        y = y * r * r + r + 1.0f;
        const SFX(ivec) e = (__builtin_convertvector(k, SFX(ivec)) + 127) << 23;
        SFX(vec) two_k;
        memcpy(&two_k, &e, sizeof two_k);
        y *= two_k;
        for (i64 l = 0; l < FA_VL && c0 + l < n; l++) s[c0 + l] = y[l], sum += y[l];
    }
#else
    for (i64 c = 0; c < n; c++) s[c] = EXPR((s[c] - mx) * scale), sum += s[c];
#endif
    const REAL inv = 1 / sum;
    for (i64 c = 0; c < n; c++) s[c] *= inv;
}

FA_INLINE void SFX(fwd_row)(const REAL *restrict qi, const REAL *restrict kb, const REAL *restrict vb,
                            REAL *restrict oi, REAL *restrict pi, const SFX(taps_t) *tp, SFX(ws_t) *ws, i64 i,
                            i64 lim, i64 nv, i64 D, i64 C, REAL scale, const int NV) {
    const i64 n = tp->end[nv - 1];
    for (i64 t = 0; t < n; t++) ws->row[t] = i - fa_min(tp->off[t], lim);
    if (NV) SFX(prefetch)(vb, ws->row, n, NV), SFX(dotsN)(qi, kb, ws->row, n, ws->d, NV);
    else SFX(dots)(qi, kb, ws->row, n, D, ws->d);
    REAL *s = tp->one ? ws->d : ws->s;                  /* scores per column */
    if (!tp->one) {
        for (i64 c = 0; c < nv; c++) s[c] = 0;
        for (i64 t = 0; t < n; t++) s[tp->col[t]] += tp->w[t] * ws->d[t];
    }
    SFX(softmax)(s, nv, scale);
    for (i64 c = 0; c < nv; c++) pi[c] = s[c];
    for (i64 c = nv; c < C; c++) pi[c] = 0;
    const REAL *cf = s;
    if (!tp->one) {
        for (i64 t = 0; t < n; t++) ws->cf[t] = s[tp->col[t]] * tp->w[t];
        cf = ws->cf;
    }
    if (NV) SFX(gatherN)(oi, vb, ws->row, cf, n, 0, NV);
    else SFX(zero)(oi, D), SFX(gather)(oi, vb, ws->row, cf, n, D);
}

/* The register-blocked rows need D a multiple of the vector width with 1-16 vectors; fast = 0
 * (the backend's FIBATTN_CPU_KERNEL=rows) keeps the generic rows for comparison. */
static int SFX(fixed_nv)(i64 D, int fast) {
    const i64 nv = D / FA_VL;
    return fast && D % FA_VL == 0 && (nv == 2 || nv == 4 || nv == 8 || nv == 16) ? (int)nv : 0;
}

/* Runs the statement with the constant NV = nvx (one inlined copy per supported size). */
#define FA_WITH_NV(nvx, ...)                                                                     \
    switch (nvx) {                                                                                \
    case 2: { const int NV = 2; __VA_ARGS__; } break;                                                  \
    case 4: { const int NV = 4; __VA_ARGS__; } break;                                                  \
    case 8: { const int NV = 8; __VA_ARGS__; } break;                                                  \
    case 16: { const int NV = 16; __VA_ARGS__; } break;                                                \
    default: { const int NV = 0; __VA_ARGS__; }                                                        \
    }

/* out = softmax(scale * q.k_cols) . v_cols;  P (B,H,T,C) keeps the probabilities. */
int SFX(fa_attn_fwd)(const REAL *q, const REAL *k, const REAL *v, REAL *out, REAL *P, i64 B, i64 H, i64 Hk,
                     i64 T, i64 D, i64 C, const i64 *lo, const REAL *wlo, const REAL *whi, const int *two,
                     REAL scale, const int32_t *dpos, int fast, int nt) {
    const i64 g = H / Hk, nb = (T + FA_BLOCK - 1) / FA_BLOCK;
    const int nvx = SFX(fixed_nv)(D, fast);
    SFX(taps_t) tp;
    if (C < 1 || lo[0] != 0 || SFX(taps_init)(&tp, C, lo, wlo, whi, two)) return 1;
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        SFX(ws_t) ws = {0};
        const int bad = SFX(ws_init)(&ws, C);
#pragma omp for collapse(2) schedule(dynamic)
        for (i64 bh = 0; bh < B * Hk; bh++)
            for (i64 blk = 0; blk < nb; blk++) {
                if (bad) continue;
                const REAL *kb = k + bh * T * D, *vb = v + bh * T * D;
                const int32_t *pb = dpos ? dpos + (bh / Hk) * T : NULL;
                const i64 i0 = blk * FA_BLOCK, i1 = fa_min(T, i0 + FA_BLOCK);
                for (i64 gh = 0; gh < g; gh++) {
                    const i64 h = (bh / Hk) * H + (bh % Hk) * g + gh;
                    const REAL *qh = q + h * T * D;
                    REAL *oh = out + h * T * D, *ph = P + h * T * C;
                    i64 nv = 0;
                    FA_WITH_NV(nvx, for (i64 i = i0; i < i1; i++) {
                        const i64 lim = pb ? pb[i] : i;
                        nv = SFX(nvalid)(nv, lim, C, lo);
                        SFX(fwd_row)(qh + i * D, kb, vb, oh + i * D, ph + i * C, &tp, &ws, i, lim, nv, D, C, scale,
                                     NV);
                    })
                }
            }
        if (bad) {
#pragma omp atomic write
            failed = 1;
        } else SFX(ws_free)(&ws);
    }
    SFX(taps_free)(&tp);
    return failed;
}

FA_INLINE void SFX(bwd_row)(const REAL *restrict qi, const REAL *restrict kb, const REAL *restrict vb,
                            const REAL *restrict oi, const REAL *restrict gi, const REAL *restrict pi,
                            REAL *restrict dsi, REAL *restrict pti, i64 sc, REAL *restrict dqi,
                            double *restrict dfrac, const SFX(taps_t) *tp,
                            SFX(ws_t) *ws, i64 i, i64 lim, i64 nv, i64 D, i64 C, REAL scale, const int NV) {
    const i64 n = tp->end[nv - 1];
    for (i64 t = 0; t < n; t++) ws->row[t] = i - fa_min(tp->off[t], lim);
    const REAL delta = SFX(dot)(gi, oi, D);
    if (NV) SFX(prefetch)(kb, ws->row, n, NV), SFX(dotsN)(gi, vb, ws->row, n, ws->d, NV);  /* dout . v per tap */
    else SFX(dots)(gi, vb, ws->row, n, D, ws->d);
    REAL *ds = tp->one ? ws->d : ws->s;                /* dP per column, then dS = P (dP - delta) */
    if (!tp->one) {
        for (i64 c = 0; c < nv; c++) ds[c] = 0;
        for (i64 t = 0; t < n; t++) ds[tp->col[t]] += tp->w[t] * ws->d[t];
    }
    const REAL ks = pti ? scale : 1;                    /* tiled rows: dS is kept times scale (dk's factor) */
    for (i64 c = 0; c < nv; c++) ds[c] = pi[c] * (ds[c] - delta), dsi[c * sc] = ks * ds[c];
    for (i64 c = nv; c < C; c++) dsi[c * sc] = 0;
    if (pti)                                            /* P by column too, for the key-row pass */
        for (i64 c = 0; c < C; c++) pti[c * sc] = pi[c];
    if (tp->one)
        for (i64 t = 0; t < n; t++) ws->cf[t] = scale * ds[t];
    else
        for (i64 t = 0; t < n; t++) ws->cf[t] = scale * ds[tp->col[t]] * tp->w[t];
    if (NV) SFX(gatherN)(dqi, kb, ws->row, ws->cf, n, 0, NV);
    else SFX(zero)(dqi, D), SFX(gather)(dqi, kb, ws->row, ws->cf, n, D);
    if (!dfrac || tp->one) return;
    /* d/d frac of a two-tap column: scale * dS * q.(k_hi - k_lo) + P * dout.(v_hi - v_lo);
     * ws->d still holds dout . v per tap (dS went to ws->s) */
    i64 m = 0;
    for (i64 t = 0; t + 1 < n; t++)                   /* the taps of two-tap columns */
        if (tp->col[t + 1] == tp->col[t]) ws->row[m] = ws->row[t], ws->row[m + 1] = ws->row[t + 1],
                                          ws->col[m / 2] = t, m += 2, t++;
    if (NV) SFX(dotsN)(qi, kb, ws->row, m, ws->d2, NV);  /* q . k per tap */
    else SFX(dots)(qi, kb, ws->row, m, D, ws->d2);
    for (i64 j = 0; j < m; j += 2) {
        const i64 t = ws->col[j / 2], c = tp->col[t];
        dfrac[c] += (double)(scale * ds[c] * (ws->d2[j + 1] - ws->d2[j]) + pi[c] * (ws->d[t + 1] - ws->d[t]));
    }
}

FA_INLINE void SFX(bwd_col)(REAL *restrict dkm, REAL *restrict dvm, const REAL *restrict qh,
                            const REAL *restrict gh_, const REAL *restrict ph, const REAL *restrict dsh,
                            const SFX(taps_t) *tp, SFX(ws_t) *ws, i64 m, int start, i64 end, i64 D, i64 C,
                            const i64 *lo, const REAL *whi, const int *two, i64 si, i64 sc, const int NV) {
    /* m's document is rows [m - its position, end); only its rows read m */
    i64 n = 0;
    for (; n < tp->n; n++) {                           /* query row m + off reads key row m */
        const i64 i = m + tp->off[n], c = tp->col[n];
        if (i >= end) break;
        ws->row[n] = i, ws->cf[n] = tp->w[n] * dsh[i * si + c * sc], ws->cf2[n] = tp->w[n] * ph[i * si + c * sc];
    }
    if (start && !tp->one)                             /* the second tap of row m + lo is clamped to row m */
        for (i64 c = 0; c < C && m + lo[c] < end; c++)
            if (two[c]) {
                const i64 i = m + lo[c];
                ws->row[n] = i, ws->cf[n] = whi[c] * dsh[i * si + c * sc], ws->cf2[n] = whi[c] * ph[i * si + c * sc];
                n++;
            }
    if (NV) SFX(gatherN)(dkm, qh, ws->row, ws->cf, n, 1, NV), SFX(gatherN)(dvm, gh_, ws->row, ws->cf2, n, 1, NV);
    else SFX(gather)(dkm, qh, ws->row, ws->cf, n, D), SFX(gather)(dvm, gh_, ws->row, ws->cf2, n, D);
}

/* dk, dv of key rows [m0, m1) without documents and m0 > 0 (no tap clamped), tap by tap over
 * sub-blocks of FA_SUB rows held in L1: each tap streams consecutive query rows and dS / P
 * values (by column) instead of one far row per tap; same sums in the same order as bwd_col. */
#define FA_SUB 16
FA_INLINE void SFX(bwd_block)(REAL *restrict dkb, REAL *restrict dvb, const REAL *restrict qh,
                              const REAL *restrict gh_, const REAL *restrict pth, const REAL *restrict dsth,
                              const SFX(taps_t) *tp, i64 m0, i64 m1, i64 T, i64 sc, const int NV) {
    const i64 D = (i64)NV * FA_VL;
    for (i64 s0 = m0; s0 < m1; s0 += FA_SUB) {
        const i64 s1 = fa_min(m1, s0 + FA_SUB);
        for (i64 t = 0; t < tp->n; t++) {
            const i64 off = tp->off[t], end = fa_min(s1, T - off);
            const REAL w = tp->w[t], *ds = dsth + tp->col[t] * sc + off, *p = pth + tp->col[t] * sc + off;
            for (i64 m = s0; m < end; m++) {
                const REAL a = w * ds[m], b = w * p[m];
                const REAL *qi = qh + (m + off) * D, *gi = gh_ + (m + off) * D;
                REAL *dkm = dkb + m * D, *dvm = dvb + m * D;
#pragma GCC unroll 16
                for (int c = 0; c < NV; c++) {
                    VST(dkm + c * FA_VL, VLD(dkm + c * FA_VL) + a * VLD(qi + c * FA_VL));
                    VST(dvm + c * FA_VL, VLD(dvm + c * FA_VL) + b * VLD(gi + c * FA_VL));
                }
            }
        }
    }
}

/* Gradients of fa_attn_fwd. dS (B,H,T,C) is scratch of the generic rows (the tiled ones keep
 * their own); when dfrac (C doubles) is non-NULL,
 * d loss / d f of each two-tap column is added to it, along (wlo, whi) = (1 - f, f). */
int SFX(fa_attn_bwd)(const REAL *q, const REAL *k, const REAL *v, const REAL *out, const REAL *dout,
                     const REAL *P, REAL *dS, REAL *dq, REAL *dk, REAL *dv, double *dfrac, i64 B, i64 H, i64 Hk,
                     i64 T, i64 D, i64 C, const i64 *lo, const REAL *wlo, const REAL *whi, const int *two,
                     REAL scale, const int32_t *dpos, int fast, int nt) {
    const i64 g = H / Hk, nb = (T + FA_BLOCK - 1) / FA_BLOCK;
    const int nvx = SFX(fixed_nv)(D, fast);
    SFX(taps_t) tp;
    if (C < 1 || lo[0] != 0) return 1;
    i64 *ends = dpos ? fa_doc_ends(dpos, B, T) : NULL;  /* where each row's document ends */
    /* d/d frac per (head, block), summed in a fixed order afterwards: bit-identical for any thread count */
    double *parts = dfrac ? calloc(B * Hk * nb * C + 1, sizeof(double)) : NULL;
    /* the tiled rows keep dS and a copy of P by column, (B, H, C, T), so that the key-row pass
     * reads each column's values for consecutive rows from consecutive addresses; the column
     * stride Tp is padded off multiples of 4 KiB so that one row's C values do not share a cache set */
    i64 Tp = (T + 15) / 16 * 16 + 16;
    if (Tp % 1024 == 0) Tp += 16;
    REAL *PT = nvx ? malloc(sizeof(REAL) * (2 * B * H * Tp * C + 1)) : NULL, *DST = PT ? PT + B * H * Tp * C : NULL;
    if ((dpos && !ends) || (dfrac && !parts) || (nvx && !PT) || SFX(taps_init)(&tp, C, lo, wlo, whi, two))
        return free(ends), free(parts), free(PT), 1;
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        SFX(ws_t) ws = {0};
        const int bad = SFX(ws_init)(&ws, C);
        /* pass 1, by query row: dS and dq */
#pragma omp for collapse(2) schedule(dynamic)
        for (i64 bh = 0; bh < B * Hk; bh++)
            for (i64 blk = 0; blk < nb; blk++) {
                if (bad) continue;
                const REAL *kb = k + bh * T * D, *vb = v + bh * T * D;
                const int32_t *pb = dpos ? dpos + (bh / Hk) * T : NULL;
                const i64 i0 = blk * FA_BLOCK, i1 = fa_min(T, i0 + FA_BLOCK);
                double *part = parts ? parts + (bh * nb + blk) * C : NULL;
                for (i64 gh = 0; gh < g; gh++) {
                    const i64 h = (bh / Hk) * H + (bh % Hk) * g + gh;
                    const i64 o = h * T * D, oc = h * T * C;
                    i64 nv = 0;
                    FA_WITH_NV(nvx, for (i64 i = i0; i < i1; i++) {
                        const i64 lim = pb ? pb[i] : i;
                        nv = SFX(nvalid)(nv, lim, C, lo);
                        SFX(bwd_row)(q + o + i * D, kb, vb, out + o + i * D, dout + o + i * D, P + oc + i * C,
                                     NV ? DST + h * C * Tp + i : dS + oc + i * C, NV ? PT + h * C * Tp + i : NULL,
                                     NV ? Tp : 1,
                                     dq + o + i * D, part, &tp, &ws, i, lim, nv, D, C, scale, NV);
                    })
                }
            }
        /* pass 2, by key row (after the implicit barrier): dk, dv in gather form */
#pragma omp for collapse(2) schedule(dynamic)
        for (i64 bh = 0; bh < B * Hk; bh++)
            for (i64 blk = 0; blk < nb; blk++) {
                if (bad) continue;
                const i64 i0 = blk * FA_BLOCK, i1 = fa_min(T, i0 + FA_BLOCK);
                const int32_t *pb = dpos ? dpos + (bh / Hk) * T : NULL;
                const i64 *eb = ends ? ends + (bh / Hk) * T : NULL;
                REAL *dkb = dk + bh * T * D, *dvb = dv + bh * T * D;
                for (i64 m = i0; m < i1; m++) SFX(zero)(dkb + m * D, D), SFX(zero)(dvb + m * D, D);
                for (i64 gh = 0; gh < g; gh++) {
                    const i64 h = (bh / Hk) * H + (bh % Hk) * g + gh;
                    const i64 o = h * T * D, oc = h * T * C;
                    FA_WITH_NV(nvx, if (NV && !dpos && i0 > 0)
                        SFX(bwd_block)(dkb, dvb, q + o, dout + o, PT + h * C * Tp, DST + h * C * Tp, &tp, i0, i1, T,
                                       Tp, NV);
                    else for (i64 m = i0; m < i1; m++)
                        SFX(bwd_col)(dkb + m * D, dvb + m * D, q + o, dout + o, NV ? PT + h * C * Tp : P + oc,
                                     NV ? DST + h * C * Tp : dS + oc, &tp, &ws, m,
                                     pb ? pb[m] == 0 : m == 0, eb ? eb[m] : T, D, C, lo, whi, two,
                                     NV ? 1 : C, NV ? Tp : 1, NV))
                }
                if (!nvx)                                /* the tiled rows' dS holds the factor */
                    for (i64 e = i0 * D; e < i1 * D; e++) dkb[e] *= scale;
            }
        if (bad) {
#pragma omp atomic write
            failed = 1;
        } else SFX(ws_free)(&ws);
    }
    if (parts && !failed)
        for (i64 j = 0; j < B * Hk * nb; j++)
            for (i64 c = 0; c < C; c++) dfrac[c] += parts[j * C + c];
    SFX(taps_free)(&tp);
    free(ends), free(parts), free(PT);
    return failed;
}

#endif
