/* fibattn CPU kernels: banded (Toeplitz) sparse attention with OpenMP.
 *
 * Compiled on first use by cpu_backend.py (gcc -O2 -march=native -fopenmp; its float and double
 * halves at once, see FA_PART) and loaded with ctypes. Every kernel exists for float (suffix _f32)
 * and double (_f64): this file includes itself once per type with REAL / SFX / EXPR defined (keep
 * its name cpu_kernels.c).
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
 * of k and v is computed in gather form, y[m] = sum over rows m + d that read row m). The
 * backward's key-row pass of a block follows the query-row pass of the blocks that read it
 * (fa_attn_bwd); threads split the blocks as in fa_ranges.
 *
 * Vector rows (issue 29; head size 2, 3, 4, 5, 6, 8, 10, 12, 16 or 32 SIMD vectors, fast != 0, see lanes_t):
 * a row's column values live in SIMD lanes, so the scores, the softmax, dS and the coefficients are
 * whole-vector operations; the dots of FA_VL taps are summed by one transposing add tree, and the
 * sums over taps keep their accumulators in registers. A block of rows goes in phases (fwd_vblock,
 * bwd_vblock; the backward's key-row pass bwd_ktile): all its dots, a row at a time; the softmax
 * (or dS) in passes over all its rows; all its weighted sums, a row at a time with every tap (each
 * row of the output is written once, and the rows of the band are still in L1 from the row before).
 * Rows near their document start dot clamped rows for the columns they cannot see yet (masked
 * lanes); their weighted sums stop at their last valid column. d/d frac is summed per (head, block)
 * and then in a fixed order, so it is bit-identical for any thread count; its q . (k_hi - k_lo) comes
 * from the forward, which saves it next to P (the score slopes, G) for interpolated columns.
 */
#ifndef FA_BODY
#define FA_BODY
#include <math.h>
#include <omp.h>
#include <sched.h>
#if defined(__AVX__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int64_t i64;
#define FA_BLOCK 64
#define FA_MAXG 16 /* vector groups of a whole row (cpu_kernels.c, lanes_t) */
#define FA_INLINE static inline __attribute__((always_inline))

/* SIMD width in bytes for the GCC vector types of the hot loops (lowered to what the CPU has). A build
 * may set it: -DFA_VBYTES=64 on an AVX2 machine runs the AVX-512 width's lane logic on pairs of AVX2
 * registers (tests/test_cpu_vector_width.py checks that width where no AVX-512 CPU is at hand). */
#ifndef FA_VBYTES
#if defined(__AVX512F__)
#define FA_VBYTES 64
#else
#define FA_VBYTES 32
#endif
#endif
#define FA_VL (FA_VBYTES / FA_RBYTES)
/* The head sizes (in vectors, up to FA_LANE_NV) whose dots go a lane at a time (dotv): the lanes' sums
 * and the query row's vectors fit the FA_VREGS vector registers with 4 to spare (AVX-512's 32: fp32
 * rows of up to 12 vectors beside 16 sums; AVX2's 16: 4 beside 8). A build may set FA_VREGS (the
 * other-width test builds AVX-512's order with 32). */
#ifndef FA_VREGS
#if defined(__AVX512F__)
#define FA_VREGS 32
#else
#define FA_VREGS 16
#endif
#endif
#define FA_LANE_NV (FA_VREGS - 4 - FA_VL)

static inline i64 fa_max0(i64 x) { return x < 0 ? 0 : x; }
static inline i64 fa_min(i64 a, i64 b) { return a < b ? a : b; }

/* Streaming stores (VSTNT) take whole vectors at aligned addresses; a thread's are ordered before
 * the end of its parallel region by the fence. */
static inline int fa_aligned(const void *p) { return (uintptr_t)p % FA_VBYTES == 0; }
static inline void fa_fence(void) {
#if defined(__AVX__)
    _mm_sfence();
#endif
}

/* Ask for [p, p + bytes) in the L2 cache ahead of its use. */
static inline void fa_prefetch(const void *p, i64 bytes) {
    for (const char *c = (const char *)p; c < (const char *)p + bytes; c += 64) __builtin_prefetch(c, 0, 1);
}

/* out[j] = -min(off[j], lim) * D for j < n, four at a time: the element offsets of the rows that a
 * row near its document start reads (those past the start clamp to it). */
static inline void fa_row_offsets(i64 *restrict out, const i64 *restrict off, i64 n, i64 lim, i64 D) {
    typedef i64 v4 __attribute__((vector_size(32)));
    typedef i64 u4 __attribute__((vector_size(32), aligned(8), may_alias));
    const v4 l = {lim, lim, lim, lim};
    i64 j = 0;
    for (; j + 4 <= n; j += 4) {
        const v4 o = *(const u4 *)(off + j), m = o > l;
        *(u4 *)(out + j) = -((o & ~m) | (l & m)) * D;
    }
    for (; j < n; j++) out[j] = -fa_min(off[j], lim) * D;
}

#if !defined(FA_PART) || FA_PART == 1
int fa_abi_version(void) { return 14; }
#endif

/* ---------------------------------------------------------------- balanced work
 * The fused kernels' parallel loops run over units u = bh * nb + blk (one block of one key/value head),
 * split into nt contiguous ranges, one a thread, as a static schedule splits them: each thread streams
 * its heads, whose rows stay in its own caches. A thread takes its range from the front; once that is
 * empty, it takes units from the back of the other ranges (a steal). So a thread that the machine slows
 * (another process on its core, a shared host's neighbours) holds the others up by about one unit, not
 * by the difference in speed: on a 2-core guest at 4K, the busy times of the two threads of a static
 * schedule differed by 5-25 % from call to call. A range is (next, end) in one word, changed by CAS. */
typedef struct { uint64_t r; char pad[56]; } fa_range_t;

/* nt ranges over n units; NULL when out of memory or n does not fit a range's 32-bit halves. */
static fa_range_t *fa_ranges(i64 n, int nt) {
    fa_range_t *rs = n < ((i64)1 << 32) ? aligned_alloc(64, sizeof(fa_range_t) * (size_t)nt) : NULL;
    for (int t = 0; rs && t < nt; t++) rs[t].r = (uint64_t)(n * t / nt) << 32 | (uint64_t)(n * (t + 1) / nt);
    return rs;
}

/* The next unit of range r from its front (back: from its end), or -1 when it is empty. */
static inline i64 fa_take(fa_range_t *r, int back) {
    uint64_t cur = __atomic_load_n(&r->r, __ATOMIC_RELAXED);
    for (;;) {
        const i64 next = (i64)(cur >> 32), end = (i64)(cur & 0xffffffffu);
        if (next >= end) return -1;
        const uint64_t want = back ? (cur & ~(uint64_t)0xffffffffu) | (uint64_t)(end - 1) : cur + ((uint64_t)1 << 32);
        if (__atomic_compare_exchange_n(&r->r, &cur, want, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return back ? end - 1 : next;
    }
}

#ifdef FA_SLOW_THREAD   /* tests only (test_cpu_balance.py): this thread sleeps before each unit, the others steal */
#include <unistd.h>
__attribute__((weak)) long fa_steals;
#endif

/* Thread self's next unit: from its own range, else from the back of another's; -1 when none is left. */
static inline i64 fa_next(fa_range_t *rs, int nt, int self) {
#ifdef FA_SLOW_THREAD
    if (self == FA_SLOW_THREAD) usleep(300);
#endif
    i64 u = fa_take(rs + self, 0);
    for (int j = 1; u < 0 && j < nt; j++) {
        u = fa_take(rs + (self + j) % nt, 1);
#ifdef FA_SLOW_THREAD
        if (u >= 0) __atomic_add_fetch(&fa_steals, 1, __ATOMIC_RELAXED);
#endif
    }
    return u;
}

/* Wait a little: spin, then (more threads than cores, the awaited thread not running) give the core up. */
static inline void fa_pause(int spins) {
    if (spins > 256) sched_yield();
#if defined(__x86_64__) || defined(__i386__)
    else __builtin_ia32_pause();
#endif
}

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

/* FA_PART 1 or 2 builds only the float or only the double kernels (cpu_backend.py compiles the two at
 * once and links them); without it, both. */
#if !defined(FA_PART) || FA_PART == 1
#define REAL float
#define FA_RBYTES 4
#define SFX(x) x##_f32
#define EXPR expf
#include "cpu_kernels.c" /* this file again, with REAL defined */
#undef REAL
#undef FA_RBYTES
#undef SFX
#undef EXPR
#endif

#if !defined(FA_PART) || FA_PART == 2
#define REAL double
#define FA_RBYTES 8
#define SFX(x) x##_f64
#define EXPR exp
#include "cpu_kernels.c" /* this file again, with REAL defined */
#undef REAL
#undef FA_RBYTES
#undef SFX
#undef EXPR
#endif

#else /* ---------------------------------------------------------------- typed body */

/* Vector types: ``vec`` holds FA_VL values; ``uvec`` is its unaligned, aliasing twin for loads.
 * FA_SWAP1 / FA_SWAP2 swap neighbouring lanes / pairs of lanes. */
#if FA_VL == 16
#define FA_SWAP1 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14
#define FA_SWAP2 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13
#elif FA_VL == 8
#define FA_SWAP1 1, 0, 3, 2, 5, 4, 7, 6
#define FA_SWAP2 2, 3, 0, 1, 6, 7, 4, 5
#elif FA_VL == 4
#define FA_SWAP1 1, 0, 3, 2
#define FA_SWAP2 2, 3, 0, 1
#else
#define FA_SWAP1 1, 0
#endif
typedef REAL SFX(vec) __attribute__((vector_size(FA_VBYTES)));
typedef REAL SFX(uvec) __attribute__((vector_size(FA_VBYTES), aligned(FA_RBYTES), may_alias));
typedef REAL SFX(half) __attribute__((vector_size(FA_VBYTES / 2)));
typedef REAL SFX(quarter) __attribute__((vector_size(FA_VBYTES / 4)));
#if FA_RBYTES == 4
typedef int32_t SFX(ivec) __attribute__((vector_size(FA_VBYTES)));
#else
typedef int64_t SFX(ivec) __attribute__((vector_size(FA_VBYTES)));
#endif
/* lanes of a where m is true (all bits set), else lanes of b */
#define VSEL(m, a, b) ((SFX(vec))(((SFX(ivec))(a) & (m)) | ((SFX(ivec))(b) & ~(m))))
#define VLD(p) (*(const SFX(uvec) *)(p))
#define VST(p, x) (*(SFX(uvec) *)(p) = (x))
/* A streaming (non-temporal) store of a whole aligned vector: the line goes to memory without being
 * read first (see tapsums' stream) */
#if defined(__AVX512F__) && FA_VBYTES == 64 && FA_RBYTES == 4
#define VSTNT(p, x) _mm512_stream_ps((float *)(p), (__m512)(x))
#elif defined(__AVX512F__) && FA_VBYTES == 64
#define VSTNT(p, x) _mm512_stream_pd((double *)(p), (__m512d)(x))
#elif defined(__AVX__) && FA_VBYTES == 32 && FA_RBYTES == 4
#define VSTNT(p, x) _mm256_stream_ps((float *)(p), (__m256)(x))
#elif defined(__AVX__) && FA_VBYTES == 32
#define VSTNT(p, x) _mm256_stream_pd((double *)(p), (__m256d)(x))
#else
#define VSTNT(p, x) VST(p, x)
#endif

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

FA_INLINE REAL SFX(hmax)(SFX(vec) a) {
#define FA_MAX(x, y) VSEL((x) > (y), x, y)
#if FA_VL == 16
    a = FA_MAX(a, __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    a = FA_MAX(a, __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
#elif FA_VL == 8
    a = FA_MAX(a, __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3));
#endif
#if FA_VL >= 4
    a = FA_MAX(a, __builtin_shufflevector(a, a, FA_SWAP2));
#endif
    a = FA_MAX(a, __builtin_shufflevector(a, a, FA_SWAP1));
#undef FA_MAX
    return a[0];
}

/* x[0..n) to y[0..n), 0 <= n <= FA_VL (masked: nothing past y + n is touched) */
FA_INLINE void SFX(vstore_n)(REAL *y, SFX(vec) x, i64 n) {
    if (n >= FA_VL) {
        VST(y, x);
        return;
    }
#if defined(__AVX512F__) && FA_VBYTES == 64 && FA_RBYTES == 4
    _mm512_mask_storeu_ps(y, (__mmask16)((1u << n) - 1), (__m512)x);
#elif defined(__AVX512F__) && FA_VBYTES == 64
    _mm512_mask_storeu_pd(y, (__mmask8)((1u << n) - 1), (__m512d)x);
#elif defined(__AVX__) && FA_VBYTES == 32 && FA_RBYTES == 4
    const SFX(ivec) lane = {0, 1, 2, 3, 4, 5, 6, 7};
    _mm256_maskstore_ps(y, (__m256i)(lane < (int32_t)n), (__m256)x);
#elif defined(__AVX__) && FA_VBYTES == 32
    const SFX(ivec) lane = {0, 1, 2, 3};
    _mm256_maskstore_pd(y, (__m256i)(lane < (int64_t)n), (__m256d)x);
#else
    for (i64 l = 0; l < n; l++) y[l] = x[l];
#endif
}

/* y[0..n) in the first n lanes, 0 in the others (masked: nothing past y + n is read) */
FA_INLINE SFX(vec) SFX(vload_n)(const REAL *y, i64 n) {
    if (n >= FA_VL) return VLD(y);
#if defined(__AVX512F__) && FA_VBYTES == 64 && FA_RBYTES == 4
    return (SFX(vec))_mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), y);
#elif defined(__AVX512F__) && FA_VBYTES == 64
    return (SFX(vec))_mm512_maskz_loadu_pd((__mmask8)((1u << n) - 1), y);
#elif defined(__AVX__) && FA_VBYTES == 32 && FA_RBYTES == 4
    const SFX(ivec) lane = {0, 1, 2, 3, 4, 5, 6, 7};
    return (SFX(vec))_mm256_maskload_ps(y, (__m256i)(lane < (int32_t)n));
#elif defined(__AVX__) && FA_VBYTES == 32
    const SFX(ivec) lane = {0, 1, 2, 3};
    return (SFX(vec))_mm256_maskload_pd(y, (__m256i)(lane < (int64_t)n));
#else
    SFX(vec) x = {0};
    for (i64 l = 0; l < n; l++) x[l] = y[l];
    return x;
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
 * Dots with the head size a compile-time constant (NV vectors of FA_VL; FA_WITH_NV makes one
 * fully unrolled copy per size): accumulators stay in registers, and the dots of FA_VL rows
 * are summed by one transposing add tree instead of a horizontal sum each. */

/* Lane l of the result = the sum of a[rev(l)] (rev: bit reversal of the lane index), so the
 * callers store row j in a[rev(j)]. Each level halves the vector count with two shuffles. */
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
#pragma GCC unroll 8
    for (int j = 0; j < FA_VL / 2; j++) w[j] = FA_L1(a[2 * j], a[2 * j + 1]);
#if FA_VL >= 8
    SFX(vec) x[FA_VL / 4];
#pragma GCC unroll 4
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

static const int SFX(rev)[FA_VL] = FA_REV;

/* The dots of one query row x with the FA_VL rows at bi + noff[rev[l]] (lane l; noff holds
 * element offsets, in the tree's order), in one vector. */
FA_INLINE SFX(vec) SFX(dotv)(const REAL *restrict x, const REAL *restrict bi, const i64 *restrict noff,
                            const int NV) {
    const SFX(uvec) *r[FA_VL];
    SFX(vec) a[FA_VL];
    __asm__("" : "+r"(x));       /* opaque: x's vectors are loaded here, not hoisted out of the caller's
                                  * loop over groups into registers that the accumulators then lack */
    if (NV <= FA_LANE_NV) {
        /* a lane at a time, x's vectors held: one row pointer live instead of FA_VL (with 16 lanes,
         * the whole of x86-64's general registers: they spill, tools/cpu_static.py), fewer address
         * computations, the same sums in the same order */
        SFX(vec) xs[FA_LANE_NV > 0 ? FA_LANE_NV : 1];
#pragma GCC unroll 32
        for (int c = 0; c < NV; c++) xs[c] = VLD(x + c * FA_VL);
#pragma GCC unroll 16
        for (int j = 0; j < FA_VL; j++) {
            const SFX(uvec) *rj = (const SFX(uvec) *)(bi + noff[j]);
            SFX(vec) s = (SFX(vec)){0};
#pragma GCC unroll 32
            for (int c = 0; c < NV; c++) s += xs[c] * rj[c];
            a[j] = s;
        }
        return SFX(tree)(a);
    }
#pragma GCC unroll 16
    for (int j = 0; j < FA_VL; j++) r[j] = (const SFX(uvec) *)(bi + noff[j]), a[j] = (SFX(vec)){0};
#pragma GCC unroll 16
    for (int c = 0; c < NV; c++) {
        const SFX(vec) xc = VLD(x + c * FA_VL);
#pragma GCC unroll 16
        for (int j = 0; j < FA_VL; j++) a[j] += xc * r[j][c];
    }
    return SFX(tree)(a);
}

/* dotv for the first n lanes only (0 in the others): a row's last group of dot lanes. Up to half the
 * lanes, each is one dot and a horizontal sum (a 33rd lane is 8 FMAs, not another group of 64). */
FA_INLINE SFX(vec) SFX(dotv_n)(const REAL *restrict x, const REAL *restrict bi, const i64 *restrict noff, int n,
                              const int NV) {
    if (n > FA_VL / 2) return SFX(dotv)(x, bi, noff, NV);
    SFX(vec) t = {0}, lane;
    for (int l = 0; l < FA_VL; l++) lane[l] = (REAL)l;
    for (int l = 0; l < n; l++) {       /* lane by lane in registers (an array on the stack: tools/cpu_static.py) */
        const SFX(uvec) *rl = (const SFX(uvec) *)(bi + noff[SFX(rev)[l]]);   /* rev is its own inverse */
        SFX(vec) s = (SFX(vec)){0};
#pragma GCC unroll 32
        for (int c = 0; c < NV; c++) s += VLD(x + c * FA_VL) * rl[c];
        t = VSEL(lane == (REAL)l, t - t + SFX(hsum)(s), t);
    }
    return t;
}
#undef FA_REV
#undef FA_L1
#undef FA_L2
#undef FA_L3
#undef FA_L4

/* Per-thread scratch: tap lists (row, column, weight) and per-tap / per-column values. */
typedef struct {
    i64 *row, *col, *tab;        /* tab: a vector row's clamped dot-lane offsets (FA_MAXG * FA_VL) */
    REAL *w, *d, *d2, *cf, *cf2, *s;
    SFX(vec) *blk;               /* a block of vector rows: FA_BLOCK rows of 2 * FA_MAXG vectors, then their
                                  * coefficients (FA_MAXG * FA_VL each) */
} SFX(ws_t);

static int SFX(ws_init)(SFX(ws_t) *ws, i64 C) {
    const i64 n = 3 * C + 4;
    ws->row = malloc(sizeof(i64) * (2 * n + FA_MAXG * FA_VL));
    ws->w = malloc(sizeof(REAL) * 6 * n);
    ws->blk = aligned_alloc(64, sizeof(SFX(vec)) * FA_BLOCK * 3 * FA_MAXG);
    if (!ws->row || !ws->w || !ws->blk) {
        free(ws->row), free(ws->w), free(ws->blk);
        ws->row = NULL, ws->w = NULL, ws->blk = NULL;
        return 1;
    }
    /* colmix reads a few lanes past a row's dots, with weight 0: finite there, never written */
    memset(ws->blk, 0, sizeof(SFX(vec)) * FA_BLOCK * 2 * FA_MAXG);
    ws->col = ws->row + n, ws->tab = ws->row + 2 * n;
    ws->d = ws->w + n, ws->d2 = ws->w + 2 * n, ws->cf = ws->w + 3 * n, ws->cf2 = ws->w + 4 * n;
    ws->s = ws->w + 5 * n;
    return 0;
}

static void SFX(ws_free)(SFX(ws_t) *ws) { free(ws->row), free(ws->w), free(ws->blk); }

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

/* exp of each lane, x <= 0 (float: Cody-Waite reduction and a degree-6 polynomial, ~1 ulp; x is
 * clamped at -87, so exp(-inf) is ~1e-38, not 0: callers mask lanes that must vanish). */
FA_INLINE SFX(vec) SFX(vexp)(SFX(vec) x) {
#if FA_RBYTES == 4
    x = VSEL(x < -87.0f, (SFX(vec)){0} - 87.0f, x);
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
    return y * two_k;
#else
    for (int l = 0; l < FA_VL; l++) x[l] = EXPR(x[l]);
    return x;
#endif
}

/* s[c] = exp(scale * (s[c] - max)) / sum for c < n (n >= 1). */
static void SFX(softmax)(REAL *restrict s, i64 n, REAL scale) {
    REAL mx = s[0], sum = 0;
    for (i64 c = 1; c < n; c++) mx = s[c] > mx ? s[c] : mx;
    for (i64 c0 = 0; c0 < n; c0 += FA_VL) {
        SFX(vec) x;
        for (i64 l = 0; l < FA_VL; l++) x[l] = c0 + l < n ? (s[c0 + l] - mx) * scale : -87;
        const SFX(vec) y = SFX(vexp)(x);
        for (i64 l = 0; l < FA_VL && c0 + l < n; l++) s[c0 + l] = y[l], sum += y[l];
    }
    const REAL inv = 1 / sum;
    for (i64 c = 0; c < n; c++) s[c] *= inv;
}

/* ---------------------------------------------------------------- whole rows in vectors
 * Rows keep their column values in vectors: column c is lane c % FA_VL of group c / FA_VL. A row's
 * dots fill lanes densely: first the C1 columns' first taps (dot lane c), then the second taps of
 * the two-tap columns (a run, c0 up: column c's at dot lane c + hsh), and only the last group's used
 * lanes are dotted (dotv_n). A group of second taps per column group left lanes idle: the bench's 33 taps
 * (integer 23) took five groups of 8 lanes, now four and one lane (with 16 lanes: four groups, now two
 * and one lane); the interpolated op took 0.93-0.94x the time at Dh 32 and 128, 0.99x at 64 (AVX2).
 * The column mixes read a group's second taps at its lanes + hsh (colmix; single-tap lanes there
 * weigh 0). Scores, softmax and the column coefficients are whole-vector operations, invalid columns
 * (lo > lim) masked lanes. */
typedef struct {
    int ok, G1, Gd, tail;        /* usable at all; groups of columns; groups of dots, the last's lanes */
    int hig[FA_MAXG];            /* where group g's second-tap coefficients go (cf + hig[g] * FA_VL), or -1 */
    i64 hsh;                     /* column c's second tap is dot lane c + hsh */
    i64 C1, maxoff, n1;          /* columns that can be valid (lo < T), largest dot offset, their sums' taps */
    i64 nl;                      /* lane row offsets: Gd groups of dots, then per group with a hig, its columns'
                                  * second taps (offr + (Gd + hig[g] - G1) * FA_VL; bwd_vmid without slopes) */
    i64 offr[FA_MAXG * FA_VL];   /* each dot lane's row offset, lanes in dotv's order */
    i64 noff[FA_MAXG * FA_VL];   /* -offr * D: the element offsets of an unclamped row */
    /* The weighted sums' taps (tapsums): the column set's taps but a second tap of weight 0 (frac = 0, an
     * integer alpha * b), which adds nothing there (its dot stays: the alpha gradient's slope needs it) */
    i64 lane[2 * FA_MAXG * FA_VL];/* tap t's coefficient lane */
    i64 tnoff[2 * FA_MAXG * FA_VL];/* tap t's byte offset -off * D * sizeof(REAL) (tapsums: its query row) */
    i64 tpoff[2 * FA_MAXG * FA_VL];/* -tnoff: the reader row's, from the key row (bwd_ktile) */
    i64 toff[2 * FA_MAXG * FA_VL], tcix[2 * FA_MAXG * FA_VL];   /* tap t's offset; off * C + col (bwd_ktile) */
    REAL tw[2 * FA_MAXG * FA_VL];/* tap t's weight */
    i64 tend[FA_MAXG * FA_VL];   /* the taps of columns 0..c */
    int ident;                   /* tap t's coefficient is lane t (no two-tap column) */
    REAL wlo[FA_MAXG * FA_VL], whi[FA_MAXG * FA_VL], idx[FA_MAXG * FA_VL]; /* idx: the column, exact */
    char two[FA_MAXG * FA_VL];   /* the column has a second tap (whi may still be 0: frac = 0) */
} SFX(lanes_t);

/* The vector groups that hold nv lanes (a row's valid columns: a prefix). */
FA_INLINE int SFX(ngroups)(i64 nv) { return (int)((nv + FA_VL - 1) / FA_VL); }

static void SFX(lanes_init)(SFX(lanes_t) *L, const SFX(taps_t) *tp, i64 C, i64 T, i64 D, const i64 *lo,
                            const REAL *wlo, const REAL *whi, const int *two) {
    memset(L, 0, sizeof *L);
    i64 off[FA_MAXG * FA_VL] = {0}, C1 = 0, c0 = -1, n2 = 0;
    while (C1 < C && lo[C1] < T) C1++;
    for (i64 c = 0; c < C1; c++)          /* the second taps' lanes need the two-tap columns in one run */
        if (two[c]) {
            if (c0 >= 0 && !two[c - 1]) return;   /* not so (host_columns never does this): the generic rows */
            c0 = c0 < 0 ? c : c0, n2++;
        }
    const int G1 = SFX(ngroups)(C1), Gd = SFX(ngroups)(C1 + n2);
    int G = G1;
    for (int g = 0; g < G1; g++) {
        int any = 0;
        for (i64 c = g * FA_VL; c < (g + 1) * FA_VL && c < C1; c++) any |= two[c];
        L->hig[g] = any ? G++ : -1;
    }
    if (C1 < 1 || Gd + G - G1 > FA_MAXG) return;
    L->hsh = c0 < 0 ? 0 : C1 - c0;
    for (int g = 0; g < G1; g++)
        for (int l = 0; l < FA_VL; l++) {
            const i64 c = g * FA_VL + l, u = c < C1;
            if (u) off[c] = lo[c];
            if (u && two[c]) off[c + L->hsh] = lo[c] + 1;
            L->idx[c] = (REAL)c;
            L->wlo[c] = u ? (two[c] ? wlo[c] : 1) : 0, L->whi[c] = u && two[c] ? whi[c] : 0;
            L->two[c] = u && two[c];
            if (L->hig[g] >= 0) off[(Gd + L->hig[g] - G1) * FA_VL + l] = u ? lo[c] + (two[c] != 0) : 0;
        }
    for (int g = 0; g < Gd + G - G1; g++)
        for (int j = 0; j < FA_VL; j++) L->offr[g * FA_VL + j] = off[g * FA_VL + SFX(rev)[j]];
    L->nl = (i64)(Gd + G - G1) * FA_VL, L->Gd = Gd, L->tail = (int)(C1 + n2 - (Gd - 1) * FA_VL);
    for (i64 j = 0; j < L->nl; j++) L->noff[j] = -L->offr[j] * D;
    i64 n = 0;
    for (i64 t = 0; t < tp->end[C1 - 1]; t++) {
        const i64 c = tp->col[t], g = c / FA_VL;
        const int hi = t > 0 && tp->col[t - 1] == c;
        if (hi && tp->w[t] == 0) continue;
        L->lane[n] = hi ? L->hig[g] * FA_VL + c % FA_VL : c;
        L->toff[n] = tp->off[t], L->tcix[n] = tp->off[t] * C + c, L->tw[n] = tp->w[t];
        L->tpoff[n] = tp->off[t] * D * (i64)sizeof(REAL), L->tnoff[n] = -L->tpoff[n];
        L->tend[c] = ++n;
    }
    L->n1 = n, L->ident = 1;
    for (i64 t = 0; t < L->n1; t++) L->ident &= L->lane[t] == t;
    L->maxoff = tp->off[tp->end[C1 - 1] - 1], L->C1 = C1, L->G1 = G1, L->ok = 1;
}

/* tapsums' coefficient lanes of the taps: NULL (lane t) without two-tap columns. */
FA_INLINE const i64 *SFX(tap_lanes)(const SFX(lanes_t) *L) { return L->ident ? NULL : L->lane; }

/* The lanes of column group g that are valid columns of a row with fnv of them (a prefix). */
FA_INLINE SFX(ivec) SFX(valid)(const SFX(lanes_t) *L, int g, REAL fnv) { return VLD(L->idx + g * FA_VL) < fnv; }

/* The second-tap dots of column group g's lanes, from a row's dots d (block_dots; only the lanes of
 * two-tap columns are theirs). */
FA_INLINE SFX(vec) SFX(dhi)(const SFX(vec) *d, const SFX(lanes_t) *L, int g) {
    return VLD((const REAL *)d + g * FA_VL + L->hsh);
}

/* Column values wlo * dlo + whi * dhi from a row's dots d (dlo alone in groups of single-tap columns);
 * s may be d: group g's second taps lie at or past its own lanes. */
FA_INLINE void SFX(colmix)(SFX(vec) *s, const SFX(vec) *d, const SFX(lanes_t) *L, int ng) {
    for (int g = 0; g < ng; g++)
        if (L->hig[g] >= 0) s[g] = VLD(L->wlo + g * FA_VL) * d[g] + VLD(L->whi + g * FA_VL) * SFX(dhi)(d, L, g);
        else s[g] = d[g];
}

/* Store the column vectors to y[0..C) (their lanes past C1 hold 0), zeros past them. */
FA_INLINE void SFX(put_cols)(REAL *restrict y, const SFX(vec) *x, const SFX(lanes_t) *L, i64 C) {
    for (int g = 0; g < L->G1; g++) SFX(vstore_n)(y + g * FA_VL, x[g], C - g * FA_VL);
    for (i64 c = (i64)L->G1 * FA_VL; c < C; c += FA_VL) SFX(vstore_n)(y + c, (SFX(vec)){0}, C - c);
}

/* cf[lane] = p * wlo on column lanes, p * whi on hi lanes (times f). */
FA_INLINE void SFX(coefs)(REAL *restrict cf, const SFX(vec) *p, const SFX(lanes_t) *L, REAL f) {
    for (int g = 0; g < L->G1; g++) {
        VST(cf + g * FA_VL, f * p[g] * VLD(L->wlo + g * FA_VL));
        if (L->hig[g] >= 0) VST(cf + L->hig[g] * FA_VL, f * p[g] * VLD(L->whi + g * FA_VL));
    }
}

/* The middle of the forward for rows [i0, i1), from their dots in blk (block_dots' layout): softmax(scale * s)
 * over each row's nvs valid columns (a prefix) to ph, 0 in the others; the tap coefficients to cb (a row
 * each FA_MAXG * FA_VL); and (gh non-NULL) the score slopes q . (k_hi - k_lo) for the alpha gradient to gh,
 * in the valid lanes of the column groups with a hi group (0 elsewhere: the saved state is an output of
 * the op, so every value is defined). Three passes over the rows (masked max; exp and sum; scale and
 * store) instead of one row at a time: a pass's rows are independent, so the core overlaps their
 * dependency chains (the max across lanes, exp, 1 / sum), which one row at a time left it waiting on. */
FA_INLINE void SFX(fwd_vmids)(SFX(vec) *restrict blk, REAL *restrict ph, REAL *restrict gh, REAL *restrict cb,
                              const SFX(lanes_t) *L, const i64 *restrict nvs, i64 i0, i64 i1, i64 C, REAL scale) {
    REAL mx[FA_BLOCK], inv[FA_BLOCK];
    for (i64 i = i0; i < i1; i++) {
        SFX(vec) *s = blk + (i - i0) * 2 * FA_MAXG, m = {0};
        const REAL fnv = (REAL)nvs[i - i0];
        const int ng = SFX(ngroups)(nvs[i - i0]);
        if (gh) {
            SFX(vec) sl[FA_MAXG];
            for (int g = 0; g < L->G1; g++)
                sl[g] = g < ng && L->hig[g] >= 0
                            ? VSEL(SFX(valid)(L, g, fnv), SFX(dhi)(s, L, g) - s[g], (SFX(vec)){0}) : (SFX(vec)){0};
            SFX(put_cols)(gh + i * C, sl, L, C);
        }
        SFX(colmix)(s, s, L, ng);
        m -= (REAL)INFINITY;
        for (int g = 0; g < ng; g++)       /* invalid lanes take the running max: they leave it as it is */
            s[g] = VSEL(SFX(valid)(L, g, fnv), s[g], m), m = VSEL(s[g] > m, s[g], m);
        for (int g = ng; g < L->G1; g++) s[g] = (SFX(vec)){0};
        mx[i - i0] = SFX(hmax)(m);
    }
    for (i64 i = i0; i < i1; i++) {
        SFX(vec) *s = blk + (i - i0) * 2 * FA_MAXG, sum = {0};
        const REAL fnv = (REAL)nvs[i - i0];
        for (int g = 0; g < SFX(ngroups)(nvs[i - i0]); g++)
            s[g] = VSEL(SFX(valid)(L, g, fnv), SFX(vexp)((s[g] - mx[i - i0]) * scale), (SFX(vec)){0}),
            sum += s[g];
        inv[i - i0] = 1 / SFX(hsum)(sum);
    }
    for (i64 i = i0; i < i1; i++) {
        SFX(vec) *s = blk + (i - i0) * 2 * FA_MAXG;
        for (int g = 0; g < SFX(ngroups)(nvs[i - i0]); g++) s[g] *= inv[i - i0];
        if (ph) SFX(put_cols)(ph + i * C, s, L, C);
        SFX(coefs)(cb + (i - i0) * FA_MAXG * FA_VL, s, L, 1);
    }
}

/* One tap loop of tapsums: a[c] += COEF * (the row at byte offset OFF from x), c < nc, for t < nt. */
#define FA_TAPS(COEF, OFF)                                                                         \
    for (i64 t = 0; t < nt; t++) {                                                                 \
        const REAL ct = (COEF);                                                                    \
        const REAL *xr = (const REAL *)(x + (OFF));                                                \
        _Pragma("GCC unroll 8") for (int c = 0; c < nc; c++) a[c] += ct * VLD(xr + c * FA_VL);     \
    }

/* Rows [m0, m1) of y += sum_t c_t(m) x[row of tap t] over a row's taps (nm[m - m0] of them, none when -1;
 * n when nm is NULL): tap t's row at byte offset xo[t] from row m's (lanes_t's tnoff or tpoff);
 * coefficients c_t(m) = w[t] * cv[co[t]], cv = cb + (m - m0) * cs (w NULL: 1; co NULL: cv[t]); init: y
 * starts at 0 instead of its stored value. stream: y's rows are final and go to memory by streaming
 * stores (y aligned to the vector size): an output too large for the caches skips the read of each
 * of its lines that a plain store makes first (a fifth of the backward's memory traffic; at 4K the
 * op took 0.92x the time, at 1K and 16K 0.93x). With lims (each row's limit, see the top of this file), a
 * tap past the row's document start reads the start row (only a last valid column's second tap does:
 * the callers drop the taps of invalid columns).
 * A row at a time with all its taps, its sums in registers: y goes through the caches once, and the tap
 * rows near m are still in L1 from the rows before (by groups of taps over all the rows, each group read
 * and wrote y again from L2 at 32 B a cycle on Zen 3: the forward took 1.06x). The loop is picked per
 * row, so the common ones carry no test: a tap of the forward's integer columns is its 8 FMAs (Dh 64,
 * AVX2) and 5 instructions, against 18 with the tests and clamps inside (one thread at 4K, those made
 * the forward 1.06x slower; with two threads, where the rows far back come from L3, 1.03x). */
FA_INLINE void SFX(tapsums)(REAL *restrict yb, const REAL *restrict xb, const REAL *restrict cb, i64 cs,
                            const i64 *restrict xo, const i64 *restrict co, const REAL *restrict w, int init,
                            int stream, i64 n, i64 m0, i64 m1, const i64 *restrict nm, const i64 *restrict lims,
                            const int NV) {
    const i64 D = (i64)NV * FA_VL;
    enum { CH = 8 };                                  /* vectors of a row in registers at once */
    for (i64 m = m0; m < m1; m++) {
        const i64 nt = nm ? nm[m - m0] : n, lim = lims ? lims[m - m0] * D * (i64)sizeof(REAL) : 0;
        const int clamp = lims && nt > 0 && -xo[nt - 1] > lim;
        REAL *y = yb + m * D;
        const REAL *cv = cb + (m - m0) * cs;
        for (int c0 = 0; c0 < NV && nt >= 0; c0 += CH) {
            const int nc = NV - c0 < CH ? NV - c0 : CH;
            const char *x = (const char *)(xb + m * D + c0 * FA_VL);
            SFX(vec) a[CH];
#pragma GCC unroll 8
            for (int c = 0; c < nc; c++) a[c] = init ? (SFX(vec)){0} : (SFX(vec))VLD(y + (c0 + c) * FA_VL);
            if (clamp) FA_TAPS(w ? w[t] * cv[co ? co[t] : t] : cv[co ? co[t] : t], -fa_min(-xo[t], lim))
            else if (!co && !w) FA_TAPS(cv[t], xo[t])
            else if (!w) FA_TAPS(cv[co[t]], xo[t])
            else FA_TAPS(w[t] * cv[co ? co[t] : t], xo[t])
            if (stream) {
#pragma GCC unroll 8
                for (int c = 0; c < nc; c++) VSTNT(y + (c0 + c) * FA_VL, a[c]);
            } else {
#pragma GCC unroll 8
                for (int c = 0; c < nc; c++) VST(y + (c0 + c) * FA_VL, a[c]);
            }
        }
    }
}
#undef FA_TAPS

/* The dots of rows [i0, i1) of x with their lane rows of base, a row at a time (its q row and the band's
 * rows stay in L1; by lane groups over all the rows, each group read them again from L2: 1.07x the
 * forward): row m's Gd groups of dot lanes (lanes_t) at blk[m * 2 * FA_MAXG].
 * lims (or NULL: no row reaches its document start): the rows' limits; a row whose taps reach its
 * document start reads clamped rows (its lane offsets, clamped four at a time). */
FA_INLINE void SFX(block_dots)(SFX(vec) *restrict blk, const SFX(lanes_t) *L, const REAL *restrict x,
                               const REAL *restrict base, i64 i0, i64 i1, const i64 *restrict lims, const int NV) {
    const i64 D = (i64)NV * FA_VL;
    for (i64 m = i0; m < i1; m++) {
        const i64 *ln = L->noff;
        i64 tab[FA_MAXG * FA_VL];
        if (lims && lims[m - i0] < L->maxoff)
            fa_row_offsets(tab, L->offr, L->Gd * FA_VL, lims[m - i0], D), ln = tab;  /* the dots' lanes only */
        SFX(vec) *d = blk + (m - i0) * 2 * FA_MAXG;
        for (int g = 0; g < L->Gd; g++)
            d[g] = SFX(dotv_n)(x + m * D, base + m * D, ln + g * FA_VL, g + 1 < L->Gd ? FA_VL : L->tail, NV);
    }
}

/* The limits (lims), valid column counts (nvs) and the taps of those columns (nts) of rows [i0, i1)
 * (pb: the positions in their documents, or NULL); returns whether some row reaches its document start. */
FA_INLINE int SFX(block_rows)(i64 *restrict lims, i64 *restrict nvs, i64 *restrict nts, const int32_t *pb,
                              const SFX(lanes_t) *L, i64 i0, i64 i1, i64 C, const i64 *lo) {
    int clamped = 0;
    for (i64 i = i0, nv = 0; i < i1; i++) {
        lims[i - i0] = pb ? pb[i] : i;
        nvs[i - i0] = nv = SFX(nvalid)(nv, lims[i - i0], C, lo);
        nts[i - i0] = L->tend[nv - 1];
        clamped |= lims[i - i0] < L->maxoff;
    }
    return clamped;
}

/* Rows [i0, i1) of one head's forward (pb: positions in documents, or NULL): the block's dots, then its
 * softmax, then its weighted sums (a row's dots, softmax and sums one after the other took 1.13x: each
 * waited on the one before). Every row dots all C1 columns (those of invalid columns read clamped
 * rows and are masked); its sums take the taps of its valid columns only (nts). ws->blk holds the
 * block's dots and coefficients. */
FA_INLINE void SFX(fwd_vblock)(const REAL *restrict qh, const REAL *restrict kb, const REAL *restrict vb,
                               REAL *restrict oh, REAL *restrict ph, REAL *restrict gh, const int32_t *pb,
                               const SFX(lanes_t) *L, SFX(vec) *restrict blk, i64 i0, i64 i1, i64 C, const i64 *lo,
                               REAL scale, int stream, const int NV) {
    REAL *cb = (REAL *)(blk + FA_BLOCK * 2 * FA_MAXG);
    i64 lims[FA_BLOCK], nvs[FA_BLOCK], nts[FA_BLOCK];
    const i64 *cl = SFX(block_rows)(lims, nvs, nts, pb, L, i0, i1, C, lo) ? lims : NULL;
    SFX(block_dots)(blk, L, qh, kb, i0, i1, cl, NV);
    SFX(fwd_vmids)(blk, ph, gh, cb, L, nvs, i0, i1, C, scale);
    SFX(tapsums)(oh, vb, cb, FA_MAXG * FA_VL, L->tnoff, SFX(tap_lanes)(L), NULL, 1, stream, L->n1, i0, i1, nts, cl,
                 NV);
}

FA_INLINE void SFX(fwd_row)(const REAL *restrict qi, const REAL *restrict kb, const REAL *restrict vb,
                            REAL *restrict oi, REAL *restrict pi, REAL *restrict gi, const SFX(taps_t) *tp,
                            SFX(ws_t) *ws, i64 i, i64 lim, i64 nv, i64 D, i64 C, REAL scale) {
    const i64 n = tp->end[nv - 1];
    for (i64 t = 0; t < n; t++) ws->row[t] = i - fa_min(tp->off[t], lim);
    SFX(dots)(qi, kb, ws->row, n, D, ws->d);
    if (gi) SFX(zero)(gi, C);
    for (i64 t = 0; gi && t + 1 < n; t++)              /* score slopes, as in fwd_vmids */
        if (tp->col[t + 1] == tp->col[t]) gi[tp->col[t]] = ws->d[t + 1] - ws->d[t], t++;
    REAL *s = tp->one ? ws->d : ws->s;                  /* scores per column */
    if (!tp->one) {
        for (i64 c = 0; c < nv; c++) s[c] = 0;
        for (i64 t = 0; t < n; t++) s[tp->col[t]] += tp->w[t] * ws->d[t];
    }
    SFX(softmax)(s, nv, scale);
    for (i64 c = 0; pi && c < nv; c++) pi[c] = s[c];
    for (i64 c = nv; pi && c < C; c++) pi[c] = 0;
    const REAL *cf = s;
    if (!tp->one) {
        for (i64 t = 0; t < n; t++) ws->cf[t] = s[tp->col[t]] * tp->w[t];
        cf = ws->cf;
    }
    SFX(zero)(oi, D), SFX(gather)(oi, vb, ws->row, cf, n, D);
}

/* Runs the statement with the constant NV = nvx: one inlined copy per supported size (NV = 0 for any
 * other: the generic rows). This list is the only one: fixed_nv reads it too. Each size costs one more
 * copy of the kernels to compile (all nine take about twice the time of four). */
#define FA_WITH_NV(nvx, ...)                                                                     \
    switch (nvx) {                                                                                \
    case 2: { const int NV = 2; __VA_ARGS__; } break;                                                  \
    case 3: { const int NV = 3; __VA_ARGS__; } break;                                                  \
    case 4: { const int NV = 4; __VA_ARGS__; } break;                                                  \
    case 5: { const int NV = 5; __VA_ARGS__; } break;                                                  \
    case 6: { const int NV = 6; __VA_ARGS__; } break;                                                  \
    case 8: { const int NV = 8; __VA_ARGS__; } break;                                                  \
    case 10: { const int NV = 10; __VA_ARGS__; } break;                                                \
    case 12: { const int NV = 12; __VA_ARGS__; } break;                                                \
    case 16: { const int NV = 16; __VA_ARGS__; } break;                                                \
    case 32: { const int NV = 32; __VA_ARGS__; } break;                                                \
    default: { const int NV = 0; __VA_ARGS__; }                                                        \
    }

/* The vector rows need D a multiple of the vector width in one of FA_WITH_NV's sizes (2, 3, 4, 5, 6,
 * 8, 10, 12, 16 or 32 vectors: fp32 Dh 16, 24, 32, 40, 48, 64, 80, 96, 128 or 256 with AVX2, Dh 32 to
 * 512 with AVX-512, the common head sizes at either width); fast = 0 (a test hook of the backend)
 * keeps the generic rows, so that tests hold both kinds of rows to one input. */
static int SFX(fixed_nv)(i64 D, int fast) {
    int nv = 0;
    if (fast && D % FA_VL == 0) FA_WITH_NV(D / FA_VL, nv = NV);
    return nv;
}

/* The vector rows' NV for head size D (0: the generic rows), whatever the columns; for the backend. */
int SFX(fa_vector_nv)(i64 D) { return SFX(fixed_nv)(D, 1); }

/* out = softmax(scale * q.k_cols) . v_cols;  P keeps the probabilities and G (or NULL) the score slopes
 * (see fwd_vmids; for the backward's alpha gradient), (T, C) per head at head stride PH each: (B,H,T,C)
 * with PH = T * C, or P and G interleaved by head, (B,H,2T,C) with G = P + T * C and PH = 2 * T * C.
 * P and G NULL: no saved state, for a forward that no backward follows (0.92-0.97x its time). */
/* The fused kernels split (head, block) units into one contiguous range a thread, whose heads it
 * streams (their rows stay in its caches: 10-15 % faster at 16K than dynamic chunks of blocks), and
 * a thread that ends its range early takes units from the back of the others' (see fa_ranges). */
int SFX(fa_attn_fwd)(const REAL *q, const REAL *k, const REAL *v, REAL *out, REAL *P, REAL *G, i64 PH, i64 B, i64 H,
                     i64 Hk, i64 T, i64 D, i64 C, const i64 *lo, const REAL *wlo, const REAL *whi, const int *two,
                     REAL scale, const int32_t *dpos, int fast, int stream_out, int nt) {
    const i64 g = H / Hk, nb = (T + FA_BLOCK - 1) / FA_BLOCK;
    SFX(taps_t) tp;
    if (C < 1 || lo[0] != 0 || SFX(taps_init)(&tp, C, lo, wlo, whi, two)) return 1;
    SFX(lanes_t) L;
    SFX(lanes_init)(&L, &tp, C, T, D, lo, wlo, whi, two);
    const int nvx = L.ok ? SFX(fixed_nv)(D, fast) : 0, st = stream_out && nvx && fa_aligned(out);
    fa_range_t *rs = fa_ranges(B * Hk * nb, nt);
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        SFX(ws_t) ws = {0};
        const int bad = !rs || SFX(ws_init)(&ws, C), self = omp_get_thread_num();
        for (i64 u = bad ? -1 : fa_next(rs, nt, self); u >= 0; u = fa_next(rs, nt, self)) {
            const i64 bh = u / nb, blk = u % nb;
            const REAL *kb = k + bh * T * D, *vb = v + bh * T * D;
            const int32_t *pb = dpos ? dpos + (bh / Hk) * T : NULL;
            const i64 i0 = blk * FA_BLOCK, i1 = fa_min(T, i0 + FA_BLOCK);
            for (i64 gh = 0; gh < g; gh++) {
                const i64 h = (bh / Hk) * H + (bh % Hk) * g + gh;
                const REAL *qh = q + h * T * D;
                REAL *oh = out + h * T * D, *ph = P ? P + h * PH : NULL, *gh = G ? G + h * PH : NULL;
                i64 nv = 0;
                FA_WITH_NV(nvx, if (NV) {
                    SFX(fwd_vblock)(qh, kb, vb, oh, ph, gh, pb, &L, ws.blk, i0, i1, C, lo, scale, st, NV);
                } else for (i64 i = i0; i < i1; i++) {
                    const i64 lim = pb ? pb[i] : i;
                    nv = SFX(nvalid)(nv, lim, C, lo);
                    SFX(fwd_row)(qh + i * D, kb, vb, oh + i * D, ph ? ph + i * C : NULL, gh ? gh + i * C : NULL,
                                 &tp, &ws, i, lim, nv, D, C, scale);
                })
            }
        }
        fa_fence();
        if (bad) {
#pragma omp atomic write
            failed = 1;
        } else SFX(ws_free)(&ws);
    }
    SFX(taps_free)(&tp);
    free(rs);
    return failed;
}

/* Row values c < C of y into lane vectors (0 past C). */
FA_INLINE void SFX(get_cols)(SFX(vec) *x, const REAL *restrict y, const SFX(lanes_t) *L, i64 C) {
    for (int g = 0; g < L->G1; g++) x[g] = SFX(vload_n)(y + g * FA_VL, C - g * FA_VL);
}

/* The middle of pass 1 for row i, from its dout . v dots d (block_dots) for ng column groups: dS (times
 * scale) to dsi, the dq coefficients to cf, and d/d frac of the two-tap columns into part (when non-NULL),
 * from the forward's score slopes si (or, when NULL, two dots of qi with the rows at bi + ln).
 * delta = sum_c P_c dP_c, which equals dout . out (out = sum_c P_c v_c): the row's own lanes, so pass 1
 * never reads out (an eighth of its memory traffic; 4-8 % of the backward). */
FA_INLINE void SFX(bwd_vmid)(const SFX(vec) *d, const REAL *restrict qi,
                             const REAL *restrict bi, const i64 *restrict ln, const REAL *restrict pi,
                             const REAL *restrict si, REAL *restrict dsi, REAL *restrict cf, double *restrict part,
                             const SFX(lanes_t) *L, i64 nv, int ng, i64 C, REAL scale, const int NV) {
    SFX(vec) p[FA_MAXG], ds[FA_MAXG], pdp = {0};
    SFX(colmix)(ds, d, L, ng);
    SFX(get_cols)(p, pi, L, C);
    for (int g = 0; g < ng; g++) pdp += p[g] * ds[g];
    const REAL delta = SFX(hsum)(pdp);
    for (int g = 0; g < ng; g++) ds[g] = p[g] * (ds[g] - delta);  /* dS = P (dP - delta); 0 where P is */
    for (int g = ng; g < L->G1; g++) ds[g] = p[g] - p[g];
    SFX(coefs)(cf, ds, L, scale);
    if (part) {  /* d/d frac of a two-tap column: scale dS q.(k_hi - k_lo) + P dout.(v_hi - v_lo) */
        for (int g = 0; g < ng; g++)
            if (L->hig[g] >= 0) {
                const SFX(vec) dq = si ? SFX(vload_n)(si + g * FA_VL, C - g * FA_VL)
                                       : SFX(dotv)(qi, bi, ln + (L->Gd + L->hig[g] - L->G1) * FA_VL, NV) -
                                         SFX(dotv)(qi, bi, ln + g * FA_VL, NV);
                const SFX(vec) t = scale * ds[g] * dq + p[g] * (SFX(dhi)(d, L, g) - d[g]);
                for (int l = 0; l < FA_VL; l++)
                    if (L->two[g * FA_VL + l] && g * FA_VL + l < nv) part[g * FA_VL + l] += (double)t[l];
            }
    }
    for (int g = 0; g < ng; g++) ds[g] *= scale;             /* dk's factor */
    SFX(put_cols)(dsi, ds, L, C);
}


/* Rows [i0, i1) of one head's pass 1, in fwd_vblock's order (q, dout: the head's rows; P, G, dS
 * likewise; tab: room for a row's clamped offsets, for the alpha gradient's dots without slopes). */
FA_INLINE void SFX(bwd_vblock)(const REAL *restrict qh, const REAL *restrict kb, const REAL *restrict vb,
                               const REAL *restrict gh_, const REAL *restrict ph,
                               const REAL *restrict sh, REAL *restrict dsh, REAL *restrict dqh, double *restrict part,
                               const int32_t *pb, const SFX(lanes_t) *L, SFX(vec) *restrict blk, i64 *restrict tab,
                               i64 i0, i64 i1, i64 C, const i64 *lo, REAL scale, int stream, const int NV) {
    const i64 D = (i64)NV * FA_VL;
    REAL *cb = (REAL *)(blk + FA_BLOCK * 2 * FA_MAXG);
    i64 lims[FA_BLOCK], nvs[FA_BLOCK], nts[FA_BLOCK];
    const i64 *cl = SFX(block_rows)(lims, nvs, nts, pb, L, i0, i1, C, lo) ? lims : NULL;
    SFX(block_dots)(blk, L, gh_, vb, i0, i1, cl, NV);         /* dout . v per lane */
    for (i64 i = i0; i < i1; i++) {
        const SFX(vec) *d = blk + (i - i0) * 2 * FA_MAXG;
        const i64 nv = nvs[i - i0], lim = lims[i - i0];
        const i64 *ln = L->noff;
        if (part && !sh && lim < L->maxoff) fa_row_offsets(tab, L->offr, L->nl, lim, D), ln = tab;
        SFX(bwd_vmid)(d, qh + i * D, kb + i * D, ln, ph + i * C,
                      sh ? sh + i * C : NULL, dsh + i * C, cb + (i - i0) * FA_MAXG * FA_VL, part, L, nv,
                      SFX(ngroups)(nv), C, scale, NV);
    }
    SFX(tapsums)(dqh, kb, cb, FA_MAXG * FA_VL, L->tnoff, SFX(tap_lanes)(L), NULL, 1, stream, L->n1, i0, i1, nts, cl,
                 NV);
}

/* Pass 2 over the key rows [m0, m1) of one head that no reader reaches through a clamp (nm[m - m0]
 * taps each: those whose reader row m + off exists; -1 marks a row left to bwd_col):
 * dk += sum_t w dS[m + off, col] q[m + off], dv += sum_t w P[m + off, col] dout[m + off].
 * A row at a time with all its sums' taps (tapsums; lanes_t's tcix, tw). The group's first query head
 * starts the sums (dk and dv need no zeroing first), its last may stream them out (tapsums). */
FA_INLINE void SFX(bwd_ktile)(REAL *restrict dkb, REAL *restrict dvb, const REAL *restrict qh,
                              const REAL *restrict gh_, const REAL *restrict ph, const REAL *restrict dsh,
                              const SFX(taps_t) *tp, const SFX(lanes_t) *L, i64 m0, i64 m1,
                              const i64 *restrict nm, i64 C, int first, int stream, const int NV) {
    for (int side = 0; side < 2; side++)
        SFX(tapsums)(side ? dvb : dkb, side ? gh_ : qh, (side ? ph : dsh) + m0 * C, C, L->tpoff, L->tcix,
                     tp->one ? NULL : L->tw, first, stream, 0, m0, m1, nm, NULL, NV);
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
    SFX(zero)(dqi, D), SFX(gather)(dqi, kb, ws->row, ws->cf, n, D);
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
                ws->row[n] = i, ws->cf[n] = whi[c] * dsh[i * C + c], ws->cf2[n] = whi[c] * ph[i * C + c];
                n++;
            }
    SFX(gather)(dkm, qh, ws->row, ws->cf, n, D), SFX(gather)(dvm, gh_, ws->row, ws->cf2, n, D);
}

/* What every block of the backward reads: fa_attn_bwd's arguments and tables. */
typedef struct {
    const REAL *q, *k, *v, *out, *dout, *P, *G, *whi;
    REAL *dS, *dq, *dk, *dv;
    double *parts;               /* d/d frac per (head group, block), or NULL */
    const int32_t *dpos;
    const i64 *ends, *lo;        /* where each row's document ends (or NULL) */
    const int *two;
    const SFX(taps_t) *tp;
    const SFX(lanes_t) *L;
    i64 PH, H, Hk, T, D, C, nb;
    REAL scale;
    int nvx;                     /* vector rows' NV, or 0: the generic rows */
    int stream_out;              /* the vector rows stream dq, dk and dv out (tapsums) */
} SFX(bwd_t);

/* Pass 1 of block blk of key/value head bh, by query row: dS and dq of its query heads' rows. */
static void SFX(bwd_pass1)(const SFX(bwd_t) *a, SFX(ws_t) *ws, i64 bh, i64 blk) {
    const i64 T = a->T, D = a->D, C = a->C, Hk = a->Hk, g = a->H / Hk;
    const REAL *kb = a->k + bh * T * D, *vb = a->v + bh * T * D;
    const int32_t *pb = a->dpos ? a->dpos + (bh / Hk) * T : NULL;
    const i64 i0 = blk * FA_BLOCK, i1 = fa_min(T, i0 + FA_BLOCK);
    double *part = a->parts ? a->parts + (bh * a->nb + blk) * C : NULL;
    for (i64 gh = 0; gh < g; gh++) {
        const i64 h = (bh / Hk) * a->H + (bh % Hk) * g + gh;
        const i64 o = h * T * D, oc = h * T * C, op = h * a->PH;
        const REAL *qh = a->q + o, *oh = a->out + o, *gh_ = a->dout + o, *ph = a->P + op;
        REAL *dsh = a->dS + oc, *dqh = a->dq + o;
        i64 nv = 0;
        /* the vector rows' pass 1 reads no q row (but for alpha without slopes); pass 2 reads them
         * a block later, for the first time from memory: fetched now, they wait in L2 (0.97x the backward) */
        if (a->nvx) fa_prefetch(qh + i0 * D, (i1 - i0) * D * (i64)sizeof(REAL));
        FA_WITH_NV(a->nvx, if (NV) {
            SFX(bwd_vblock)(qh, kb, vb, gh_, ph, a->G ? a->G + op : NULL, dsh, dqh, part, pb, a->L, ws->blk,
                            ws->tab, i0, i1, C, a->lo, a->scale, a->stream_out, NV);
        } else for (i64 i = i0; i < i1; i++) {
            const i64 lim = pb ? pb[i] : i;
            nv = SFX(nvalid)(nv, lim, C, a->lo);
            SFX(bwd_row)(qh + i * D, kb, vb, oh + i * D, gh_ + i * D, ph + i * C, dsh + i * C, dqh + i * D, part,
                         a->tp, ws, i, lim, nv, D, C, a->scale);
        })
    }
}

/* Pass 2 of block blk of key/value head bh, by key row: dk, dv in gather form, from the dS of the
 * readers of its rows (up to the largest distance further on). */
static void SFX(bwd_pass2)(const SFX(bwd_t) *a, SFX(ws_t) *ws, i64 bh, i64 blk) {
    const i64 T = a->T, D = a->D, C = a->C, Hk = a->Hk, g = a->H / Hk;
    const SFX(taps_t) *tp = a->tp;
    const i64 i0 = blk * FA_BLOCK, i1 = fa_min(T, i0 + FA_BLOCK);
    const int32_t *pb = a->dpos ? a->dpos + (bh / Hk) * T : NULL;
    const i64 *eb = a->ends ? a->ends + (bh / Hk) * T : NULL;
    REAL *dkb = a->dk + bh * T * D, *dvb = a->dv + bh * T * D;
    /* vector rows: the taps whose reader row exists, for rows that no reader reaches
     * through a clamp (-1: bwd_col's row); the same for every query head of the group */
    i64 nm[FA_BLOCK];
    for (i64 m = i0; m < i1 && a->nvx; m++) {
        const i64 end = eb ? eb[m] : T;
        i64 n = a->L->n1;
        while (n && m + a->L->toff[n - 1] >= end) n--;
        nm[m - i0] = (pb ? pb[m] != 0 : m != 0) ? n : -1;
    }
    for (i64 m = i0; m < i1; m++)              /* bwd_col adds to its rows; bwd_ktile starts its own */
        if (!a->nvx || nm[m - i0] < 0) SFX(zero)(dkb + m * D, D), SFX(zero)(dvb + m * D, D);
    for (i64 gh = 0; gh < g; gh++) {
        const i64 h = (bh / Hk) * a->H + (bh % Hk) * g + gh;
        const i64 o = h * T * D, oc = h * T * C, op = h * a->PH;
        const REAL *qh = a->q + o, *gh_ = a->dout + o, *ph = a->P + op, *dsh = a->dS + oc;
        FA_WITH_NV(a->nvx, if (NV) {
            SFX(bwd_ktile)(dkb, dvb, qh, gh_, ph, dsh, tp, a->L, i0, i1, nm, C, gh == 0,
                           a->stream_out && gh == g - 1, NV);
            for (i64 m = i0; m < i1; m++)
                if (nm[m - i0] < 0)
                    SFX(bwd_col)(dkb + m * D, dvb + m * D, qh, gh_, ph, dsh, tp, ws, m, pb ? pb[m] == 0 : m == 0,
                                 eb ? eb[m] : T, D, C, a->lo, a->whi, a->two);
        } else for (i64 m = i0; m < i1; m++) {
            SFX(bwd_col)(dkb + m * D, dvb + m * D, qh, gh_, ph, dsh, tp, ws, m, pb ? pb[m] == 0 : m == 0,
                         eb ? eb[m] : T, D, C, a->lo, a->whi, a->two);
        })
    }
    if (!a->nvx)                                 /* the vector rows' dS holds the factor */
        for (i64 e = i0 * D; e < i1 * D; e++) dkb[e] *= a->scale;
}

/* Whether pass 1 is done for unit u = bh * nb + blk and the blocks of its head up to lag further on. */
static inline int SFX(readers_done)(const unsigned char *done, i64 u, i64 nb, i64 lag) {
    const i64 last = u + fa_min(lag, nb - 1 - u % nb);
    for (i64 w = last; w >= u; w--)
        if (!__atomic_load_n(done + w, __ATOMIC_ACQUIRE)) return 0;
    return 1;
}

/* Gradients of fa_attn_fwd (P, G and PH as there; out is read by the generic rows only). dS (B,H,T,C)
 * is scratch (the vector rows keep it times scale); when dfrac (C doubles) is non-NULL, d loss / d f
 * of each two-tap column is added to it, along (wlo, whi) = (1 - f, f). Pass 2 of a block needs pass 1
 * of the blocks up to the largest distance on (lag blocks). A thread streaming its own range runs pass
 * 2 of block b right after pass 1 of block b + lag, while the rows it reads again (q, dout, P, dS) are
 * still in its caches: one pass over memory instead of two. Whoever runs a block, it does the same
 * sums in the same order, so the results are the same bit for bit. */
int SFX(fa_attn_bwd)(const REAL *q, const REAL *k, const REAL *v, const REAL *out, const REAL *dout,
                     const REAL *P, const REAL *G, i64 PH, REAL *dS, REAL *dq, REAL *dk, REAL *dv, double *dfrac,
                     i64 B, i64 H, i64 Hk,
                     i64 T, i64 D, i64 C, const i64 *lo, const REAL *wlo, const REAL *whi, const int *two,
                     REAL scale, const int32_t *dpos, int fast, int stream_out, int nt) {
    const i64 nb = (T + FA_BLOCK - 1) / FA_BLOCK;
    SFX(taps_t) tp;
    if (C < 1 || lo[0] != 0) return 1;
    i64 *ends = dpos ? fa_doc_ends(dpos, B, T) : NULL;  /* where each row's document ends */
    /* d/d frac per (head, block), summed in a fixed order afterwards: bit-identical for any thread count */
    double *parts = dfrac ? calloc(B * Hk * nb * C + 1, sizeof(double)) : NULL;
    if ((dpos && !ends) || (dfrac && !parts) || SFX(taps_init)(&tp, C, lo, wlo, whi, two))
        return free(ends), free(parts), 1;
    i64 maxoff = 0;                  /* the largest distance to a reader row that exists (bwd_col reads every tap) */
    for (i64 t = 0; t < tp.n; t++)
        if (tp.off[t] < T && tp.off[t] > maxoff) maxoff = tp.off[t];
    SFX(lanes_t) L;
    SFX(lanes_init)(&L, &tp, C, T, D, lo, wlo, whi, two);
    const int nvx = L.ok ? SFX(fixed_nv)(D, fast) : 0;    /* vector rows: dS is kept times scale (dk's factor) */
    const SFX(bwd_t) a = {q, k, v, out, dout, P, G, whi, dS, dq, dk, dv, parts, dpos, ends, lo, two, &tp, &L,
                          PH, H, Hk, T, D, C, nb, scale, nvx,
                          stream_out && nvx && fa_aligned(dq) && fa_aligned(dk) && fa_aligned(dv)};
    /* pass 2 of a block reads the dS of the blocks up to lag further on, written by their pass 1 */
    const i64 U = B * Hk * nb, lag = (FA_BLOCK - 1 + maxoff) / FA_BLOCK;
    fa_range_t *rs = fa_ranges(U, nt);
    unsigned char *done = calloc(U + 1, 1);              /* pass 1 of unit u is done (release / acquire) */
    int failed = 0;
#pragma omp parallel num_threads(nt)
    {
        SFX(ws_t) ws = {0};
        const int self = omp_get_thread_num();
        i64 *pend = rs && done ? malloc(sizeof(i64) * (U + 1)) : NULL, np = 0;   /* pass 1 done, pass 2 not */
        const int bad = !pend || SFX(ws_init)(&ws, C);
        /* A unit's pass 1 right away; its pass 2 once pass 1 is done for the blocks that read it: for a
         * thread's own units lag units later (a head streamed step by step), for a stolen one (taken from
         * the back) at once. Only the last loop waits, on units that other threads have taken. */
        for (i64 u = bad ? -1 : fa_next(rs, nt, self); u >= 0; u = fa_next(rs, nt, self)) {
            SFX(bwd_pass1)(&a, &ws, u / nb, u % nb);
            __atomic_store_n(done + u, 1, __ATOMIC_RELEASE);
            pend[np++] = u;
            i64 keep = 0;
            for (i64 j = 0; j < np; j++)
                if (SFX(readers_done)(done, pend[j], nb, lag)) SFX(bwd_pass2)(&a, &ws, pend[j] / nb, pend[j] % nb);
                else pend[keep++] = pend[j];
            np = keep;
        }
        for (i64 j = 0; j < np; j++) {
            for (int spins = 0; !SFX(readers_done)(done, pend[j], nb, lag); spins += spins < 1024) fa_pause(spins);
            SFX(bwd_pass2)(&a, &ws, pend[j] / nb, pend[j] % nb);
        }
        fa_fence();
        if (bad) {
#pragma omp atomic write
            failed = 1;
        } else SFX(ws_free)(&ws);
        free(pend);
    }
    if (parts && !failed)
        for (i64 j = 0; j < B * Hk * nb; j++)
            for (i64 c = 0; c < C; c++) dfrac[c] += parts[j * C + c];
    SFX(taps_free)(&tp);
    free(ends), free(parts), free(rs), free(done);
    return failed;
}

#undef FA_SWAP1
#undef FA_SWAP2
#endif
