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

int fa_abi_version(void) { return 10; }

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

/* Per-thread scratch: tap lists (row, column, weight) and per-tap / per-column values. */
typedef struct {
    i64 *row, *col;
    REAL *w, *d, *d2, *cf, *cf2, *s;
} SFX(ws_t);

static int SFX(ws_init)(SFX(ws_t) *ws, i64 C) {
    const i64 n = 3 * C + 4;
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
                            i64 lim, i64 nv, i64 D, i64 C, REAL scale) {
    const i64 n = tp->end[nv - 1];
    for (i64 t = 0; t < n; t++) ws->row[t] = i - fa_min(tp->off[t], lim);
    SFX(dots)(qi, kb, ws->row, n, D, ws->d);
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
    SFX(zero)(oi, D);
    SFX(gather)(oi, vb, ws->row, cf, n, D);
}

/* out = softmax(scale * q.k_cols) . v_cols;  P (B,H,T,C) keeps the probabilities. */
int SFX(fa_attn_fwd)(const REAL *q, const REAL *k, const REAL *v, REAL *out, REAL *P, i64 B, i64 H, i64 Hk,
                     i64 T, i64 D, i64 C, const i64 *lo, const REAL *wlo, const REAL *whi, const int *two,
                     REAL scale, const int32_t *dpos, int nt) {
    const i64 g = H / Hk, nb = (T + FA_BLOCK - 1) / FA_BLOCK;
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
                    for (i64 i = i0; i < i1; i++) {
                        const i64 lim = pb ? pb[i] : i;
                        nv = SFX(nvalid)(nv, lim, C, lo);
                        SFX(fwd_row)(qh + i * D, kb, vb, oh + i * D, ph + i * C, &tp, &ws, i, lim, nv, D, C, scale);
                    }
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
                            REAL *restrict dsi, REAL *restrict dqi, double *restrict dfrac, const SFX(taps_t) *tp,
                            SFX(ws_t) *ws, i64 i, i64 lim, i64 nv, i64 D, i64 C, REAL scale) {
    const i64 n = tp->end[nv - 1];
    for (i64 t = 0; t < n; t++) ws->row[t] = i - fa_min(tp->off[t], lim);
    const REAL delta = SFX(dot)(gi, oi, D);
    SFX(dots)(gi, vb, ws->row, n, D, ws->d);          /* dout . v per tap */
    REAL *ds = tp->one ? ws->d : ws->s;                /* dP per column, then dS = P (dP - delta) */
    if (!tp->one) {
        for (i64 c = 0; c < nv; c++) ds[c] = 0;
        for (i64 t = 0; t < n; t++) ds[tp->col[t]] += tp->w[t] * ws->d[t];
    }
    for (i64 c = 0; c < nv; c++) ds[c] = pi[c] * (ds[c] - delta), dsi[c] = ds[c];
    for (i64 c = nv; c < C; c++) dsi[c] = 0;
    if (tp->one)
        for (i64 t = 0; t < n; t++) ws->cf[t] = scale * ds[t];
    else
        for (i64 t = 0; t < n; t++) ws->cf[t] = scale * ds[tp->col[t]] * tp->w[t];
    SFX(zero)(dqi, D);
    SFX(gather)(dqi, kb, ws->row, ws->cf, n, D);
    if (!dfrac || tp->one) return;
    /* d/d frac of a two-tap column: scale * dS * q.(k_hi - k_lo) + P * dout.(v_hi - v_lo);
     * ws->d still holds dout . v per tap (dS went to ws->s) */
    i64 m = 0;
    for (i64 t = 0; t + 1 < n; t++)                   /* the taps of two-tap columns */
        if (tp->col[t + 1] == tp->col[t]) ws->row[m] = ws->row[t], ws->row[m + 1] = ws->row[t + 1],
                                          ws->col[m / 2] = t, m += 2, t++;
    SFX(dots)(qi, kb, ws->row, m, D, ws->d2);         /* q . k per tap */
    for (i64 j = 0; j < m; j += 2) {
        const i64 t = ws->col[j / 2], c = tp->col[t];
        dfrac[c] += (double)(scale * ds[c] * (ws->d2[j + 1] - ws->d2[j]) + pi[c] * (ws->d[t + 1] - ws->d[t]));
    }
}

FA_INLINE void SFX(bwd_col)(REAL *restrict dkm, REAL *restrict dvm, const REAL *restrict qh,
                            const REAL *restrict gh_, const REAL *restrict ph, const REAL *restrict dsh,
                            const SFX(taps_t) *tp, SFX(ws_t) *ws, i64 m, int start, i64 end, i64 D, i64 C,
                            const i64 *lo, const REAL *whi, const int *two) {
    /* m's document is rows [m - its position, end); only its rows read m */
    i64 n = 0;
    for (; n < tp->n; n++) {                           /* query row m + off reads key row m */
        const i64 i = m + tp->off[n], c = tp->col[n];
        if (i >= end) break;
        ws->row[n] = i, ws->cf[n] = tp->w[n] * dsh[i * C + c], ws->cf2[n] = tp->w[n] * ph[i * C + c];
    }
    if (start && !tp->one)                             /* the second tap of row m + lo is clamped to row m */
        for (i64 c = 0; c < C && m + lo[c] < end; c++)
            if (two[c]) {
                const i64 i = m + lo[c];
                ws->row[n] = i, ws->cf[n] = whi[c] * dsh[i * C + c], ws->cf2[n] = whi[c] * ph[i * C + c], n++;
            }
    SFX(gather)(dkm, qh, ws->row, ws->cf, n, D);
    SFX(gather)(dvm, gh_, ws->row, ws->cf2, n, D);
}

/* Gradients of fa_attn_fwd. dS (B,H,T,C) is scratch; when dfrac (C doubles) is non-NULL,
 * d loss / d f of each two-tap column is added to it, along (wlo, whi) = (1 - f, f). */
int SFX(fa_attn_bwd)(const REAL *q, const REAL *k, const REAL *v, const REAL *out, const REAL *dout,
                     const REAL *P, REAL *dS, REAL *dq, REAL *dk, REAL *dv, double *dfrac, i64 B, i64 H, i64 Hk,
                     i64 T, i64 D, i64 C, const i64 *lo, const REAL *wlo, const REAL *whi, const int *two,
                     REAL scale, const int32_t *dpos, int nt) {
    const i64 g = H / Hk, nb = (T + FA_BLOCK - 1) / FA_BLOCK;
    SFX(taps_t) tp;
    if (C < 1 || lo[0] != 0) return 1;
    i64 *ends = dpos ? fa_doc_ends(dpos, B, T) : NULL;  /* where each row's document ends */
    if ((dpos && !ends) || SFX(taps_init)(&tp, C, lo, wlo, whi, two)) return free(ends), 1;
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        SFX(ws_t) ws = {0};
        double *acc = dfrac ? calloc(C, sizeof(double)) : NULL;
        const int bad = SFX(ws_init)(&ws, C) || (dfrac && !acc);
        /* pass 1, by query row: dS and dq */
#pragma omp for collapse(2) schedule(dynamic)
        for (i64 bh = 0; bh < B * Hk; bh++)
            for (i64 blk = 0; blk < nb; blk++) {
                if (bad) continue;
                const REAL *kb = k + bh * T * D, *vb = v + bh * T * D;
                const int32_t *pb = dpos ? dpos + (bh / Hk) * T : NULL;
                const i64 i0 = blk * FA_BLOCK, i1 = fa_min(T, i0 + FA_BLOCK);
                for (i64 gh = 0; gh < g; gh++) {
                    const i64 h = (bh / Hk) * H + (bh % Hk) * g + gh;
                    const i64 o = h * T * D, oc = h * T * C;
                    i64 nv = 0;
                    for (i64 i = i0; i < i1; i++) {
                        const i64 lim = pb ? pb[i] : i;
                        nv = SFX(nvalid)(nv, lim, C, lo);
                        SFX(bwd_row)(q + o + i * D, kb, vb, out + o + i * D, dout + o + i * D, P + oc + i * C,
                                     dS + oc + i * C, dq + o + i * D, acc, &tp, &ws, i, lim, nv, D, C, scale);
                    }
                }
            }
        if (acc && !bad) {
#pragma omp critical
            for (i64 c = 0; c < C; c++) dfrac[c] += acc[c];
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
                    for (i64 m = i0; m < i1; m++)
                        SFX(bwd_col)(dkb + m * D, dvb + m * D, q + o, dout + o, P + oc, dS + oc, &tp, &ws, m,
                                     pb ? pb[m] == 0 : m == 0, eb ? eb[m] : T, D, C, lo, whi, two);
                }
                for (i64 e = i0 * D; e < i1 * D; e++) dkb[e] *= scale;
            }
        free(acc);
        if (bad) {
#pragma omp atomic write
            failed = 1;
        } else SFX(ws_free)(&ws);
    }
    SFX(taps_free)(&tp);
    free(ends);
    return failed;
}

#endif
