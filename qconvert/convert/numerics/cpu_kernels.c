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
#include <stdlib.h>
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


#ifdef __AVX2__
/* AVX2 versions of the BF16 MXFP8 and NVFP4 (TE recipe) loops (ModelOpt and 4over6: further down): the same operations as the portable
 * code above, lane by lane (each intrinsic is one IEEE fp32 operation or an integer/bit operation),
 * for groups of 8 blocks. GCC vectorized the portable loops at 128 bits with spills and lane
 * shuffles (about 5 cycles per element on a Zen host); written out, a block is one or two 256-bit
 * loads, the 8 blocks' scale arithmetic one vector, and the codes are packed by pack instructions.
 * Tails of fewer than 8 blocks and FP32 inputs use the portable code. */
#include <immintrin.h>

#define I32(v) _mm256_set1_epi32((int)(v))

/* lane k = signed max over the 8 lanes of m[k] (values here are 0..0x7FFF) */
static inline __m256i hmax8(const __m256i m[8]) {
    __m256i a[4], b[2];
    for (int k = 0; k < 4; k++)
        a[k] = _mm256_max_epi32(_mm256_unpacklo_epi32(m[2 * k], m[2 * k + 1]),
                                _mm256_unpackhi_epi32(m[2 * k], m[2 * k + 1]));
    for (int k = 0; k < 2; k++)
        b[k] = _mm256_max_epi32(_mm256_unpacklo_epi64(a[2 * k], a[2 * k + 1]),
                                _mm256_unpackhi_epi64(a[2 * k], a[2 * k + 1]));
    return _mm256_max_epi32(_mm256_permute2x128_si256(b[0], b[1], 0x20), _mm256_permute2x128_si256(b[0], b[1], 0x31));
}

/* 16 |bf16| patterns (one 256-bit vector, already masked to 0x7FFF each) -> 8 int32 lanes whose max is theirs */
static inline __m256i pair_max(__m256i a) {
    return _mm256_max_epi32(_mm256_and_si256(a, I32(0xFFFF)), _mm256_srli_epi32(a, 16));
}

static inline __m256 even_elems(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
static inline __m256 odd_elems(__m256i w) { return _mm256_castsi256_ps(_mm256_and_si256(w, I32(0xFFFF0000u))); }

/* e4m3() of a >= 0 (or NaN with the sign bit clear) lane by lane, without the sign: the element
 * loops scale |x| and take each sign bit from x itself (the multipliers are positive, so x * m has
 * x's sign; they are 0 or NaN only in blocks holding inf or NaN, which have no specified bytes) */
static inline __m256i e4m3_mag_v(__m256 f) {
    __m256i a = _mm256_castps_si256(f);
    __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(f, _mm256_set1_ps(16384.0f))), I32(0x46800000));
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(a, 20), I32(1));
    __m256i nor = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(a, I32(0x7FFFF)), odd), 20),
                                   I32(120u << 3));
    __m256i r = _mm256_blendv_epi8(nor, sub, _mm256_cmpgt_epi32(I32(121u << 23), a));
    return _mm256_blendv_epi8(r, I32(0x7F), _mm256_cmpgt_epi32(a, I32(0x7F800000)));
}

static inline __m256 e4m3_value_v(__m256i b) { /* e4m3_value() lane by lane */
    __m256i e = _mm256_and_si256(_mm256_srli_epi32(b, 3), I32(0xF)), m = _mm256_and_si256(b, I32(7));
    __m256i nor = _mm256_or_si256(_mm256_slli_epi32(_mm256_add_epi32(e, I32(120)), 23), _mm256_slli_epi32(m, 20));
    __m256i sub = _mm256_castps_si256(_mm256_mul_ps(_mm256_cvtepi32_ps(m), _mm256_set1_ps(0.001953125f)));
    /* e == 0 picks sub. Written with the mask as the compare gives it: GCC 12 with AVX-512 VL+BW
     * (-march=native on an AMD VM that reports AVX-512) miscompiled the same select written as blendv(sub, nor,
     * ~(e == 0)), choosing nor for every lane (found by tests/test_cpu_kernels.py on such a host) */
    __m256i mag = _mm256_blendv_epi8(nor, sub, _mm256_cmpeq_epi32(e, I32(0)));
    mag = _mm256_blendv_epi8(mag, I32(0x7FC00000), _mm256_cmpeq_epi32(_mm256_and_si256(b, I32(0x7F)), I32(0x7F)));
    return _mm256_castsi256_ps(_mm256_or_si256(mag, _mm256_slli_epi32(_mm256_and_si256(b, I32(0x80)), 24)));
}

/* e2m1_mag() lane by lane, for a = |v| */
static inline __m256i e2m1_mag_v(__m256 a) {
    __m256 c = _mm256_min_ps(a, _mm256_set1_ps(6.0f)); /* NaN (first operand) gives the second, 6 */
    __m256 t0 = _mm256_add_ps(_mm256_mul_ps(c, _mm256_set1_ps(2.0f)), _mm256_set1_ps(8388608.0f));
    __m256 t1 = _mm256_add_ps(c, _mm256_set1_ps(8388610.0f));
    __m256 t2 = _mm256_add_ps(_mm256_mul_ps(c, _mm256_set1_ps(0.5f)), _mm256_set1_ps(8388612.0f));
    return _mm256_and_si256(_mm256_castps_si256(_mm256_min_ps(_mm256_min_ps(t0, t1), t2)), I32(7));
}

/* 4 vectors of 8 byte values (int32 lanes) -> 32 bytes in order v0, v1, v2, v3 */
static inline void store_bytes4(uint8_t *dst, __m256i v0, __m256i v1, __m256i v2, __m256i v3) {
    __m256i p = _mm256_packus_epi16(_mm256_packus_epi32(v0, v1), _mm256_packus_epi32(v2, v3));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)dst, p);
}

static void mxfp8_bf16_avx2(const uint16_t *x, int64_t b0, int64_t b1, uint8_t *q, uint8_t *s) {
    for (int64_t b = b0; b + 8 <= b1; b += 8) {
        const __m256i *src = (const __m256i *)(x + b * 32);
        __m256i m[8];
        for (int k = 0; k < 8; k++) {
            __m256i a = _mm256_max_epu16(_mm256_and_si256(_mm256_loadu_si256(src + 2 * k), _mm256_set1_epi16(0x7FFF)),
                                         _mm256_and_si256(_mm256_loadu_si256(src + 2 * k + 1), _mm256_set1_epi16(0x7FFF)));
            m[k] = pair_max(a);
        }
        __m256 t = _mm256_div_ps(_mm256_castsi256_ps(_mm256_slli_epi32(hmax8(m), 16)), _mm256_set1_ps(448.0f));
        __m256i byte = _mm256_and_si256(_mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(t), I32(0x7FFFFF)), 23),
                                        I32(0xFF));
        byte = _mm256_blendv_epi8(byte, I32(255), _mm256_castps_si256(_mm256_cmp_ps(t, t, _CMP_UNORD_Q)));
        byte = _mm256_max_epi32(byte, I32(1));
        float mult[8];
        int32_t bytes[8];
        _mm256_storeu_ps(mult, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_sub_epi32(I32(254), _mm256_min_epi32(byte, I32(254))), 23)));
        _mm256_storeu_si256((__m256i *)bytes, byte);
        for (int k = 0; k < 8; k++) {
            s[b + k] = (uint8_t)bytes[k];
            __m256 f = _mm256_set1_ps(mult[k]);
            __m256i v[2];
            for (int h = 0; h < 2; h++) {
                __m256i w = _mm256_loadu_si256(src + 2 * k + h);
                __m256i a = _mm256_and_si256(w, _mm256_set1_epi16(0x7FFF));
                /* sign bits: element 2j's (bit 15) to bit 7, element 2j + 1's (bit 31) to bit 15 */
                __m256i sign = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w, 8), I32(0x80)),
                                               _mm256_and_si256(_mm256_srli_epi32(w, 16), I32(0x8000)));
                v[h] = _mm256_or_si256(_mm256_or_si256(e4m3_mag_v(_mm256_mul_ps(even_elems(a), f)),
                                                       _mm256_slli_epi32(e4m3_mag_v(_mm256_mul_ps(odd_elems(a), f)), 8)),
                                       sign);
            }
            /* u16 lanes v0[0..3] v1[0..3] | v0[4..7] v1[4..7] -> v0[0..7] v1[0..7]: 32 bytes in element order */
            __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(v[0], v[1]), 0xD8);
            _mm256_storeu_si256((__m256i *)(q + (b + k) * 32), p);
        }
    }
}

/* NVFP4 blocks b..b+7 of BF16 x: w[k] = block k's 16 elements, a[k] = their |x| patterns;
 * returns the 8 block amaxes as fp32 (lane k = block k) */
static inline __m256 nvfp4_group_load(const uint16_t *x, int64_t b, __m256i w[8], __m256i a[8]) {
    const __m256i *src = (const __m256i *)(x + b * 16);
    __m256i m[8];
    for (int k = 0; k < 8; k++) {
        w[k] = _mm256_loadu_si256(src + k);
        a[k] = _mm256_and_si256(w[k], _mm256_set1_epi16(0x7FFF));
        m[k] = pair_max(a[k]);
    }
    return _mm256_castsi256_ps(_mm256_slli_epi32(hmax8(m), 16));
}

static void nvfp4_te_bf16_avx2(const uint16_t *x, int64_t b0, int64_t b1, float k0, float k1,
                               uint8_t *p, uint8_t *sc) {
    for (int64_t b = b0; b + 8 <= b1; b += 8) {
        __m256i w[8], a[8];
        __m256 s = _mm256_mul_ps(nvfp4_group_load(x, b, w, a), _mm256_set1_ps(k0));
        s = _mm256_blendv_ps(s, _mm256_set1_ps(448.0f), _mm256_cmp_ps(s, _mm256_set1_ps(448.0f), _CMP_GT_OQ));
        __m256i scale = e4m3_mag_v(s); /* s >= 0 or a NaN with the sign bit clear */
        __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_mul_ps(e4m3_value_v(scale), _mm256_set1_ps(k1)));
        const __m256 flt_max = _mm256_set1_ps(3.4028234663852886e38f);
        inv = _mm256_blendv_ps(inv, flt_max, _mm256_cmp_ps(inv, flt_max, _CMP_GT_OQ));
        float f[8];
        int32_t bytes[8];
        _mm256_storeu_ps(f, inv);
        _mm256_storeu_si256((__m256i *)bytes, scale);
        __m256i c[8];
        for (int k = 0; k < 8; k++) {
            sc[b + k] = (uint8_t)bytes[k];
            __m256 fk = _mm256_set1_ps(f[k]);
            /* |x| * f: f > 0 (NaN only in a block holding NaN), so x's own sign bit is te_code()'s
             * sign of x * f: element 2j's (bit 15) to bit 3, element 2j + 1's (bit 31) to bit 7 */
            __m256i sign = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w[k], 12), I32(8)),
                                           _mm256_and_si256(_mm256_srli_epi32(w[k], 24), I32(0x80)));
            c[k] = _mm256_or_si256(_mm256_or_si256(e2m1_mag_v(_mm256_mul_ps(even_elems(a[k]), fk)),
                                                   _mm256_slli_epi32(e2m1_mag_v(_mm256_mul_ps(odd_elems(a[k]), fk)), 4)),
                                   sign);
        }
        store_bytes4(p + b * 8, c[0], c[1], c[2], c[3]);
        store_bytes4(p + b * 8 + 32, c[4], c[5], c[6], c[7]);
    }
}
#endif

/* MXFP8: blocks [b0, b1) of 32 elements -> e4m3 bytes q[32 per block], E8M0 bytes s[1 per block]
 * (RCEIL, at least 1; 255 for a block holding NaN or inf). One loop body per input kind: a kind
 * test inside the element loops keeps them from vectorizing. */
void qc_mxfp8(const void *x, int kind, int64_t b0, int64_t b1, uint8_t *q, uint8_t *s) {
#ifdef __AVX2__
    if (kind == 0 && getenv("QCONVERT_NO_AVX2") == NULL) {
        int64_t full = b0 + (b1 - b0) / 8 * 8;
        mxfp8_bf16_avx2((const uint16_t *)x, b0, full, q, s);
        b0 = full;
    }
#endif
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

#if defined(__AVX2__) && defined(__FMA__)
/* NVFP4, ModelOpt recipe, BF16: v = RN(x / d) per element without a division per element: one
 * reciprocal r = RN(1 / d) per block, q = RN(x * r) and Markstein's correction
 * v = fma(fma(-q, d, x), r, q), the correctly rounded quotient barring underflow and overflow. For
 * groups whose 8 divisors all lie in [2^-60, 2^16] neither can touch a quotient of 2^-3 or more
 * (below which the E2M1 code is 0), and no nonzero BF16 x has a quotient that rounds to zero, so
 * ModelOpt's sign (v < 0) is x < 0. Other groups run the portable loop. The same arithmetic as the
 * ModelOpt Triton kernel, checked against IEEE division by scripts/gpu_division_check.py. */
static void nvfp4_modelopt_bf16_avx2(const uint16_t *x, int64_t b0, int64_t b1, float k0, float k1, int g_zero,
                                     uint8_t *p, uint8_t *sc) {
    const __m256 lo = _mm256_set1_ps(8.673617379884035e-19f), hi = _mm256_set1_ps(65536.0f);
    const __m256 gz = _mm256_castsi256_ps(_mm256_set1_epi32(g_zero ? -1 : 0));
    for (int64_t b = b0; b + 8 <= b1; b += 8) {
        __m256i w[8], a[8];
        __m256 s = _mm256_div_ps(nvfp4_group_load(x, b, w, a), _mm256_set1_ps(k0));
        s = _mm256_blendv_ps(s, _mm256_set1_ps(1.0f), _mm256_or_ps(_mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_EQ_OQ), gz));
        s = _mm256_blendv_ps(s, _mm256_set1_ps(448.0f), _mm256_cmp_ps(s, _mm256_set1_ps(448.0f), _CMP_GT_OQ));
        s = _mm256_blendv_ps(s, _mm256_set1_ps(0.001953125f), _mm256_cmp_ps(s, _mm256_set1_ps(0.001953125f), _CMP_LT_OQ));
        __m256i scale = e4m3_mag_v(s); /* s >= 2^-9 or a NaN with the sign bit clear */
        __m256 d = _mm256_blendv_ps(_mm256_mul_ps(e4m3_value_v(scale), _mm256_set1_ps(k1)), _mm256_set1_ps(1.0f), gz);
        __m256 in = _mm256_and_ps(_mm256_cmp_ps(d, lo, _CMP_GE_OQ), _mm256_cmp_ps(d, hi, _CMP_LE_OQ));
        if (_mm256_movemask_ps(in) != 0xFF) {
            nvfp4_range(x, 0, b, b + 8, 0, k0, k1, g_zero, p, sc);
            continue;
        }
        float r[8], dv[8];
        int32_t bytes[8];
        _mm256_storeu_ps(r, _mm256_div_ps(_mm256_set1_ps(1.0f), d));
        _mm256_storeu_ps(dv, d);
        _mm256_storeu_si256((__m256i *)bytes, scale);
        __m256i c[8];
        for (int k = 0; k < 8; k++) {
            sc[b + k] = (uint8_t)bytes[k];
            __m256 rk = _mm256_set1_ps(r[k]), dk = _mm256_set1_ps(dv[k]);
            __m256 xe = even_elems(a[k]), xo = odd_elems(a[k]); /* |x|: v(|x|) = |v(x)| */
            __m256 qe = _mm256_mul_ps(xe, rk), qo = _mm256_mul_ps(xo, rk);
            __m256 ve = _mm256_fmadd_ps(_mm256_fnmadd_ps(qe, dk, xe), rk, qe);
            __m256 vo = _mm256_fmadd_ps(_mm256_fnmadd_ps(qo, dk, xo), rk, qo);
            const __m256 zero = _mm256_setzero_ps();
            __m256i sign = _mm256_or_si256(
                _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(even_elems(w[k]), zero, _CMP_LT_OQ)), I32(8)),
                _mm256_and_si256(_mm256_castps_si256(_mm256_cmp_ps(odd_elems(w[k]), zero, _CMP_LT_OQ)), I32(0x80)));
            c[k] = _mm256_or_si256(_mm256_or_si256(e2m1_mag_v(ve), _mm256_slli_epi32(e2m1_mag_v(vo), 4)), sign);
        }
        store_bytes4(p + b * 8, c[0], c[1], c[2], c[3]);
        store_bytes4(p + b * 8 + 32, c[4], c[5], c[6], c[7]);
    }
}
#endif

void qc_nvfp4(const void *x, int kind, int64_t b0, int64_t b1, int te, float k0, float k1, int g_zero,
              uint8_t *p, uint8_t *sc) {
#ifdef __AVX2__
    if (kind == 0 && te && getenv("QCONVERT_NO_AVX2") == NULL) {
        int64_t full = b0 + (b1 - b0) / 8 * 8;
        nvfp4_te_bf16_avx2((const uint16_t *)x, b0, full, k0, k1, p, sc);
        b0 = full;
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    if (kind == 0 && !te && getenv("QCONVERT_NO_AVX2") == NULL) {
        int64_t full = b0 + (b1 - b0) / 8 * 8;
        nvfp4_modelopt_bf16_avx2((const uint16_t *)x, b0, full, k0, k1, g_zero, p, sc);
        b0 = full;
    }
#endif
    if (kind == 0) nvfp4_range(x, 0, b0, b1, te, k0, k1, g_zero, p, sc);
    else nvfp4_range(x, 1, b0, b1, te, k0, k1, g_zero, p, sc);
}

/* NVFP4, 4over6 recipe (TransformerEngine 2.17, E4M3 max 256, MAE; nvfp4.py's module docstring):
 * each block quantized twice, its maximum mapped to 6 (s6) and to 4 (s4 = e4m3(1.5 * base)), and
 * the candidate whose decoded block has the smaller sum of |decoded - x| kept (ties and NaN: s6).
 * s_enc = S_enc, s_dec = S_dec, g = the global amax (the error decodes with g / 1536). */

/* E2M1 value of a signed 4-bit code: magnitudes 2..7 are (1 + (c & 1) / 2) * 2^(c / 2 - 1), the
 * fp32 bits (252 + c) << 22; 0 and 1 are c * 0.5. Code 8 gives -0.0, as e2m1_to_float. */
static inline float e2m1_value(uint32_t code) {
    uint32_t c = code & 7u;
    uint32_t mag = sel(c < 2u, f2u((float)(int32_t)c * 0.5f), (252u + c) << 22);
    return u2f(mag | ((code & 8u) << 28));
}

static inline __attribute__((always_inline)) void nvfp4_4over6_range(const void *x, const int kind, int64_t b0,
                                                                    int64_t b1, float s_enc, float s_dec, float g,
                                                                    uint8_t *restrict p, uint8_t *restrict sc) {
    const float flt_max = 3.4028234663852886e38f;
    uint32_t am[G], scale6[G], scale4[G];
    float f6[G], f4[G], sf6[G], sf4[G];
    float fe6[G * 8], fe4[G * 8], se6[G * 8], se4[G * 8]; /* per pair of elements, as spread() */
    uint8_t byte6[G * 8], byte4[G * 8];
    /* |decoded - x| of elements 2j (even) and 2j + 1 (odd) of each block, one array each: the loop
     * over pairs vectorizes only with contiguous stores */
    float e6e[G * 8], e6o[G * 8], e4e[G * 8], e4o[G * 8];
    for (int64_t b = b0; b < b1; b += G) {
        int n = b1 - b < G ? (int)(b1 - b) : G;
        group_absmax(x, kind, b, n, 16, am);
        for (int k = 0; k < n; k++) {
            float base = (u2f(am[k]) / 6.0f) * s_enc;
            float s = fsel(base > 448.0f, 448.0f, base); /* NaN stays NaN */
            float t = base * 1.5f;
            t = fsel(t > 448.0f, 448.0f, t);
            scale6[k] = e4m3(s);
            scale4[k] = e4m3(t);
            sf6[k] = e4m3_value(scale6[k]);
            sf4[k] = e4m3_value(scale4[k]);
            float i6 = 1.0f / (sf6[k] * s_dec), i4 = 1.0f / (sf4[k] * s_dec);
            f6[k] = fsel(i6 > flt_max, flt_max, i6);
            f4[k] = fsel(i4 > flt_max, flt_max, i4);
        }
        spread(f6, n, fe6);
        spread(f4, n, fe4);
        spread(sf6, n, se6);
        spread(sf4, n, se4);
        for (int m = 0; m < n * 8; m++) {
            float lo, hi;
            elem_pair(x, kind, b * 16, m, &lo, &hi);
            uint32_t l = te_code(lo * fe6[m]), h = te_code(hi * fe6[m]);
            byte6[m] = (uint8_t)(l | (h << 4));
            e6e[m] = fabs_bits(((e2m1_value(l) * se6[m]) * g) / 1536.0f - lo);
            e6o[m] = fabs_bits(((e2m1_value(h) * se6[m]) * g) / 1536.0f - hi);
        }
        for (int m = 0; m < n * 8; m++) {
            float lo, hi;
            elem_pair(x, kind, b * 16, m, &lo, &hi);
            uint32_t l = te_code(lo * fe4[m]), h = te_code(hi * fe4[m]);
            byte4[m] = (uint8_t)(l | (h << 4));
            e4e[m] = fabs_bits(((e2m1_value(l) * se4[m]) * g) / 1536.0f - lo);
            e4o[m] = fabs_bits(((e2m1_value(h) * se4[m]) * g) / 1536.0f - hi);
        }
        /* the errors summed in element order from 0, block by block (the loop runs across blocks) */
        float e6[G], e4[G];
        for (int k = 0; k < G; k++) e6[k] = e4[k] = 0.0f;
        for (int j = 0; j < 8; j++)
            for (int k = 0; k < n; k++) {
                e6[k] = (e6[k] + e6e[8 * k + j]) + e6o[8 * k + j];
                e4[k] = (e4[k] + e4e[8 * k + j]) + e4o[8 * k + j];
            }
        for (int k = 0; k < n; k++) {
            uint32_t four = e4[k] < e6[k];
            sc[b + k] = (uint8_t)sel(four, scale4[k], scale6[k]);
            for (int j = 0; j < 8; j++) p[(b + k) * 8 + j] = (uint8_t)sel(four, byte4[8 * k + j], byte6[8 * k + j]);
        }
    }
}

#ifdef __AVX2__
/* 8x8 transpose of fp32 lanes: r[j] lane k = v[k] lane j */
static inline void transpose8(const __m256 v[8], __m256 r[8]) {
    __m256 t[8], u[8];
    for (int k = 0; k < 4; k++) {
        t[2 * k] = _mm256_unpacklo_ps(v[2 * k], v[2 * k + 1]);
        t[2 * k + 1] = _mm256_unpackhi_ps(v[2 * k], v[2 * k + 1]);
    }
    for (int k = 0; k < 2; k++) {
        u[4 * k] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0x44);
        u[4 * k + 1] = _mm256_shuffle_ps(t[4 * k], t[4 * k + 2], 0xEE);
        u[4 * k + 2] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0x44);
        u[4 * k + 3] = _mm256_shuffle_ps(t[4 * k + 1], t[4 * k + 3], 0xEE);
    }
    for (int j = 0; j < 4; j++) {
        r[j] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x20);
        r[j + 4] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x31);
    }
}

/* One candidate of 8 BF16 blocks (w, a as nvfp4_group_load gives them) with block scales sf
 * (lane k = block k): packed codes c[k] (int32 lanes, as store_bytes4 takes them) and the error
 * sums (lane k = block k). The decoded magnitudes of block k are the 8-entry table
 * ((level * sf_k) * g) / 1536, looked up by magnitude code (a lane permute); the decoded value has
 * x's sign (te_code's sign is x's sign bit), so |decoded - x| = |table[code] - |x||. */
static inline __m256 four_over_six_candidate(const __m256i w[8], const __m256i a[8], __m256 sf, __m256 s_dec,
                                             __m256 g, __m256i c[8]) {
    const __m256 flt_max = _mm256_set1_ps(3.4028234663852886e38f);
    const __m256 levels = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
    __m256 inv = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_mul_ps(sf, s_dec));
    inv = _mm256_blendv_ps(inv, flt_max, _mm256_cmp_ps(inv, flt_max, _CMP_GT_OQ));
    float f[8], s[8];
    _mm256_storeu_ps(f, inv);
    _mm256_storeu_ps(s, sf);
    __m256 de[8], dodd[8];
    for (int k = 0; k < 8; k++) {
        __m256 fk = _mm256_set1_ps(f[k]);
        __m256 table = _mm256_div_ps(_mm256_mul_ps(_mm256_mul_ps(levels, _mm256_set1_ps(s[k])), g),
                                     _mm256_set1_ps(1536.0f));
        __m256 xe = even_elems(a[k]), xo = odd_elems(a[k]);
        __m256i me = e2m1_mag_v(_mm256_mul_ps(xe, fk)), mo = e2m1_mag_v(_mm256_mul_ps(xo, fk));
        const __m256 abs_mask = _mm256_castsi256_ps(I32(0x7FFFFFFF));
        de[k] = _mm256_and_ps(_mm256_sub_ps(_mm256_permutevar8x32_ps(table, me), xe), abs_mask);
        dodd[k] = _mm256_and_ps(_mm256_sub_ps(_mm256_permutevar8x32_ps(table, mo), xo), abs_mask);
        __m256i sign = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(w[k], 12), I32(8)),
                                       _mm256_and_si256(_mm256_srli_epi32(w[k], 24), I32(0x80)));
        c[k] = _mm256_or_si256(_mm256_or_si256(me, _mm256_slli_epi32(mo, 4)), sign);
    }
    __m256 te[8], to[8];
    transpose8(de, te);
    transpose8(dodd, to);
    __m256 err = _mm256_setzero_ps();
    for (int j = 0; j < 8; j++) err = _mm256_add_ps(_mm256_add_ps(err, te[j]), to[j]); /* elements 2j, 2j + 1 */
    return err;
}

static void nvfp4_4over6_bf16_avx2(const uint16_t *x, int64_t b0, int64_t b1, float s_enc, float s_dec, float g,
                                   uint8_t *p, uint8_t *sc) {
    const __m256 e4m3_max = _mm256_set1_ps(448.0f);
    for (int64_t b = b0; b + 8 <= b1; b += 8) {
        __m256i w[8], a[8];
        __m256 base = _mm256_mul_ps(_mm256_div_ps(nvfp4_group_load(x, b, w, a), _mm256_set1_ps(6.0f)),
                                    _mm256_set1_ps(s_enc));
        __m256 s6 = _mm256_blendv_ps(base, e4m3_max, _mm256_cmp_ps(base, e4m3_max, _CMP_GT_OQ));
        __m256 s4 = _mm256_mul_ps(base, _mm256_set1_ps(1.5f));
        s4 = _mm256_blendv_ps(s4, e4m3_max, _mm256_cmp_ps(s4, e4m3_max, _CMP_GT_OQ));
        __m256i scale6 = e4m3_mag_v(s6), scale4 = e4m3_mag_v(s4); /* >= 0, or a NaN with the sign bit clear */
        __m256i c6[8], c4[8];
        __m256 err6 = four_over_six_candidate(w, a, e4m3_value_v(scale6), _mm256_set1_ps(s_dec), _mm256_set1_ps(g), c6);
        __m256 err4 = four_over_six_candidate(w, a, e4m3_value_v(scale4), _mm256_set1_ps(s_dec), _mm256_set1_ps(g), c4);
        __m256i four = _mm256_castps_si256(_mm256_cmp_ps(err4, err6, _CMP_LT_OQ)); /* NaN: false, map-to-6 */
        int32_t bytes[8], pick[8];
        _mm256_storeu_si256((__m256i *)bytes, _mm256_blendv_epi8(scale6, scale4, four));
        _mm256_storeu_si256((__m256i *)pick, four);
        __m256i c[8];
        for (int k = 0; k < 8; k++) {
            sc[b + k] = (uint8_t)bytes[k];
            c[k] = _mm256_blendv_epi8(c6[k], c4[k], _mm256_set1_epi32(pick[k]));
        }
        store_bytes4(p + b * 8, c[0], c[1], c[2], c[3]);
        store_bytes4(p + b * 8 + 32, c[4], c[5], c[6], c[7]);
    }
}
#endif

void qc_nvfp4_4over6(const void *x, int kind, int64_t b0, int64_t b1, float s_enc, float s_dec, float g, uint8_t *p,
                     uint8_t *sc) {
#ifdef __AVX2__
    if (kind == 0 && getenv("QCONVERT_NO_AVX2") == NULL) {
        int64_t full = b0 + (b1 - b0) / 8 * 8;
        nvfp4_4over6_bf16_avx2((const uint16_t *)x, b0, full, s_enc, s_dec, g, p, sc);
        b0 = full;
    }
#endif
    if (kind == 0) nvfp4_4over6_range(x, 0, b0, b1, s_enc, s_dec, g, p, sc);
    else nvfp4_4over6_range(x, 1, b0, b1, s_enc, s_dec, g, p, sc);
}

/* 1 where the AVX2 loops were compiled in (a -march=native build on an AVX2 CPU) */
int qc_avx2(void) {
#ifdef __AVX2__
    return 1;
#else
    return 0;
#endif
}

/* absmax_bits for Python: the global amax of NVFP4 and the finiteness check of kept tensors */
uint32_t qc_absmax_bits(const void *x, int kind, int64_t i0, int64_t i1) {
    return absmax_bits(x, kind, i0, i1);
}

/* one block of qc_decode_stats: elementwise into arrays, then reductions the compiler vectorizes
 * (integer maxima and ORs; the double sums over 4 interleaved partial sums: a different summation
 * order than torch's, the same value to ~1e-15 relative) */
static inline __attribute__((always_inline)) void stats_block(const float *restrict d, const float *restrict xv, int bs,
                                                              double *restrict acc, uint32_t *bad, uint32_t *eb, uint32_t *am) {
    float err[32];
    uint32_t nf = 0, emax = 0, xmax = 0;
    for (int i = 0; i < bs; i++) {
        err[i] = d[i] - xv[i];
        nf |= (f2u(d[i]) & 0x7F800000u) == 0x7F800000u;
        const uint32_t ea = f2u(err[i]) & 0x7FFFFFFFu, xa = f2u(xv[i]) & 0x7FFFFFFFu;
        emax = ea > emax ? ea : emax;
        xmax = xa > xmax ? xa : xmax;
    }
    for (int i = 0; i < bs; i += 4)
        for (int l = 0; l < 4; l++) {
            acc[l] += (double)xv[i + l] * (double)xv[i + l];
            acc[4 + l] += (double)err[i + l] * (double)err[i + l];
        }
    *bad |= nf;
    *eb = emax;
    *am = xmax;
}

/* Decode error statistics for `qconvert verify` over blocks [b0, b1) of bs elements (32 MXFP8,
 * 16 NVFP4) of source x. Each element decodes as d = elem_lut[code] * (scale_lut[scale byte] * s2)
 * in fp32, the operation order of mxfp8_dequantize / nvfp4_dequantize (the Python caller builds
 * both tables with those functions' own dtype conversions); codes are one byte per element
 * (nibbles == 0) or two per byte, element 2j in the low nibble (nibbles == 1). With err = d - x in
 * fp32: sums[0] = sum x^2 and sums[1] = sum err^2 (in double), *nonfinite = 1 if any d is NaN or
 * +-inf; per block r = max|err| / (bound * max|x| + atol) in fp32 (a NaN max propagates; r NaN
 * counts as inf and inf as FLT_MAX, as torch.nan_to_num(r, nan=inf) gives), *worst = max r and
 * *first = the first block with r > 1, or -1. verify.compare() is the torch statement of this. */
void qc_decode_stats(const void *x, int kind, int64_t b0, int64_t b1, int bs, int nibbles,
                     const uint8_t *codes, const uint8_t *scales, const float *elem_lut,
                     const float *scale_lut, float s2, float bound, float atol,
                     double *sums, int32_t *nonfinite, float *worst, int64_t *first) {
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    uint32_t bad = 0;
    float w = 0.0f;
    int64_t f = -1;
    float d[32], xv[32];
    for (int64_t b = b0; b < b1; b++) {
        const float mult = scale_lut[scales[b]] * s2;
        const int64_t e0 = b * bs;
        if (nibbles)
            for (int j = 0; j < bs / 2; j++) {
                const uint32_t byte = codes[(e0 >> 1) + j];
                d[2 * j] = elem_lut[byte & 0xFu] * mult;
                d[2 * j + 1] = elem_lut[byte >> 4] * mult;
            }
        else
            for (int i = 0; i < bs; i++) d[i] = elem_lut[codes[e0 + i]] * mult;
        if (kind == 0)
            for (int i = 0; i < bs; i++) xv[i] = u2f((uint32_t)((const uint16_t *)x)[e0 + i] << 16);
        else
            for (int i = 0; i < bs; i++) xv[i] = ((const float *)x)[e0 + i];
        uint32_t eb, am;
        stats_block(d, xv, bs, acc, &bad, &eb, &am);
        float r = u2f(eb) / (bound * u2f(am) + atol);
        if (r != r) r = u2f(0x7F800000u);
        else if (f2u(r) == 0x7F800000u) r = 3.4028234663852886e38f;
        if (r > w) w = r;
        if (r > 1.0f && f < 0) f = b;
    }
    sums[0] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    sums[1] = (acc[4] + acc[5]) + (acc[6] + acc[7]);
    *nonfinite = (int32_t)bad;
    *worst = w;
    *first = f;
}

/* MXFP8 to BF16: blocks [b0, b1) of 32 E4M3 codes ``q`` with one E8M0 byte each in ``s``, into
 * ``out``: the fp32 product of the code's value and 2^(s-127) (2^-127 an fp32 subnormal, 255 gives
 * 2^128 = inf, as fp32 exp2 does), rounded to BF16 to nearest even; a NaN is written 0xFFFF (what
 * torch's vectorized fp32 -> bf16 conversion writes). One IEEE multiply and one rounding per
 * element, the same operations as torch's ``(q.float() * exp2(s - 127.0)).to(bfloat16)``
 * (docs/formats.md#mxfp8-dequantization-for-cpu-experts). Branch-free, so the loop vectorizes. */
static inline uint16_t bf16_rne_nan_ffff(float f) {
    uint32_t u = f2u(f);
    uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)sel((u & 0x7FFFFFFFu) > 0x7F800000u, 0xFFFFu, r);
}

/* The same bits in 16-bit integer lanes, for scale bytes 10..246, where every product is a normal
 * BF16 value (an E4M3 value has at most 4 significant bits and lies in [2^-9, 448]), so it is exact
 * and needs no rounding: the code's BF16 bits with 2^(e-127) added to the exponent field. ``kk`` is
 * (e - 7) << 7: the exponent field of a normal code 1.m x 2^(E-7) times 2^(e-127) is E + e - 7. */
static inline uint16_t mx8_bf16_exact(uint16_t c, uint16_t kk) {
    const uint16_t mag = c & 0x7Fu, m = c & 7u;
    const uint16_t nor = (uint16_t)((mag << 4) + kk); /* mag << 4 is E << 7 | m << 4 */
    /* subnormal code m x 2^-9 = 2^(p-9) x (1 + f), p = floor(log2 m): field e - 9 + p */
    const uint16_t p = (uint16_t)((m >= 2) + (m >= 4));
    const uint16_t mul = p == 0 ? 128u : p == 1 ? 64u : 32u;
    const uint16_t sub = (uint16_t)(kk + (p << 7) - (2u << 7) + ((m * mul) & 0x7Fu));
    uint16_t r = (mag >> 3) ? nor : sub;
    r = mag == 0 ? 0 : r;
    r |= (uint16_t)((c & 0x80u) << 8);
    return mag == 0x7Fu ? (uint16_t)0xFFFFu : r;
}

static void mxfp8_to_bf16_portable(const uint8_t *restrict q, const uint8_t *restrict s, int64_t b0, int64_t b1,
                                   uint16_t *restrict out) {
    for (int64_t b = b0; b < b1; b++) {
        const uint32_t e = s[b];
        const uint8_t *restrict qb = q + b * 32;
        uint16_t *restrict ob = out + b * 32;
        if (e >= 10 && e <= 246) {
            const uint16_t kk = (uint16_t)((e - 7u) << 7);
            for (int i = 0; i < 32; i++) ob[i] = mx8_bf16_exact(qb[i], kk);
        } else {
            const float sc = u2f(e == 0 ? 0x00400000u : e == 255 ? 0x7F800000u : e << 23);
            for (int i = 0; i < 32; i++) ob[i] = bf16_rne_nan_ffff(e4m3_value(qb[i]) * sc);
        }
    }
}

#ifdef __AVX2__
/* The low (h = 0) or high (h = 1) in-lane byte interleave of a and b, as 16-bit lanes. */
static inline __m256i unpack_epi8(int h, __m256i a, __m256i b) {
    return h ? _mm256_unpackhi_epi8(a, b) : _mm256_unpacklo_epi8(a, b);
}

/* mx8_bf16_exact() for a whole block in AVX2, the codes kept as bytes as long as possible: masks
 * (normal, zero, NaN) and the sign are byte compares, and a subnormal code's offset from kk, which
 * depends only on its 3 mantissa bits, is looked up by byte shuffles of a 16-bit table split in
 * low and high bytes; the bytes are then widened to 16-bit lanes (in-lane unpack: elements 0-7 and
 * 16-23, then 8-15 and 24-31), kk added, and stored in element order. Scale bytes outside 10..246
 * take the portable block. */
static void mxfp8_to_bf16_avx2(const uint8_t *restrict q, const uint8_t *restrict s, int64_t b0, int64_t b1,
                               uint16_t *restrict out) {
    uint8_t lo[16], hi[16];
    for (int m = 0; m < 16; m++) { /* the subnormal code m & 7 with kk = 0 (entry 0: code 0, masked) */
        const uint16_t off = mx8_bf16_exact((uint16_t)(m & 7), 0);
        lo[m] = (uint8_t)off;
        hi[m] = (uint8_t)(off >> 8);
    }
    const __m256i tlo = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)lo));
    const __m256i thi = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)hi));
    const __m256i m7f = _mm256_set1_epi8(0x7F), m07 = _mm256_set1_epi8(7), zero = _mm256_setzero_si256();
    for (int64_t b = b0; b < b1; b++) {
        const uint32_t e = s[b];
        if (e < 10 || e > 246) {
            mxfp8_to_bf16_portable(q, s, b, b + 1, out);
            continue;
        }
        const __m256i kk = _mm256_set1_epi16((short)((e - 7u) << 7));
        const __m256i c = _mm256_loadu_si256((const __m256i *)(q + b * 32));
        const __m256i mag = _mm256_and_si256(c, m7f), m = _mm256_and_si256(c, m07);
        const __m256i sl = _mm256_shuffle_epi8(tlo, m), sh = _mm256_shuffle_epi8(thi, m);
        const __m256i normal = _mm256_cmpgt_epi8(mag, m07); /* mag <= 127: a signed compare is right */
        const __m256i iszero = _mm256_cmpeq_epi8(mag, zero), isnan = _mm256_cmpeq_epi8(mag, m7f);
        const __m256i sign = _mm256_and_si256(c, _mm256_set1_epi8((char)0x80));
        __m256i r[2];
        for (int h = 0; h < 2; h++) {
            const __m256i nor16 = _mm256_slli_epi16(unpack_epi8(h, mag, zero), 4);
            __m256i v = _mm256_blendv_epi8(unpack_epi8(h, sl, sh), nor16, unpack_epi8(h, normal, normal));
            v = _mm256_andnot_si256(unpack_epi8(h, iszero, iszero), _mm256_add_epi16(v, kk));
            v = _mm256_or_si256(v, unpack_epi8(h, zero, sign));
            r[h] = _mm256_or_si256(v, unpack_epi8(h, isnan, isnan));
        }
        uint16_t *restrict ob = out + b * 32;
        _mm256_storeu_si256((__m256i *)ob, _mm256_permute2x128_si256(r[0], r[1], 0x20));
        _mm256_storeu_si256((__m256i *)(ob + 16), _mm256_permute2x128_si256(r[0], r[1], 0x31));
    }
}
#endif

void qc_mxfp8_to_bf16(const uint8_t *restrict q, const uint8_t *restrict s, int64_t b0, int64_t b1,
                      uint16_t *restrict out) {
#ifdef __AVX2__
    if (getenv("QCONVERT_NO_AVX2") == NULL) {
        mxfp8_to_bf16_avx2(q, s, b0, b1, out);
        return;
    }
#endif
    mxfp8_to_bf16_portable(q, s, b0, b1, out);
}

/* NVFP4 to BF16: blocks [b0, b1) of 16 E2M1 codes (8 bytes in ``q``, the low nibble first) with one
 * E4M3 scale byte each in ``s``; block b's per-tensor scale (weight_scale_2) is ``g[b / bpr]``, so
 * one call covers a stack of experts or the gate and up halves of a fused weight, each row with its
 * own. Each element is the E2M1 value times the fp32 product of the E4M3 scale's value and g, that
 * product rounded to fp32, then rounded to BF16 to nearest even, NaN written 0xFFFF: the operations
 * of vLLM's torch dequantization for NVFP4 on CPU (docs/formats.md#nvfp4-dequantization-for-cpu-layers).
 * The E2M1 value is built from its bits (magnitude m >= 2: 0x3F000000 + (m << 22); 1: 0.5; 0: 0),
 * branch-free, so the element loop vectorizes. */
static inline uint32_t e2m1_bits(uint32_t nib) {
    const uint32_t m = nib & 7u;
    uint32_t mag = sel(m >= 2u, 0x3F000000u + (m << 22), sel(m == 1u, 0x3F000000u, 0u));
    return mag | ((nib & 8u) << 28);
}

#ifdef __AVX2__
static inline __m256i e2m1_bits_v(__m256i c) { /* e2m1_bits() lane by lane */
    const __m256i m = _mm256_and_si256(c, I32(7));
    __m256i r = _mm256_add_epi32(I32(0x3F000000), _mm256_slli_epi32(m, 22));
    r = _mm256_blendv_epi8(r, I32(0x3F000000), _mm256_cmpeq_epi32(m, I32(1)));
    r = _mm256_andnot_si256(_mm256_cmpeq_epi32(m, I32(0)), r);
    return _mm256_or_si256(r, _mm256_slli_epi32(_mm256_and_si256(c, I32(8)), 28));
}

static inline __m256i bf16_rne_nan_ffff_v(__m256 f) { /* bf16_rne_nan_ffff() lane by lane, in int32 lanes */
    const __m256i u = _mm256_castps_si256(f);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), I32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, I32(0x7FFF)), lsb), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, I32(0x7FFFFFFF)), I32(0x7F800000));
    return _mm256_or_si256(r, _mm256_and_si256(nan, I32(0xFFFF)));
}

/* The AVX2 loop looks every element up instead of computing it: an element's BF16 bits depend only
 * on its code (16), its block's scale byte (256) and its row's per-tensor scale g. So for the row
 * being converted, the 16 results of a scale byte are computed once, by the same lane arithmetic as
 * above (the fp32 product e4m3 x g, times the E2M1 value, rounded), when a block first uses that
 * byte, and kept as two byte planes (low and high bytes of the BF16 bits), for as long as the rows
 * have the same per-tensor scale bits (the plugin passes one per weight row, equal along an expert);
 * a block is then two shuffles of those planes by its 16 codes. */
static void nvfp4_lut_row(uint8_t sb, float g, uint8_t *restrict lo, uint8_t *restrict hi) {
    const __m256 sc = _mm256_set1_ps(e4m3_value(sb) * g);
    const __m256i c0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), c1 = _mm256_add_epi32(c0, I32(8));
    uint32_t r[16];
    _mm256_storeu_si256((__m256i *)r, bf16_rne_nan_ffff_v(_mm256_mul_ps(_mm256_castsi256_ps(e2m1_bits_v(c0)), sc)));
    _mm256_storeu_si256((__m256i *)(r + 8), bf16_rne_nan_ffff_v(_mm256_mul_ps(_mm256_castsi256_ps(e2m1_bits_v(c1)), sc)));
    for (int i = 0; i < 16; i++) {
        lo[i] = (uint8_t)r[i];
        hi[i] = (uint8_t)(r[i] >> 8);
    }
}

static void nvfp4_to_bf16_avx2(const uint8_t *restrict q, const uint8_t *restrict s, const float *restrict g,
                               int64_t bpr, int64_t b0, int64_t b1, uint16_t *restrict out) {
    uint8_t lo[256][16], hi[256][16];
    uint64_t made[4] = {0, 0, 0, 0};
    uint32_t made_for = 0; /* the bits of the per-tensor scale the tables were made for */
    const __m128i low4 = _mm_set1_epi8(0x0F);
    for (int64_t b = b0; b < b1;) {
        const int64_t row = b / bpr, end = (row + 1) * bpr < b1 ? (row + 1) * bpr : b1;
        const float gr = g[row];
        if (b == b0 || f2u(gr) != made_for) { /* rows of one expert share g: their tables too */
            made[0] = made[1] = made[2] = made[3] = 0;
            made_for = f2u(gr);
        }
        for (; b < end; b++) {
            const uint8_t sb = s[b];
            if (!((made[sb >> 6] >> (sb & 63)) & 1u)) {
                nvfp4_lut_row(sb, gr, lo[sb], hi[sb]);
                made[sb >> 6] |= (uint64_t)1 << (sb & 63);
            }
            const __m128i bytes = _mm_loadl_epi64((const __m128i *)(q + b * 8));
            const __m128i codes = _mm_unpacklo_epi8(_mm_and_si128(bytes, low4), _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
            const __m128i l = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)lo[sb]), codes);
            const __m128i h = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)hi[sb]), codes);
            _mm_storeu_si128((__m128i *)(out + b * 16), _mm_unpacklo_epi8(l, h));
            _mm_storeu_si128((__m128i *)(out + b * 16 + 8), _mm_unpackhi_epi8(l, h));
        }
    }
}
#endif

void qc_nvfp4_to_bf16(const uint8_t *restrict q, const uint8_t *restrict s, const float *restrict g, int64_t bpr,
                      int64_t b0, int64_t b1, uint16_t *restrict out) {
#ifdef __AVX2__
    if (getenv("QCONVERT_NO_AVX2") == NULL) {
        nvfp4_to_bf16_avx2(q, s, g, bpr, b0, b1, out);
        return;
    }
#endif
    for (int64_t b = b0; b < b1; b++) {
        const float sc = e4m3_value(s[b]) * g[b / bpr];
        const uint8_t *restrict qb = q + b * 8;
        uint16_t *restrict ob = out + b * 16;
        for (int i = 0; i < 16; i++) {
            const uint32_t c = ((uint32_t)qb[i >> 1] >> ((i & 1) << 2)) & 15u;
            ob[i] = bf16_rne_nan_ffff(u2f(e2m1_bits(c)) * sc);
        }
    }
}
