/* One-pass CPU kernels for qconvert's MXFP8 and NVFP4 block quantizers.
 *
 * The torch op chains in mxfp8.py / nvfp4.py define the bytes; these loops compute the same bytes
 * in one pass over each block, with no temporaries, and run without the GIL (ctypes releases it).
 * cpu_kernels.py builds this file at first use with the system C compiler, without fast-math and
 * with FP contraction off, so each float operation is one IEEE single-precision operation. Checked
 * on every BF16 bit pattern against the torch chains (tests/test_cpu_kernels.py).
 *
 * Inputs: BF16 (kind 0) or FP32 (kind 1) elements, blocks contiguous along the last axis.
 */
#include <stdint.h>
#include <string.h>

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
/* c ? a : b for c in {0, 1}, as bit masks: compilers vectorize the loops below only when their
 * bodies have no branches, and ternaries inside inlined helpers are not always if-converted
 * (GCC 12 on AVX2 left every quantizer loop scalar). */
static inline uint32_t sel(uint32_t c, uint32_t a, uint32_t b) { uint32_t m = 0u - c; return (a & m) | (b & ~m); }
/* min of a, b < 2^31 (compared as signed: AVX2 has no unsigned compare) */
static inline uint32_t umin(uint32_t a, uint32_t b) { return sel((int32_t)a < (int32_t)b, a, b); }

/* Blocks are processed in groups of G: first each block's max |x| (one vectorized reduction per
 * block), then the per-block scale arithmetic for the whole group as one vectorized loop over
 * blocks, then the elements. Done block by block, the scalar scale arithmetic cost more than the
 * elements themselves (16-element NVFP4 blocks are two AVX2 vectors). */
#define G 16

/* max |x| over elements [i0, i1) as the fp32 bit pattern of |x|: non-negative floats order like
 * their bits and a NaN's bits exceed inf's, so a NaN anywhere gives a NaN's bits, as torch's amax
 * gives NaN. BF16 is compared as 16-bit patterns, its fp32 bits' high half. */
static inline uint32_t absmax_bits(const void *x, int kind, int64_t i0, int64_t i1) {
    if (kind == 0) {
        const uint16_t *h = (const uint16_t *)x;
        uint16_t m = 0;
        for (int64_t i = i0; i < i1; i++) {
            uint16_t a = h[i] & 0x7FFFu;
            m = a > m ? a : m;
        }
        return (uint32_t)m << 16;
    }
    const uint32_t *w = (const uint32_t *)x;
    uint32_t m = 0;
    for (int64_t i = i0; i < i1; i++) {
        uint32_t a = w[i] & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return m;
}

/* absmax_bits of each of the n <= G blocks of bs elements starting at block b */
static inline void group_absmax(const void *x, int kind, int64_t b, int n, int bs, uint32_t *restrict am) {
    for (int k = 0; k < n; k++) am[k] = absmax_bits(x, kind, (b + k) * bs, (b + k + 1) * bs);
}

/* element i of block k of a group, as fp32 */
static inline float elem(const void *x, int kind, int64_t base, int i) {
    return kind == 0 ? u2f((uint32_t)((const uint16_t *)x)[base + i] << 16) : ((const float *)x)[base + i];
}

/* float -> float8 e4m3fn, round to nearest even; for |f| < 464 (which rounds to at most 448) and
 * NaN (0x7F with f's sign bit). Branch-free, so that loops over a block vectorize: both roundings are
 * computed and one is selected. */
static inline uint32_t e4m3(float f) {
    uint32_t u = f2u(f);
    uint32_t sign = (u >> 24) & 0x80u;
    uint32_t a = u & 0x7FFFFFFFu;
    /* below 2^-6, the subnormal grid of step 2^-9: the fp32 step at 2^14 is 2^-9, so the sum
     * rounds (RNE) and its low bits count steps */
    uint32_t sub = f2u(u2f(a) + 16384.0f) - 0x46800000u;
    /* normal: keep 3 mantissa bits, ties to even, carrying into the exponent; rebias 127 -> 7 */
    uint32_t nor = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
    /* a < 2^31: signed compares give the same answers and AVX2 has no unsigned ones */
    uint32_t r = sel((int32_t)a < (int32_t)(121u << 23), sub, nor);
    r = sel((int32_t)a > (int32_t)0x7F800000u, 0x7Fu, r);
    return sign | r;
}

static inline float e4m3_value(uint32_t b) {
    uint32_t e = (b >> 3) & 0xFu, m = b & 7u;
    uint32_t mag = sel(e != 0, ((e + 120u) << 23) | (m << 20), f2u((float)m * 0.001953125f)); /* m * 2^-9, exact */
    mag = sel((b & 0x7Fu) == 0x7Fu, 0x7FC00000u, mag); /* NaN */
    return u2f(mag | ((b & 0x80u) << 24));
}

static inline float fsel(uint32_t c, float a, float b) { return u2f(sel(c, f2u(a), f2u(b))); }

static inline __attribute__((always_inline)) void mxfp8_range(const void *x, const int kind, int64_t b0, int64_t b1,
                                                             uint8_t *restrict q, uint8_t *restrict s) {
    uint32_t am[G];
    float mult[G];
    for (int64_t b = b0; b < b1; b += G) {
        int n = b1 - b < G ? (int)(b1 - b) : G;
        group_absmax(x, kind, b, n, 32, am);
        for (int k = 0; k < n; k++) {
            float t = u2f(am[k]) / 448.0f;
            uint32_t byte = ((f2u(t) + 0x7FFFFFu) >> 23) & 0xFFu; /* ceil(log2 t) + 127 */
            byte = sel(t != t, 255u, byte);
            byte = sel(byte < 1u, 1u, byte);
            mult[k] = u2f((254u - umin(byte, 254u)) << 23); /* 2^-E; 0.0 for byte 255 */
            s[b + k] = (uint8_t)byte;
        }
        /* No clamp to +-448 as in the torch chain (which guards PyTorch's non-saturating cast): RCEIL
         * keeps |x * mult| <= 448 * (1 + 2^-23), and e4m3() rounds anything below 464 to at most 448. */
        for (int k = 0; k < n; k++) {
            int64_t base = (b + k) * 32;
            for (int i = 0; i < 32; i++) q[base + i] = (uint8_t)e4m3(elem(x, kind, base, i) * mult[k]);
        }
    }
}

/* MXFP8: blocks [b0, b1) of 32 elements -> e4m3 bytes q[32 per block], E8M0 bytes s[1 per block]
 * (RCEIL, at least 1; 255 for a block holding NaN or inf). One loop body per input kind: a kind
 * test inside the element loops keeps them from vectorizing. */
void qc_mxfp8(const void *x, int kind, int64_t b0, int64_t b1, uint8_t *q, uint8_t *s) {
    if (kind == 0) mxfp8_range(x, 0, b0, b1, q, s);
    else mxfp8_range(x, 1, b0, b1, q, s);
}

/* E2M1 magnitude code of a = |v| >= 0: RNE, saturating at 6, NaN -> 7. Below 2 the grid step is
 * 0.5, in [2, 4) 1 and from 4 up 2: each candidate is rounded by one add into [2^23, 2^24), where
 * the fp32 step is 1 (ties to even, as E2M1's mantissa), and in each range the right candidate is
 * the smallest of the three. */
static inline uint32_t e2m1_mag(float a) {
    float c = u2f(sel(a <= 6.0f, f2u(a), f2u(6.0f))); /* above 6, inf and NaN saturate to 6, code 7 */
    float t0 = c * 2.0f + 8388608.0f, t1 = c + 8388610.0f, t2 = c * 0.5f + 8388612.0f;
    /* positive finite floats order like their bit patterns */
    return umin(umin(f2u(t0), f2u(t1)), f2u(t2)) & 7u;
}

static inline float fabs_bits(float f) { return u2f(f2u(f) & 0x7FFFFFFFu); }
/* elements 2j and 2j+1 of the block at base, read as one word so that a loop over j reads memory
 * contiguously and vectorizes (a loop over elements followed by a byte-packing loop stayed scalar) */
static inline void elem_pair(const void *x, int kind, int64_t base, int j, float *lo, float *hi) {
    if (kind == 0) {
        uint32_t w;
        memcpy(&w, (const uint16_t *)x + base + 2 * j, 4);
        *lo = u2f(w << 16);
        *hi = u2f(w & 0xFFFF0000u);
    } else {
        uint64_t w;
        memcpy(&w, (const float *)x + base + 2 * j, 8);
        *lo = u2f((uint32_t)w);
        *hi = u2f((uint32_t)(w >> 32));
    }
}

/* fe[8k + j] = f[k]: one factor per element pair, so that the loop over a group's pairs reads it
 * contiguously (a loop over the 8 pairs of each block is too short to vectorize with byte stores) */
static inline void spread(const float *restrict f, int n, float *restrict fe) {
    for (int k = 0; k < n; k++)
        for (int j = 0; j < 8; j++) fe[8 * k + j] = f[k];
}

static inline uint32_t te_code(float q) { return e2m1_mag(fabs_bits(q)) | ((f2u(q) >> 28) & 8u); } /* -0.0 gives 8 */
static inline uint32_t modelopt_code(float q) { return e2m1_mag(fabs_bits(q)) | ((uint32_t)(q < 0.0f) << 3); }

/* NVFP4: blocks [b0, b1) of 16 elements -> packed codes p[8 per block] (element 2j in the low
 * nibble) and e4m3 block scales sc[1 per block]. te != 0: TransformerEngine's operation order with
 * k0 = S_enc * fl32(1/6), k1 = S_dec; otherwise ModelOpt's, with k0 = 6 * scale_2, k1 = scale_2
 * and g_zero = (global amax == 0). */
static inline __attribute__((always_inline)) void nvfp4_range(const void *x, const int kind, int64_t b0, int64_t b1,
                                                             int te, float k0, float k1, int g_zero,
                                                             uint8_t *restrict p, uint8_t *restrict sc) {
    const float flt_max = 3.4028234663852886e38f;
    uint32_t am[G];
    float f[G]; /* te: the multiplier 1/(s/S_enc); ModelOpt: the divisor s * scale_2 */
    float fe[G * 8]; /* f per pair of elements: the element loop runs over the whole group */
    for (int64_t b = b0; b < b1; b += G) {
        int n = b1 - b < G ? (int)(b1 - b) : G;
        group_absmax(x, kind, b, n, 16, am);
        if (te) {
            for (int k = 0; k < n; k++) {
                float s = u2f(am[k]) * k0;
                s = fsel(s > 448.0f, 448.0f, s); /* NaN stays NaN */
                uint32_t scale = e4m3(s);
                float inv = 1.0f / (e4m3_value(scale) * k1);
                f[k] = fsel(inv > flt_max, flt_max, inv);
                sc[b + k] = (uint8_t)scale;
            }
            spread(f, n, fe);
            for (int m = 0; m < n * 8; m++) {
                float lo, hi;
                elem_pair(x, kind, b * 16, m, &lo, &hi);
                p[b * 8 + m] = (uint8_t)(te_code(lo * fe[m]) | (te_code(hi * fe[m]) << 4));
            }
        } else {
            for (int k = 0; k < n; k++) {
                float s = u2f(am[k]) / k0;
                s = fsel((s == 0.0f) | (g_zero != 0), 1.0f, s);
                s = fsel(s < 0.001953125f, 0.001953125f, fsel(s > 448.0f, 448.0f, s)); /* [2^-9, 448]; NaN stays */
                uint32_t scale = e4m3(s);
                f[k] = fsel(g_zero != 0, 1.0f, e4m3_value(scale) * k1);
                sc[b + k] = (uint8_t)scale;
            }
            spread(f, n, fe);
            for (int m = 0; m < n * 8; m++) {
                float lo, hi;
                elem_pair(x, kind, b * 16, m, &lo, &hi);
                p[b * 8 + m] = (uint8_t)(modelopt_code(lo / fe[m]) | (modelopt_code(hi / fe[m]) << 4));
            }
        }
    }
}

void qc_nvfp4(const void *x, int kind, int64_t b0, int64_t b1, int te, float k0, float k1, int g_zero,
              uint8_t *p, uint8_t *sc) {
    if (kind == 0) nvfp4_range(x, 0, b0, b1, te, k0, k1, g_zero, p, sc);
    else nvfp4_range(x, 1, b0, b1, te, k0, k1, g_zero, p, sc);
}

/* absmax_bits for Python: the global amax of NVFP4 and the finiteness check of kept tensors */
uint32_t qc_absmax_bits(const void *x, int kind, int64_t i0, int64_t i1) {
    return absmax_bits(x, kind, i0, i1);
}
