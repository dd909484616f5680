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
static inline uint32_t umin(uint32_t a, uint32_t b) { return sel(a < b, a, b); }

static inline void load_block(const void *x, int kind, int64_t start, int n, float *v) {
    if (kind == 0) {
        const uint16_t *h = (const uint16_t *)x + start;
        for (int i = 0; i < n; i++) v[i] = u2f((uint32_t)h[i] << 16);
    } else {
        memcpy(v, (const float *)x + start, (size_t)n * 4);
    }
}

/* max |v| from the bit patterns: non-negative floats order like their bits and a NaN's bits
 * exceed inf's, so a NaN anywhere gives NaN, as torch's amax does. */
static inline float abs_max(const float *v, int n) {
    uint32_t m = 0;
    for (int i = 0; i < n; i++) {
        uint32_t a = f2u(v[i]) & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return u2f(m);
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
    uint32_t r = sel(a < (121u << 23), sub, nor);
    r = sel(a > 0x7F800000u, 0x7Fu, r);
    return sign | r;
}

static inline float e4m3_value(uint32_t b) {
    uint32_t e = (b >> 3) & 0xFu, m = b & 7u;
    float v;
    if ((b & 0x7F) == 0x7F) v = u2f(0x7FC00000u); /* NaN */
    else if (e) v = u2f(((e + 120u) << 23) | (m << 20));
    else v = (float)m * 0.001953125f; /* m * 2^-9, exact */
    return (b & 0x80) ? -v : v;
}

static inline void mxfp8_block(const float *restrict v, uint8_t *restrict q, uint8_t *restrict s) {
    float t = abs_max(v, 32) / 448.0f;
    uint32_t byte = ((f2u(t) + 0x7FFFFFu) >> 23) & 0xFFu; /* ceil(log2 t) + 127 */
    if (t != t) byte = 255;
    if (byte < 1) byte = 1;
    float mult = u2f((254u - (byte < 254u ? byte : 254u)) << 23); /* 2^-E; 0.0 for byte 255 */
    /* No clamp to +-448 as in the torch chain (which guards PyTorch's non-saturating cast): RCEIL
     * keeps |v * mult| <= 448 * (1 + 2^-23), and e4m3() rounds anything below 464 to at most 448. */
    for (int i = 0; i < 32; i++) q[i] = (uint8_t)e4m3(v[i] * mult);
    *s = (uint8_t)byte;
}

/* MXFP8: blocks [b0, b1) of 32 elements -> e4m3 bytes q[32 per block], E8M0 bytes s[1 per block]
 * (RCEIL, at least 1; 255 for a block holding NaN or inf). */
void qc_mxfp8(const void *x, int kind, int64_t b0, int64_t b1, uint8_t *q, uint8_t *s) {
    float v[32];
    for (int64_t b = b0; b < b1; b++) {
        load_block(x, kind, b * 32, 32, v);
        mxfp8_block(v, q + b * 32, s + b);
    }
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

static inline void nvfp4_block(const float *restrict v, int te, float k0, float k1, int g_zero, uint8_t *restrict p,
                               uint8_t *restrict sc) {
    const float flt_max = 3.4028234663852886e38f;
    float amax = abs_max(v, 16);
    uint32_t code[16];
    uint32_t scale;
    if (te) {
        float s = amax * k0;
        s = s > 448.0f ? 448.0f : s; /* NaN stays NaN */
        scale = e4m3(s);
        float inv = 1.0f / (e4m3_value(scale) * k1);
        inv = inv > flt_max ? flt_max : inv;
        for (int i = 0; i < 16; i++) {
            float q = v[i] * inv;
            code[i] = e2m1_mag(fabs_bits(q)) | ((f2u(q) >> 28) & 8u); /* sign bit: -0.0 gives 8 */
        }
    } else {
        float s = amax / k0;
        if (s == 0.0f || g_zero) s = 1.0f;
        if (s < 0.001953125f) s = 0.001953125f; /* clamp to [2^-9, 448]; NaN stays NaN */
        else if (s > 448.0f) s = 448.0f;
        scale = e4m3(s);
        float div = g_zero ? 1.0f : e4m3_value(scale) * k1;
        for (int i = 0; i < 16; i++) {
            float q = v[i] / div;
            code[i] = e2m1_mag(fabs_bits(q)) | ((uint32_t)(q < 0.0f) << 3); /* ModelOpt: q < 0 */
        }
    }
    for (int j = 0; j < 8; j++) p[j] = (uint8_t)(code[2 * j] | (code[2 * j + 1] << 4));
    *sc = (uint8_t)scale;
}

/* NVFP4: blocks [b0, b1) of 16 elements -> packed codes p[8 per block] (element 2j in the low
 * nibble) and e4m3 block scales sc[1 per block]. te != 0: TransformerEngine's operation order with
 * k0 = S_enc * fl32(1/6), k1 = S_dec; otherwise ModelOpt's, with k0 = 6 * scale_2, k1 = scale_2
 * and g_zero = (global amax == 0). */
void qc_nvfp4(const void *x, int kind, int64_t b0, int64_t b1, int te, float k0, float k1, int g_zero,
              uint8_t *p, uint8_t *sc) {
    float v[16];
    for (int64_t b = b0; b < b1; b++) {
        load_block(x, kind, b * 16, 16, v);
        nvfp4_block(v, te, k0, k1, g_zero, p + b * 8, sc + b);
    }
}

/* max |x| over elements [i0, i1) as the fp32 bit pattern of |x| (a NaN anywhere gives a NaN's
 * bits, which exceed inf's): the global amax of NVFP4 and the finiteness check of kept tensors. */
uint32_t qc_absmax_bits(const void *x, int kind, int64_t i0, int64_t i1) {
    uint32_t m = 0;
    if (kind == 0) {
        const uint16_t *h = (const uint16_t *)x;
        uint16_t m16 = 0;
        for (int64_t i = i0; i < i1; i++) {
            uint16_t a = h[i] & 0x7FFFu;
            m16 = a > m16 ? a : m16;
        }
        m = (uint32_t)m16 << 16;
    } else {
        const uint32_t *w = (const uint32_t *)x;
        for (int64_t i = i0; i < i1; i++) {
            uint32_t a = w[i] & 0x7FFFFFFFu;
            m = a > m ? a : m;
        }
    }
    return m;
}
