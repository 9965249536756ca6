/* hybridkv's CPU kernels: plain C (no torch headers: it builds in about a
 * second), compiled for the machine at install time or by `hybridkv
 * build-kernels` (build.py), called through ctypes (library.py). OpenMP
 * shares the process's runtime, the libgomp torch has loaded, so its
 * threads are torch's.
 *
 * The boundary is this file: library.py reads the structs and the
 * signatures of the exported (non-static) functions below and declares
 * them to ctypes from here, and checks the structs' sizes against
 * `struct_sizes` when it loads the library; check.py tests every exported
 * function against torch before the backend uses any.
 *
 * decode_attention: one query token per row, attended over its own keys
 * where they lie in the paged pool: no copy of the keys first. The torch
 * reference (backends/reference) gathers every page a decode group reads,
 * then reads the copy again in two batched products; this reads each key
 * and value once. Attention sinks (gpt-oss: a learned logit per query head,
 * in each softmax's denominator only) are one more term in the maximum and
 * the sum of the softmax; they read nothing from the pool.
 *
 * Storage types (`dtype` arguments and fields, enum below): float32, or
 * bfloat16, which is widened to float32 where it is read and rounded to
 * the nearest even where it is written, as torch converts. Every sum,
 * norm and softmax is float32 either way. The typed loads and stores take
 * the type as an argument: where it is a constant (each hot loop is
 * inlined once per type below its dispatch), they compile to the plain
 * float32 load or to the widening one, with no branch left.
 */
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* Sixteen floats: one AVX-512 register, two AVX2 ones; the compiler picks. */
#define LANES 16
typedef float vec __attribute__((vector_size(LANES * sizeof(float))));
typedef int32_t ivec __attribute__((vector_size(LANES * sizeof(int32_t))));

static inline vec load(const float *p)
{
    vec v;
    memcpy(&v, p, sizeof v); /* unaligned */
    return v;
}

static inline void store(float *p, vec v) { memcpy(p, &v, sizeof v); }

static inline float sum_lanes(vec v)
{
    float s = 0.0f;
    for (int i = 0; i < LANES; i++)
        s += v[i];
    return s;
}

static inline vec splat(float x) { return (vec){0} + x; }

/* Inlined into every caller, so that a storage type given as a constant
 * specialises the loops around it. */
#define INLINE static inline __attribute__((always_inline))

/* Storage types. I8, E4M3 (float8_e4m3fn) and E5M2 (float8_e5m2): a
 * quantized page's codes (kv_quant.py), each K/V row with its float32
 * scale (`paged_cache`); read by decode attention, written by the decoder
 * layer's store. */
enum { F32 = 0, BF16 = 1, I8 = 2, E4M3 = 3, E5M2 = 4 };

static inline int is_code(int t) { return t >= I8; }

typedef uint16_t hvec __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t uvec __attribute__((vector_size(LANES * sizeof(uint32_t))));

/* The float32 bits of v rounded to bfloat16, to the nearest even (an
 * overflow rounds to infinity), in float32's layout: the low half zero.
 * NaN stays NaN (torch's 0x7FC0). */
static inline uvec bf16_bits(vec v)
{
    uvec bits;
    memcpy(&bits, &v, sizeof bits);
    const uvec rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000u;
    const uvec nan = (uvec)(v != v);
    return (nan & 0x7FC00000u) | (~nan & rounded);
}

static inline uint32_t bf16_bits1(float f)
{
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return f != f ? 0x7FC00000u : (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000u;
}

/* Sixteen bfloat16 at p as float32: each is float32's upper half. */
static inline vec widen(const uint16_t *p)
{
#if defined(__AVX512F__) /* one zero-extending load: GCC 12 splits the generic conversion in two */
    const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#else
    hvec h;
    memcpy(&h, p, sizeof h);
    const uvec bits = __builtin_convertvector(h, uvec) << 16;
#endif
    vec v;
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* v rounded to bfloat16, stored at p. */
static inline void narrow(uint16_t *p, vec v)
{
    const uvec upper = bf16_bits(v) >> 16;
#if defined(__AVX512F__)
    __m512i bits;
    memcpy(&bits, &upper, sizeof bits);
    _mm256_storeu_si256((__m256i *)p, _mm512_cvtepi32_epi16(bits));
#else
    const hvec h = __builtin_convertvector(upper, hvec);
    memcpy(p, &h, sizeof h);
#endif
}

static inline float widen1(uint16_t h)
{
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t narrow1(float f) { return (uint16_t)(bf16_bits1(f) >> 16); }

static inline size_t size_of(int t) { return t == BF16 ? sizeof(uint16_t) : is_code(t) ? 1 : sizeof(float); }

typedef int8_t cvec __attribute__((vector_size(LANES)));

/* Sixteen int8 codes at p as float32. */
static inline vec widen_i8(const int8_t *p)
{
#if defined(__AVX512F__) /* one sign-extending load and a conversion: GCC 12 makes the generic one scalar */
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    vec v;
    memcpy(&v, &f, sizeof v);
    return v;
#else
    cvec c;
    memcpy(&c, p, sizeof c);
    return __builtin_convertvector(c, vec);
#endif
}

/* A float8 code as float16 bits: E5M2 is a float16's upper byte; E4M3's
 * exponent and mantissa shifted into a float16's stand for its value over
 * 2^8 (float16's exponent bias is 8 more), subnormals included. Neither
 * type's infinities or NaN are ever stored (the scales keep every code
 * within the type's largest). */
static inline uint16_t f8_half_bits(uint8_t b, int t)
{
    return t == E5M2 ? (uint16_t)(b << 8) : (uint16_t)(((b & 0x80) << 8) | ((b & 0x7F) << 7));
}

static inline float widen_f8_1(uint8_t b, int t)
{
    const uint16_t h = f8_half_bits(b, t);
    const int exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    const float magnitude = exponent ? ldexpf(1.0f + (float)mantissa / 1024.0f, exponent - 15)
                                     : ldexpf((float)mantissa, -24);
    return (h & 0x8000 ? -magnitude : magnitude) * (t == E4M3 ? 256.0f : 1.0f);
}

/* Sixteen float8 codes at p as float32. */
static inline vec widen_f8(const uint8_t *p, int t)
{
#if defined(__AVX512F__) /* widened to 16 bits, moved into float16's fields, converted by the hardware */
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i h = t == E5M2 ? _mm256_slli_epi16(w, 8)
                                : _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x80)), 8),
                                                  _mm256_slli_epi16(_mm256_and_si256(w, _mm256_set1_epi16(0x7F)), 7));
    __m512 f = _mm512_cvtph_ps(h);
    if (t == E4M3)
        f = _mm512_mul_ps(f, _mm512_set1_ps(256.0f));
    vec v;
    memcpy(&v, &f, sizeof v);
    return v;
#else
    vec v;
    for (int i = 0; i < LANES; i++)
        v[i] = widen_f8_1(p[i], t);
    return v;
#endif
}

/* Element i of an array of storage type t. */
static inline void *at(const void *p, int64_t i, int t) { return (char *)p + i * (int64_t)size_of(t); }

/* Sixteen elements (load_as, store_as) or one (get_as, put_as) of an array
 * of storage type t at element i, as float32. */
INLINE vec load_as(const void *p, int64_t i, int t)
{
    return t == F32 ? load((const float *)p + i) : t == I8 ? widen_i8((const int8_t *)p + i)
         : t == BF16 ? widen((const uint16_t *)p + i) : widen_f8((const uint8_t *)p + i, t);
}

INLINE void store_as(void *p, int64_t i, vec v, int t)
{
    if (t == F32)
        store((float *)p + i, v);
    else
        narrow((uint16_t *)p + i, v);
}

INLINE float get_as(const void *p, int64_t i, int t)
{
    return t == F32 ? ((const float *)p)[i] : t == I8 ? (float)((const int8_t *)p)[i]
         : t == BF16 ? widen1(((const uint16_t *)p)[i]) : widen_f8_1(((const uint8_t *)p)[i], t);
}

INLINE void put_as(void *p, int64_t i, float v, int t)
{
    if (t == F32)
        ((float *)p)[i] = v;
    else
        ((uint16_t *)p)[i] = narrow1(v);
}

/* v as an array of type t holds it: rounded to bfloat16 (in float32), or v. */
INLINE vec rounded_as(vec v, int t)
{
    if (t == F32)
        return v;
    const uvec bits = bf16_bits(v);
    memcpy(&v, &bits, sizeof v);
    return v;
}

INLINE float rounded1_as(float v, int t)
{
    if (t == F32)
        return v;
    const uint32_t bits = bf16_bits1(v);
    memcpy(&v, &bits, sizeof v);
    return v;
}

/* n elements from src (type st) to dst (type dt). */
static void copy_as(const void *src, int st, void *dst, int dt, int64_t n)
{
    if (st == dt) {
        memcpy(dst, src, size_of(st) * (size_t)n);
        return;
    }
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        store_as(dst, i, load_as(src, i, st), dt);
    for (; i < n; i++)
        put_as(dst, i, get_as(src, i, st), dt);
}

/* Lane by lane: a where `mask` (a vector comparison's result), else b. */
static inline vec select(ivec mask, vec a, vec b)
{
    ivec ia, ib;
    memcpy(&ia, &a, sizeof ia);
    memcpy(&ib, &b, sizeof ib);
    const ivec picked = (mask & ia) | (~mask & ib);
    vec out;
    memcpy(&out, &picked, sizeof out);
    return out;
}

/* exp(x) for x <= 0 (softmax weights after the maximum is taken off):
 * 2^n * e^r with n = round(x / ln 2), |r| <= ln 2 / 2, e^r by its Taylor
 * series to r^6 (relative error < 2e-7). x below -87 gives e^-87 (~1e-38),
 * a weight no sum notices. */
static inline vec exp_nonpositive(vec x)
{
    x = select(x < -87.0f, splat(-87.0f), x);
    /* Truncating y - 0.5 rounds y <= 0 to the nearest integer. */
    ivec n = __builtin_convertvector(x * 1.44269504f - 0.5f, ivec);
    vec nf = __builtin_convertvector(n, vec);
    vec r = x - nf * 0.693359375f + nf * 2.12194440e-4f; /* ln 2 in two parts, the second exact-ish */
    vec p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    ivec bits = (n + 127) << 23;
    vec scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* Dot products of one key row (dim elements at k of the cache, type ct)
 * with four float32 query rows (four independent sums, so the
 * multiply-adds overlap). */
INLINE void dot4(const float *q0, const float *q1, const float *q2, const float *q3, const void *cache, int64_t k,
                 int64_t dim, float *s, int ct)
{
    vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t d = 0;
    for (; d + LANES <= dim; d += LANES) {
        const vec kv = load_as(cache, k + d, ct);
        a0 += load(q0 + d) * kv;
        a1 += load(q1 + d) * kv;
        a2 += load(q2 + d) * kv;
        a3 += load(q3 + d) * kv;
    }
    s[0] = sum_lanes(a0), s[1] = sum_lanes(a1), s[2] = sum_lanes(a2), s[3] = sum_lanes(a3);
    for (; d < dim; d++) {
        const float kd = get_as(cache, k + d, ct);
        s[0] += q0[d] * kd, s[1] += q1[d] * kd, s[2] += q2[d] * kd, s[3] += q3[d] * kd;
    }
}

#if defined(__AVX512BW__)
/* int8 pages read with integer products. A key's codes widened to int16
 * times the query rounded to int16 steps of its largest magnitude (one
 * step per head) are summed exactly in int32, where float32 took two
 * widening instructions and four multiply-adds per sixteen codes; the
 * weighted sum of value rows the same way, the weights (softmax weight
 * times the value row's scale) rounded to int16 steps of the largest in
 * their block of I16_KEYS keys. Each rounding moves its operand by at most
 * 1/65,534 of the largest it is stepped by, against half a code step
 * (1/254 of the row's largest) that the int8 page itself holds. Both sums
 * fit int32: a dot product of 512 elements at most (512 x 32,767 x 127 <
 * 2^31), a block of 64 weighted values (64 x 32,767 x 127). AVX-512
 * VNNI's dpwssd where the CPU has it, else madd and add (AVX-512 BW). */
#define I16_MAX 32767.0f
#define I16_KEYS 64

static inline __m512i madd16(__m512i acc, __m512i a, __m512i b)
{
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, a, b);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}

/* n floats as int16 steps of their largest magnitude (nearest, ties to
 * even); returns the step (0 where every value is 0). */
static float int16_steps(const float *x, int64_t n, int16_t *out)
{
    /* Sixteen at a time, as the scalar tail: the vector rounding is the
     * current mode's (nearest, ties to even), nearbyintf's too, and a NaN
     * is passed over by both maxima (the scalar loop, once per weight and
     * key block, was a tenth of an int8 row's time). */
    __m512 most = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        most = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + i)), most);
    float top = _mm512_reduce_max_ps(most);
    for (; i < n; i++)
        top = fabsf(x[i]) > top ? fabsf(x[i]) : top;
    const float inverse = top > 0.0f ? I16_MAX / top : 0.0f;
    const __m512 by = _mm512_set1_ps(inverse);
    for (i = 0; i + 16 <= n; i += 16)
        _mm256_storeu_si256((__m256i *)(out + i),
                            _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + i), by))));
    for (; i < n; i++)
        out[i] = (int16_t)nearbyintf(x[i] * inverse);
    return top / I16_MAX;
}

/* The int32 dot products of one key's int8 codes with four int16 query
 * rows (dim a multiple of 32), summed across lanes together. */
static inline void dot4_codes(const int16_t *q, const int8_t *key, int64_t dim, int32_t s[4])
{
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t d = 0; d < dim; d += 32) {
        const __m512i k = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(key + d)));
        a0 = madd16(a0, k, _mm512_loadu_si512(q + d));
        a1 = madd16(a1, k, _mm512_loadu_si512(q + dim + d));
        a2 = madd16(a2, k, _mm512_loadu_si512(q + 2 * dim + d));
        a3 = madd16(a3, k, _mm512_loadu_si512(q + 3 * dim + d));
    }
    /* per 128-bit lane: [a0, a1, a2, a3] of its four elements, then the lanes added */
    const __m512i t0 = _mm512_add_epi32(_mm512_unpacklo_epi32(a0, a1), _mm512_unpackhi_epi32(a0, a1));
    const __m512i t1 = _mm512_add_epi32(_mm512_unpacklo_epi32(a2, a3), _mm512_unpackhi_epi32(a2, a3));
    const __m512i u = _mm512_add_epi32(_mm512_unpacklo_epi64(t0, t1), _mm512_unpackhi_epi64(t0, t1));
    const __m256i v = _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64(u, 1));
    _mm_storeu_si128((__m128i *)s, _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
}

/* os[g] (dim floats, dim a multiple of 64) += the weights w[g] (n
 * floats, head g's `stride` floats after head 0's: softmax weights times
 * each value row's scale) times the value
 * rows' codes at cache + keys[i] + half_stride. In blocks of I16_KEYS keys,
 * each block's weights as int16 steps of its own largest (a block far from
 * where a head looks keeps steps as fine as its own weights), a pair per
 * 32-bit word (an odd last key paired with itself under weight 0). Two
 * keys' codes are interleaved element by element (unpack within each
 * 128-bit lane) so that one multiply-add pairs each with its key's
 * weight; the sums come out in that lane order and go back to element
 * order as each block is added into os. */
static void weigh_codes(const float *w, int64_t n, int64_t stride, int count, const int8_t *cache,
                        const int64_t *keys, int64_t half_stride, int64_t dim, float *const os[4])
{
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    int16_t block[4][I16_KEYS];
    float steps[4];
    for (int64_t i0 = 0; i0 < n; i0 += I16_KEYS) {
        const int64_t keys_here = n - i0 < I16_KEYS ? n - i0 : I16_KEYS, width = keys_here + (keys_here & 1);
        for (int g = 0; g < 4; g++) {
            steps[g] = int16_steps(w + g * stride + i0, keys_here, block[g]);
            if (width > keys_here)
                block[g][keys_here] = 0;
        }
        for (int64_t d = 0; d < dim; d += 64) {
            __m512i acc[4][4];
            for (int g = 0; g < 4; g++)
                for (int j = 0; j < 4; j++)
                    acc[g][j] = _mm512_setzero_si512();
            for (int64_t i = 0; i < width; i += 2) {
                const int8_t *v0 = cache + keys[i0 + i] + half_stride + d,
                             *v1 = cache + keys[i0 + (i + 1 < keys_here ? i + 1 : i)] + half_stride + d;
                const __m512i x0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)v0));
                const __m512i y0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)v1));
                const __m512i x1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(v0 + 32)));
                const __m512i y1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(v1 + 32)));
                const __m512i p[4] = {_mm512_unpacklo_epi16(x0, y0), _mm512_unpackhi_epi16(x0, y0),
                                      _mm512_unpacklo_epi16(x1, y1), _mm512_unpackhi_epi16(x1, y1)};
                for (int g = 0; g < 4; g++) {
                    int32_t pair;
                    memcpy(&pair, &block[g][i], sizeof pair);
                    const __m512i weight = _mm512_set1_epi32(pair);
                    for (int j = 0; j < 4; j++)
                        acc[g][j] = madd16(acc[g][j], p[j], weight);
                }
            }
            for (int g = 0; g < count; g++) {
                const __m512 s = _mm512_set1_ps(steps[g]);
                for (int c = 0; c < 2; c++) { /* 32 elements: low and high interleavings */
                    const __m512i lo = acc[g][2 * c], hi = acc[g][2 * c + 1];
                    float *o = os[g] + d + 32 * c;
                    _mm512_storeu_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi32(lo, first, hi)),
                                                        s, _mm512_loadu_ps(o)));
                    _mm512_storeu_ps(o + 16,
                                     _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_permutex2var_epi32(lo, second, hi)),
                                                     s, _mm512_loadu_ps(o + 16)));
                }
            }
        }
    }
}
#endif

/* Keys a decode row scores, weighs and sums the values of before the next
 * ones (attend_heads), where it reads more than two chunks: a multiple of
 * I16_KEYS; a chunk's key and value rows (512 KB of float32 rows 256 wide)
 * and the next one's stay in a core's L2. On 64 rows of one KV head 256
 * wide (benchmarks/decode_attention.py, a Xeon's 2 cores): 4,096 keys
 * 1.32x faster than passes over every key in float32, 1.39-1.42x in
 * bfloat16, 1.21x in int8; rows of 512 keys were no faster in chunks, so
 * rows of up to two chunks go whole. */
#define DECODE_CHUNK 256

/* One row and up to four of a KV head's query heads (count): scores
 * [4][n] is scratch; sink[g] is head g's sink logit (-INFINITY: none).
 * The cache's elements are of type ct (inlined once per type); for codes
 * codes, `sc` is the head's scales, `scale_pages` the row's pages that hold
 * them (its `row_pages` where they follow the codes in a page) and `ss`
 * their page, half and slot strides: a key's score is its codes' dot
 * product times its K scale, a value's weight its softmax weight times its
 * V scale. */
INLINE void attend_heads(const float *const qs[4], float *const os[4], const float sink[4], int64_t count,
                         const void *cache, const int64_t *row_pages, const int64_t *scale_pages, int64_t lo,
                         int64_t n, int64_t block0, int64_t block_size, int64_t page_stride, int64_t half_stride,
                         int64_t slot_stride, int64_t dim, float scale, float softcap, float *scores, int64_t *keys,
                         int ct, const float *sc, const int64_t ss[3], int16_t *narrow16)
{
    float s[4];
    /* int8 codes with integer products (dot4_codes, weigh_codes): the
     * queries as int16 in narrow16 ([4][dim]). */
#if defined(__AVX512BW__)
    const int integer = ct == I8 && narrow16 != NULL && dim % 64 == 0 && dim <= 512;
    float steps[4];
    for (int g = 0; integer && g < 4; g++)
        steps[g] = int16_steps(qs[g], dim, narrow16 + g * dim);
#else
    const int integer = 0;
#endif
    const int64_t row_bytes = dim * (int64_t)size_of(ct);
    /* Each key's place in the pool (and, for codes, its scales' place),
     * found once for the row by walking its blocks: the passes below read
     * every key several times, and a division per read cost more than the
     * arithmetic it feeds. */
    int64_t *scale_at = keys + n;
    for (int64_t i = 0, b = lo / block_size - block0, at_slot = lo % block_size; i < n; i++) {
        keys[i] = row_pages[b] * page_stride + at_slot * slot_stride;
        if (is_code(ct))
            scale_at[i] = scale_pages[b] * ss[0] + at_slot * ss[2];
        if (++at_slot == block_size)
            at_slot = 0, b++;
    }
    /* The keys go in chunks of DECODE_CHUNK (up to two chunks' worth: one),
     * each scored, weighed and its values summed before the next (a running
     * maximum rescales what the earlier chunks summed where a later one
     * holds a larger score): while a chunk's arithmetic runs, the next
     * chunk's rows are on their way (fetched as this one is scored), where
     * scoring every key first and weighing every value after left the
     * memory idle through the second pass. */
    float top[4], total[4];
    for (int g = 0; g < 4; g++)
        top[g] = sink[g], total[g] = 0.0f;
    for (int g = 0; g < count; g++)
        memset(os[g], 0, sizeof(float) * (size_t)dim);
    const int64_t chunk = n <= 2 * DECODE_CHUNK ? n : DECODE_CHUNK;
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
        const int64_t c1 = c0 + chunk < n ? c0 + chunk : n;
        for (int64_t i = c0; i < c1; i++) {
            const int64_t key = keys[i];
            /* The pages of a row lie anywhere in the pool, where the
             * hardware's own prefetch does not follow. The first chunk's
             * rows: each key's a block ahead, and its value row for the
             * values' pass; then the next chunk's key and value rows. */
            if (c0 == 0 && i + block_size < c1) {
                const char *next = at(cache, keys[i + block_size], ct);
                for (int64_t b = 0; b < row_bytes; b += 64)
                    __builtin_prefetch(next + b);
            }
            if (c0 == 0) {
                const char *value = at(cache, key + half_stride, ct);
                for (int64_t b = 0; b < row_bytes; b += 64)
                    __builtin_prefetch(value + b);
                if (is_code(ct) && i + block_size < c1) /* the next block's scales, with its keys */
                    __builtin_prefetch(sc + scale_at[i + block_size]),
                        __builtin_prefetch(sc + scale_at[i + block_size] + ss[1]);
            }
            if (i + chunk < n) {
                const char *next = at(cache, keys[i + chunk], ct),
                           *value = at(cache, keys[i + chunk] + half_stride, ct);
                for (int64_t b = 0; b < row_bytes; b += 64)
                    __builtin_prefetch(next + b), __builtin_prefetch(value + b);
                if (is_code(ct)) /* its K and V scales (a line holds several keys' each) */
                    __builtin_prefetch(sc + scale_at[i + chunk]), __builtin_prefetch(sc + scale_at[i + chunk] + ss[1]);
            }
#if defined(__AVX512BW__)
            if (integer) {
                int32_t sums[4];
                dot4_codes(narrow16, (const int8_t *)cache + key, dim, sums);
                for (int g = 0; g < 4; g++)
                    s[g] = (float)sums[g] * steps[g];
            } else
#endif
                dot4(qs[0], qs[1], qs[2], qs[3], cache, key, dim, s, ct);
            if (is_code(ct)) {
                const float k_scale = sc[scale_at[i]];
                for (int g = 0; g < 4; g++)
                    s[g] *= k_scale;
            }
            for (int g = 0; g < 4; g++)
                scores[g * n + i] = softcap > 0.0f ? tanhf(s[g] * scale / softcap) * softcap : s[g] * scale;
        }
        for (int g = 0; g < count; g++) {
            float *sg = scores + g * n, best = top[g];
            {   /* the chunk's largest score, a vector of maxima at a time (a scalar chain of
                 * compares was ~8% of an int8 row's time) */
                vec most = splat(best);
                int64_t i = c0;
                for (; i + LANES <= c1; i += LANES) {
                    const vec x = load(sg + i);
                    most = select(x > most, x, most);
                }
                for (int l = 0; l < LANES; l++)
                    best = most[l] > best ? most[l] : best;
                for (; i < c1; i++)
                    best = sg[i] > best ? sg[i] : best;
            }
            if (best > top[g]) { /* what the earlier chunks summed, against the new maximum */
                const float rescale = expf(top[g] - best);
                total[g] *= rescale;
                if (c0 > 0) /* (nothing summed yet in the first) */
                    for (int64_t j = 0; j < dim; j++)
                        os[g][j] *= rescale;
                top[g] = best;
            }
            vec sum = {0};
            int64_t i = c0;
            for (; i + LANES <= c1; i += LANES) {
                const vec e = exp_nonpositive(load(sg + i) - top[g]);
                store(sg + i, e);
                sum += e;
            }
            total[g] += sum_lanes(sum);
            for (; i < c1; i++) {
                sg[i] = expf(sg[i] - top[g]);
                total[g] += sg[i];
            }
        }
        if (is_code(ct)) /* the weights times each value row's scale (the totals are the weights' own) */
            for (int64_t i = c0; i < c1; i++) {
                const float v_scale = sc[scale_at[i] + ss[1]];
                for (int g = 0; g < 4; g++)
                    scores[g * n + i] *= v_scale;
            }
        /* Values weighted in slices of four vectors per head (sixteen
         * accumulators), over keys a block at a time so that a block's value
         * rows stay in cache while each slice reads its part of them. */
        const int64_t key_block = 64;
        int64_t d = 0;
#if defined(__AVX512BW__)
        if (integer) {
            weigh_codes(scores + c0, c1 - c0, n, count, cache, keys + c0, half_stride, dim, os);
            d = dim;
        }
#endif
        for (int64_t i0 = c0; i0 < c1 && !integer; i0 += key_block) {
            const int64_t i1 = i0 + key_block < c1 ? i0 + key_block : c1;
            for (d = 0; d + 4 * LANES <= dim; d += 4 * LANES) {
                vec acc[4][4];
                for (int g = 0; g < 4; g++)
                    for (int j = 0; j < 4; j++)
                        acc[g][j] = load(os[g] + d + j * LANES);
                for (int64_t i = i0; i < i1; i++) {
                    const int64_t v = keys[i] + half_stride + d;
                    const vec v0 = load_as(cache, v, ct), v1 = load_as(cache, v + LANES, ct),
                              v2 = load_as(cache, v + 2 * LANES, ct), v3 = load_as(cache, v + 3 * LANES, ct);
                    for (int g = 0; g < 4; g++) {
                        const vec w = splat(scores[g * n + i]);
                        acc[g][0] += w * v0, acc[g][1] += w * v1, acc[g][2] += w * v2, acc[g][3] += w * v3;
                    }
                }
                for (int g = 0; g < count; g++)
                    for (int j = 0; j < 4; j++)
                        store(os[g] + d + j * LANES, acc[g][j]);
            }
        }
        for (; d < dim; d++) /* dims past the slices */
            for (int g = 0; g < count; g++) {
                float acc = 0.0f;
                for (int64_t i = c0; i < c1; i++)
                    acc += scores[g * n + i] * get_as(cache, keys[i] + half_stride + d, ct);
                os[g][d] += acc;
            }
    }
    for (int g = 0; g < count; g++) {
        const float inv = 1.0f / (total[g] + expf(sink[g] - top[g])); /* the sink weighs no value */
        for (int64_t j = 0; j < dim; j++)
            os[g][j] *= inv;
    }
}

/* One layer's paged K/V cache as the kernels address it: elements of
 * storage type `dtype`, strides in elements (page, K/V half, slot, head;
 * head_dim contiguous). Codes (I8, E4M3, E5M2): `scales` [pages, 2, block_size,
 * kv_heads] float32 with its own strides, in floats (page, half, slot,
 * head); NULL otherwise. */
typedef struct {
    void *data;
    int64_t page_stride, half_stride, slot_stride, head_stride;
    int64_t block_size, kv_heads, head_dim, dtype;
    const float *scales;
    int64_t scale_page_stride, scale_half_stride, scale_slot_stride, scale_head_stride;
    int64_t rotated; /* I8: the rows are stored rotated (rotate_hadamard): queries and output are rotated here */
} paged_cache;

/* A step's decode rows: each reads key positions first[r] .. last[r]
 * (inclusive; last is the query's own position) through pages[r] (its
 * pages from the block holding its first key, max_blocks per row). A
 * decoder layer also stores each row's new K/V at (store_pages[r],
 * store_offsets[r]); attention alone leaves those NULL. Codes whose scales
 * lie in pages of their own (core/layout.py `scales_apart`): scale_pages
 * and store_scale_pages name those, alike; NULL: the codes' pages. */
typedef struct {
    int64_t rows, max_blocks;
    const int64_t *pages, *first, *last;
    const int64_t *store_pages, *store_offsets;
    const int64_t *scale_pages, *store_scale_pages;
} decode_rows;

static void rotate_hadamard(float *x, int64_t n);

/* Row r of a decode batch, the query heads g0 .. g0 + count - 1 of KV
 * head h (count <= 4): q and out are the row's [q_heads, head_dim], of
 * storage type `dtype`; see decode_attention for the rest. Returns 0, or
 * -1 where memory for the scores could not be had. */
static int attend_row(const void *q, const paged_cache *c, const decode_rows *d, int64_t r, int64_t groups,
                      int64_t h, int64_t g0, int64_t count, float scale, float softcap, const float *sinks,
                      void *out, int dtype)
{
    const int64_t lo = d->first[r], hi = d->last[r], n = hi - lo + 1, dim = c->head_dim;
    const int64_t block_size = c->block_size;
    /* Rotated int8 rows (`paged_cache`): the queries rotated alike, the output back. */
    const int rotate = c->dtype == I8 && c->rotated;
    /* The scores, then (bfloat16 or rotated q and out) four heads of each
     * in float32, then the keys' places (and their scales': attend_heads). */
    const int copies = dtype != F32 || rotate;
    const size_t floats = (size_t)(4 * n + (copies ? 8 * dim : 0));
    /* then, for int8 codes, the int16 queries (attend_heads) */
    const size_t narrow = c->dtype == I8 ? (size_t)(4 * dim) : 0;
    float *scores = malloc(sizeof(float) * floats + sizeof(int64_t) * (size_t)(2 * n) + sizeof(int16_t) * narrow);
    if (scores == NULL)
        return -1;
    float *wide = scores + 4 * n;
    int64_t *keys = (int64_t *)(scores + floats); /* (4n + 8dim floats: 8-byte aligned) */
    int16_t *narrow16 = narrow ? (int16_t *)(keys + 2 * n) : NULL;
    const float *qs[4];
    float *os[4];
    float sink[4];
    int64_t heads[4];
    for (int g = 0; g < 4; g++) { /* missing heads repeat the last: computed, not written */
        heads[g] = h * groups + g0 + (g < count ? g : count - 1);
        if (rotate) {
            copy_as(at(q, heads[g] * dim, dtype), dtype, wide + g * dim, F32, dim);
            rotate_hadamard(wide + g * dim, dim);
            qs[g] = wide + g * dim;
            os[g] = wide + (4 + g) * dim;
        } else if (dtype == F32) {
            qs[g] = (const float *)q + heads[g] * dim;
            os[g] = (float *)out + heads[g] * dim;
        } else {
            copy_as(at(q, heads[g] * dim, dtype), dtype, wide + g * dim, F32, dim);
            qs[g] = wide + g * dim;
            os[g] = wide + (4 + g) * dim;
        }
        sink[g] = sinks != NULL ? sinks[heads[g]] : -INFINITY;
    }
    const void *head = at(c->data, h * c->head_stride, (int)c->dtype);
    const int64_t *row_pages = d->pages + r * d->max_blocks;
    const int64_t *scale_pages = (d->scale_pages != NULL ? d->scale_pages : d->pages) + r * d->max_blocks;
    const float *sc = c->scales != NULL ? c->scales + h * c->scale_head_stride : NULL;
    const int64_t ss[3] = {c->scale_page_stride, c->scale_half_stride, c->scale_slot_stride};
    if (c->dtype == F32)
        attend_heads(qs, os, sink, count, head, row_pages, scale_pages, lo, n, lo / block_size, block_size,
                     c->page_stride, c->half_stride, c->slot_stride, dim, scale, softcap, scores, keys, F32, sc, ss,
                     NULL);
    else if (c->dtype == I8)
        attend_heads(qs, os, sink, count, head, row_pages, scale_pages, lo, n, lo / block_size, block_size,
                     c->page_stride, c->half_stride, c->slot_stride, dim, scale, softcap, scores, keys, I8, sc, ss,
                     narrow16);
    else if (c->dtype == E4M3)
        attend_heads(qs, os, sink, count, head, row_pages, scale_pages, lo, n, lo / block_size, block_size,
                     c->page_stride, c->half_stride, c->slot_stride, dim, scale, softcap, scores, keys, E4M3, sc, ss,
                     NULL);
    else if (c->dtype == E5M2)
        attend_heads(qs, os, sink, count, head, row_pages, scale_pages, lo, n, lo / block_size, block_size,
                     c->page_stride, c->half_stride, c->slot_stride, dim, scale, softcap, scores, keys, E5M2, sc, ss,
                     NULL);
    else
        attend_heads(qs, os, sink, count, head, row_pages, scale_pages, lo, n, lo / block_size, block_size,
                     c->page_stride, c->half_stride, c->slot_stride, dim, scale, softcap, scores, keys, BF16, sc, ss,
                     NULL);
    for (int g = 0; rotate && g < count; g++)
        rotate_hadamard(os[g], dim);
    if (copies)
        for (int g = 0; g < count; g++)
            copy_as(os[g], F32, at(out, heads[g] * dim, dtype), dtype, dim);
    free(scores);
    return 0;
}

/* q [rows, q_heads, head_dim], contiguous, of storage type `dtype`; out
 * the same: each row's query heads attended over its keys (`decode_rows`)
 * in the cache (its own storage type), in float32, out rounded once.
 * softcap <= 0: none. sinks [q_heads] float32, or NULL: none. Returns 0,
 * or -1 where memory for the scores could not be had. */
int decode_attention(const paged_cache *cache, const decode_rows *rows, const void *q, int64_t q_heads,
                     float scale, float softcap, const float *sinks, void *out, int dtype, int threads)
{
    if (is_code(dtype) || (is_code((int)cache->dtype) && cache->scales == NULL) ||
        (cache->rotated && (cache->head_dim & (cache->head_dim - 1))))
        return -2; /* coded queries, codes without their scales, or rotated rows of no power-of-two width */
    const int64_t dim = cache->head_dim, groups = q_heads / cache->kv_heads, batches = (groups + 3) / 4;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) collapse(2) reduction(| : failed)
    for (int64_t r = 0; r < rows->rows; r++) {
        for (int64_t hb = 0; hb < cache->kv_heads * batches; hb++) {
            const int64_t h = hb / batches, g0 = hb % batches * 4;
            const int64_t count = groups - g0 < 4 ? groups - g0 : 4;
            failed |= attend_row(at(q, r * q_heads * dim, dtype), cache, rows, r, groups, h, g0, count, scale,
                                 softcap, sinks, at(out, r * q_heads * dim, dtype), dtype);
        }
    }
    return failed ? -1 : 0;
}

/* ---- Elementwise work fused: each op one pass over its rows where torch
 * makes several (a norm is a square, a mean, a reciprocal root and two
 * products; rotary a negation, a concatenation, two products and a sum).
 * In bfloat16 each rounds where torch's modules round (layers/norm.py,
 * rotary.py, mlp.py: every op on a bfloat16 tensor rounds its result),
 * computing in float32 in between. */

/* Enough work to be worth waking a second thread for. */
#define PARALLEL_WORK (1 << 15)

/* out = row * rsqrt(mean(row^2) + eps) * (weight + offset), dim elements
 * (out may be row); row, weight and out of storage types rt, wt, ot. With
 * round_first, row * rsqrt(...) is rounded to ot before the weight scales
 * it (Llama's norm in torch: cast back, then scaled). */
INLINE void norm_row_as(const void *row, int rt, const void *weight, int wt, float offset, float eps,
                        int round_first, int64_t dim, void *out, int ot)
{
    vec squares = {0};
    int64_t d = 0;
    for (; d + LANES <= dim; d += LANES) {
        const vec v = load_as(row, d, rt);
        squares += v * v;
    }
    float sum = sum_lanes(squares);
    for (; d < dim; d++)
        sum += get_as(row, d, rt) * get_as(row, d, rt);
    const float scale = 1.0f / sqrtf(sum / (float)dim + eps);
    for (d = 0; d + LANES <= dim; d += LANES) {
        const vec y = load_as(row, d, rt) * scale;
        store_as(out, d, (round_first ? rounded_as(y, ot) : y) * (load_as(weight, d, wt) + offset), ot);
    }
    for (; d < dim; d++) {
        const float y = get_as(row, d, rt) * scale;
        put_as(out, d, (round_first ? rounded1_as(y, ot) : y) * (get_as(weight, d, wt) + offset), ot);
    }
}

/* x (n floats, n a power of two) times the orthonormal Hadamard matrix of
 * order n, Sylvester's (kv_quant.py `rotation`): the fast transform's
 * butterflies, then 1/sqrt(n). int8 pages hold K and V rows so rotated. */
static void rotate_hadamard(float *x, int64_t n)
{
    int64_t h = 1;
#if defined(__AVX512F__)
    /* The butterflies within 16 elements (h = 1, 2, 4, 8) in registers:
     * each lane's partner is the lane with bit h of its index flipped; the
     * lower of a pair keeps a + b, the upper takes a - b. (The scalar loop
     * below spent most of a 256-wide row's transform on these four short
     * strides, which do not vectorise as written.) The same sums, so the
     * same results. */
    if (n >= 16) {
        const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        for (int64_t i = 0; i < n; i += 16) {
            __m512 v = _mm512_loadu_ps(x + i);
            for (int bit = 1; bit < 16; bit *= 2) {
                const __m512 partner = _mm512_permutexvar_ps(_mm512_xor_si512(lane, _mm512_set1_epi32(bit)), v);
                const __mmask16 upper = _mm512_test_epi32_mask(lane, _mm512_set1_epi32(bit));
                v = _mm512_mask_sub_ps(_mm512_add_ps(v, partner), upper, partner, v);
            }
            _mm512_storeu_ps(x + i, v);
        }
        h = 16;
    }
#endif
    for (; h < n; h *= 2)
        for (int64_t i = 0; i < n; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b, x[j + h] = a - b;
            }
    const float norm = 1.0f / sqrtf((float)n);
    for (int64_t i = 0; i < n; i++)
        x[i] *= norm;
}

/* |x| (at most the type's largest) as a float8 code's magnitude, to the
 * nearest (ties to even), as torch converts: normal values by rounding
 * float32's mantissa to the type's (a carry moves the exponent), smaller
 * ones in steps of the type's least subnormal. */
static inline uint8_t f8_magnitude(float x, int t)
{
    const int mantissa = t == E4M3 ? 3 : 2, bias = t == E4M3 ? 7 : 15, shift = 23 - mantissa;
    const float a = fabsf(x);
    if (a < ldexpf(1.0f, 1 - bias)) /* subnormal: a over the least one, 2^(1 - bias - mantissa) */
        return (uint8_t)rintf(ldexpf(a, bias - 1 + mantissa));
    uint32_t bits;
    memcpy(&bits, &a, sizeof bits);
    bits += (1u << (shift - 1)) - 1 + ((bits >> shift) & 1);
    return (uint8_t)((bits >> shift) - ((uint32_t)(127 - bias) << mantissa));
}

/* A row of n floats as codes of type t and their scale, as kv_quant.py's
 * quantize writes them: scale = max |x| / the type's largest code, each
 * x / scale clamped there and rounded to the nearest code (ties to even:
 * rintf in the default rounding mode, as torch.round and torch's float8
 * conversion), a row of zeros scale 0 and codes 0. */
static void quantize_row(const float *x, int64_t n, uint8_t *codes, float *scale, int t)
{
    const float largest = t == I8 ? 127.0f : t == E4M3 ? 448.0f : 57344.0f;
    float top = 0.0f;
    for (int64_t i = 0; i < n; i++)
        top = fabsf(x[i]) > top ? fabsf(x[i]) : top;
    const float s = top / largest, divisor = s > 0.0f ? s : 1.0f;
    for (int64_t i = 0; i < n; i++) {
        float q = x[i] / divisor;
        q = q > largest ? largest : q < -largest ? -largest : q;
        if (t == I8)
            codes[i] = (uint8_t)(int8_t)rintf(q);
        else
            codes[i] = (uint8_t)((q < 0.0f ? 0x80 : 0) | f8_magnitude(q, t));
    }
    *scale = s;
}

/* Each of `rows` rows of n floats (n a power of two; rows `stride` floats
 * apart) times the orthonormal Hadamard matrix of order n, in place
 * (`rotate_hadamard`): the queries of a prefill chunk over rotated int8
 * pages, and its output back (kv_quant.py), in n log n sums a row where
 * the matrix product takes n^2. Returns 0, or -1 for an n that is no
 * power of two. */
int rotate_rows(float *x, int64_t rows, int64_t n, int64_t stride, int threads)
{
    if (n < 1 || (n & (n - 1)))
        return -1;
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * n > PARALLEL_WORK)
    for (int64_t r = 0; r < rows; r++)
        rotate_hadamard(x + r * stride, n);
    return 0;
}

/* Sixteen bytes of a visibility mask as lanes: all ones where nonzero. */
typedef uint8_t bvec __attribute__((vector_size(LANES)));

static inline ivec visible_lanes(const uint8_t *p)
{
    bvec b;
    memcpy(&b, p, sizeof b);
    return __builtin_convertvector(b, ivec) != 0;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* A prefill tile's softmax row in AVX-512, for rows without a soft-cap
 * (scale > 0): the maximum of the raw scores under a mask register (times
 * the scale after: it is positive), then each weight as 2^t for t = (score
 * - max) x scale x log2(e), one fused multiply-subtract, as 2^n times a
 * polynomial of the fraction (roundscale and scalef: no clamp, no integer
 * arithmetic; hidden lanes zeroed by the mask), then the weights times the
 * sum's inverse: about 25 instructions for 16 scores where the portable
 * passes take about 40, which bound them (not memory). The real Gemma-3
 * 270M's prefill of 16 x 700 tokens, these passes and the portable ones
 * taking turns call by call: 0.45x the softmax's time in bfloat16,
 * 0.39-0.43x in float32, ~3% of the prefill (Xeon with AMX). */
static inline __mmask16 visible_mask(const uint8_t *p, __mmask16 lanes)
{
    const __m128i b = _mm_maskz_loadu_epi8(lanes, p);
    return _mm_test_epi8_mask(b, b);
}

/* 16 scores (or the lanes given) of type st as float32 */
INLINE __m512 scores16(const void *p, int64_t i, __mmask16 lanes, int st)
{
    if (st == F32)
        return _mm512_maskz_loadu_ps(lanes, (const float *)p + i);
    const __m256i h = _mm256_maskz_loadu_epi16(lanes, (const uint16_t *)p + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* 2^t, lanes outside `keep` 0: 2^n x 2^f for n = t rounded, f in [-1/2,
 * 1/2], 2^f = e^(f ln 2) to degree 6 (within 1.2e-7 of it). */
static inline __m512 exp2_lanes(__m512 t, __mmask16 keep)
{
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    __m512 p = _mm512_set1_ps(0.000154035304f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.00133335581f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.00961812911f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.0555041087f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.240226507f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.693147181f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_maskz_scalef_ps(keep, p, n);
}

INLINE void masked_softmax_row_avx512(const void *scores, int64_t row, const uint8_t *visible, int64_t keys,
                                      float scale, const float *sink, void *out, float *x, int st, int ot)
{
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t k = 0; k < keys; k += LANES) {
        const __mmask16 lanes = keys - k >= LANES ? 0xFFFF : (__mmask16)((1u << (keys - k)) - 1);
        top = _mm512_mask_max_ps(top, visible_mask(visible + k, lanes), top, scores16(scores, row + k, lanes, st));
    }
    float best = _mm512_reduce_max_ps(top) * scale;
    if (sink != NULL && *sink > best)
        best = *sink;
    if (best == -INFINITY) { /* a row that sees nothing weighs nothing */
        memset(at(out, row, ot), 0, (size_t)keys * size_of(ot));
        return;
    }
    const float log2e = 1.4426950408889634f;
    const __m512 c = _mm512_set1_ps(scale * log2e), b = _mm512_set1_ps(best * log2e);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t k = 0; k < keys; k += LANES) {
        const __mmask16 lanes = keys - k >= LANES ? 0xFFFF : (__mmask16)((1u << (keys - k)) - 1);
        const __m512 e = exp2_lanes(_mm512_fmsub_ps(scores16(scores, row + k, lanes, st), c, b),
                                    visible_mask(visible + k, lanes));
        _mm512_mask_storeu_ps(x + k, lanes, e);
        sum = _mm512_add_ps(sum, e);
    }
    float total = _mm512_reduce_add_ps(sum);
    if (sink != NULL)
        total += expf(*sink - best); /* the sink weighs no value */
    const vec inverse = splat(1.0f / total);
    int64_t k = 0;
    for (; k + LANES <= keys; k += LANES)
        store_as(out, row + k, load(x + k) * inverse, ot);
    for (; k < keys; k++)
        put_as(out, row + k, x[k] * inverse[0], ot);
}
#endif

/* scores of type st in, weights of type ot out (out may be scores where the two agree) */
INLINE void masked_softmax_row(const void *scores, int64_t at, const uint8_t *visible, int64_t keys, float scale,
                               float softcap, const float *sink, void *out, float *x, int st, int ot)
{
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if (softcap <= 0.0f && scale > 0.0f) {
        masked_softmax_row_avx512(scores, at, visible, keys, scale, sink, out, x, st, ot);
        return;
    }
#endif
    vec top = splat(-INFINITY);
    int64_t k = 0;
    for (; k + LANES <= keys; k += LANES) {
        vec v = load_as(scores, at + k, st) * scale;
        if (softcap > 0.0f)
            for (int i = 0; i < LANES; i++)
                v[i] = softcap * tanhf(v[i] / softcap);
        v = select(visible_lanes(visible + k), v, splat(-INFINITY));
        store(x + k, v);
        top = select(v > top, v, top);
    }
    float best = -INFINITY;
    for (int i = 0; i < LANES; i++)
        best = top[i] > best ? top[i] : best;
    for (; k < keys; k++) {
        float v = get_as(scores, at + k, st) * scale;
        if (softcap > 0.0f)
            v = softcap * tanhf(v / softcap);
        x[k] = visible[k] ? v : -INFINITY;
        best = x[k] > best ? x[k] : best;
    }
    if (sink != NULL && *sink > best)
        best = *sink;
    if (best == -INFINITY) { /* a row that sees nothing weighs nothing */
        for (k = 0; k < keys; k++)
            put_as(out, at + k, 0.0f, ot);
        return;
    }
    vec sum = {0};
    for (k = 0; k + LANES <= keys; k += LANES) {
        const vec v = load(x + k);
        const vec e = select(v > -INFINITY, exp_nonpositive(v - best), splat(0.0f)); /* hidden: exactly 0 */
        store(x + k, e);
        sum += e;
    }
    float total = sum_lanes(sum);
    for (; k < keys; k++) {
        x[k] = x[k] > -INFINITY ? expf(x[k] - best) : 0.0f;
        total += x[k];
    }
    if (sink != NULL)
        total += expf(*sink - best); /* the sink weighs no value */
    const float inverse = 1.0f / total;
    for (k = 0; k + LANES <= keys; k += LANES)
        store_as(out, at + k, load(x + k) * inverse, ot);
    for (; k < keys; k++)
        put_as(out, at + k, x[k] * inverse, ot);
}

INLINE int masked_softmax_as(const void *scores, const uint8_t *visible, int64_t mask_stride, int64_t rows,
                             int64_t groups, int64_t keys, float scale, float softcap, const float *sinks, void *out,
                             int threads, int st)
{
    int failed = 0;
#pragma omp parallel num_threads(threads) if (rows * groups * keys > PARALLEL_WORK)
    {
        float *x = malloc(sizeof(float) * (size_t)(keys > 0 ? keys : 1));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < rows * groups; t++) {
            if (x == NULL) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            masked_softmax_row(scores, t * keys, visible + t / groups * mask_stride, keys, scale, softcap,
                               sinks == NULL ? NULL : sinks + t % groups, out, x, st, st);
        }
        free(x);
    }
    return failed ? -1 : 0;
}

/* The weights of a prefill tile's attention, in place of torch's passes
 * over its scores (scale, cap, mask, softmax, rounding): scores [rows,
 * groups, keys] (type st: float32 or bfloat16, a product's output, dense),
 * visible [rows, keys] bytes (rows mask_stride apart; 0 hides the key from
 * the row's queries), sinks [groups] float32 or NULL (one more logit in
 * each denominator). Writes the softmax over keys of scale * score
 * (soft-capped where softcap > 0: softcap tanh(x / softcap)) to out [rows,
 * groups, keys] (type st; it may be scores): 0 for a hidden key, and for
 * every key of a row that sees none. float32 throughout, rounded once where
 * written (torch's passes round the scaled scores to bfloat16 first).
 * Returns 0, or -1 where a thread's scratch row could not be had. */
int masked_softmax(const void *scores, const uint8_t *visible, int64_t mask_stride, int64_t rows, int64_t groups,
                   int64_t keys, float scale, float softcap, const float *sinks, void *out, int st, int threads)
{
    if (st == BF16)
        return masked_softmax_as(scores, visible, mask_stride, rows, groups, keys, scale, softcap, sinks, out,
                                 threads, BF16);
    return masked_softmax_as(scores, visible, mask_stride, rows, groups, keys, scale, softcap, sinks, out, threads,
                             F32);
}

/* ---- Prefill attention on AMX tiles: each prefill chunk's queries over
 * their keys in the pool, in one call per layer where the tiles' path
 * (backends/reference `attend_prefills`) gathers the chunk's pages, pads
 * them and runs two oneDNN products and a softmax per query tile and KV
 * head, each tile scoring every key of its range (~half a tile's keys lie
 * past the causal diagonal, more below a window's edge). Here queries go 16
 * at a time, each block of 16 scoring only the 32-key steps its rows may
 * see, on the CPU's tile unit (Intel AMX: a 16 x 32 bfloat16 tile times a
 * 32 x 16 one into 16 x 16 float32 sums, one instruction).
 *
 * A chunk's keys and values are laid out once per call as the tile unit
 * reads its second operand, two 16-bit elements side by side: keys as
 * [16-key block][32-dim step][dim pair][key][2], values as [32-key
 * step][16-dim block][key pair][dim][2] (zeros past the chunk's last
 * query). Scores are float32 sums of bfloat16 products, never rounded; the
 * softmax is masked_softmax_row's, each row's weights rounded once to
 * bfloat16 (as the tiles' path rounds them) for the second product; the
 * output is its float32 sums rounded once. */

/* A step's prefill chunks as prefill_attention reads them: chunk s is the
 * query rows start[s] .. start[s] + count[s] - 1 of q, at positions
 * query_pos[s] and up; its keys are positions key_pos[s] .. key_pos[s] +
 * keys[s] - 1, in pages[s * max_blocks] and on (key_pos[s] a block's first
 * position). first[t]: the first key position query row t of q may read
 * (its layer's read rule), the last being its own. */
typedef struct {
    int64_t segments, max_blocks;
    const int64_t *start, *count, *query_pos, *key_pos, *keys, *pages, *first;
} prefill_rows;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#include <sys/syscall.h>
#define AMX_ATTENTION 1
long syscall(long number, ...); /* unistd.h declares it only past strict C11 */

/* Linux lends the tile registers' state to a process that asks
 * (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); 1 once granted. */
static int tiles_granted(void)
{
    static int granted = 0; /* 0: not asked yet, 1: granted, -1: refused (asking again is harmless) */
    if (granted == 0)
        granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 1 : -1;
    return granted == 1;
}

/* Every tile of this kernel is 16 rows of 64 bytes (palette 1). Loaded per
 * call in each thread and released after: oneDNN's AMX products in the
 * same (torch's) threads read the loaded configuration back before each
 * use and load theirs where it differs, so neither side trusts the other's. */
static void configure_tiles(void)
{
    uint8_t config[64] = {1};
    for (int i = 0; i < 8; i++) {
        config[16 + 2 * i] = 64; /* bytes per row, little-endian 16 bits */
        config[48 + i] = 16;     /* rows */
    }
    _tile_loadconfig(config);
}

/* Keys and values of KV head h, block b of 16 keys (positions key_pos + 16
 * b and on; those from `real` on are zeros), into the tile layouts above
 * (kp and vp: the chunk's, n * dim elements each). A key's 32-dim step is
 * 16 pairs scattered to 16 rows; two keys' values are interleaved by one
 * permutation per 16 dims. */
static void pack_block(const paged_cache *c, const int64_t *pages, int64_t h, int64_t b, int64_t real,
                       uint16_t *kp, uint16_t *vp)
{
    const int64_t dim = c->head_dim, bs = c->block_size, steps = dim / 32;
    const uint16_t *base = (const uint16_t *)c->data + h * c->head_stride;
    uint32_t *kt = (uint32_t *)(kp + b * 16 * dim); /* [steps][16 pairs][16 keys] */
    /* values: block b is half of the 32-key step b / 2: its key pairs 8 (b % 2) .. 8 (b % 2) + 7 */
    uint16_t *vt = vp + b / 2 * 32 * dim + b % 2 * 8 * 32;
    const __m512i rows = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(16));
    /* lane 2i: the first key's element i, lane 2i + 1 the second's (16 elements of each from `from`) */
    __m512i low, high;
    {
        uint16_t idx[64];
        for (int i = 0; i < 16; i++) {
            idx[2 * i] = (uint16_t)i, idx[2 * i + 1] = (uint16_t)(32 + i);
            idx[32 + 2 * i] = (uint16_t)(16 + i), idx[32 + 2 * i + 1] = (uint16_t)(48 + i);
        }
        low = _mm512_loadu_si512(idx);
        high = _mm512_loadu_si512(idx + 32);
    }
    const uint16_t *row[16];
    for (int64_t n = 0; n < 16; n++) {
        const int64_t key = b * 16 + n;
        row[n] = key < real ? base + pages[key / bs] * c->page_stride + key % bs * c->slot_stride : NULL;
    }
    for (int64_t n = 0; n < 16; n++)
        for (int64_t s = 0; s < steps; s++) {
            const __m512i pairs = row[n] != NULL ? _mm512_loadu_si512(row[n] + s * 32) : _mm512_setzero_si512();
            _mm512_i32scatter_epi32(kt + s * 256 + n, rows, pairs, 4);
        }
    for (int64_t n = 0; n < 16; n += 2) {
        const uint16_t *v0 = row[n] != NULL ? row[n] + c->half_stride : NULL;
        const uint16_t *v1 = row[n + 1] != NULL ? row[n + 1] + c->half_stride : NULL;
        for (int64_t d = 0; d < dim; d += 32) {
            const __m512i a = v0 != NULL ? _mm512_loadu_si512(v0 + d) : _mm512_setzero_si512();
            const __m512i z = v1 != NULL ? _mm512_loadu_si512(v1 + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(vt + (d / 16) * 512 + (n / 2) * 32, _mm512_permutex2var_epi16(a, low, z));
            _mm512_storeu_si512(vt + (d / 16 + 1) * 512 + (n / 2) * 32, _mm512_permutex2var_epi16(a, high, z));
        }
    }
}

/* Scores of two query heads' rows (qa, qz: 16 x dim bfloat16 in 32-dim
 * steps of 16 x 32, 1 KB each; qz NULL: one head) against two 16-key
 * blocks of kp (`kblock` and the next), into sa and sz (16 rows `stride`
 * floats apart, 32 columns): four sums of two loaded rows and two loaded
 * columns, no register loaded while a product still reads it. */
static void score_blocks(const uint16_t *qa, const uint16_t *qz, int64_t dim, const uint16_t *kblock, float *sa,
                         float *sz, int64_t stride)
{
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t s = 0; s < dim / 32; s++) {
        _tile_loadd(2, kblock + s * 512, 64);
        _tile_loadd(3, kblock + 16 * dim + s * 512, 64);
        _tile_loadd(0, qa + s * 512, 64);
        _tile_dpbf16ps(4, 0, 2);
        _tile_dpbf16ps(5, 0, 3);
        if (qz != NULL) {
            _tile_loadd(1, qz + s * 512, 64);
            _tile_dpbf16ps(6, 1, 2);
            _tile_dpbf16ps(7, 1, 3);
        }
    }
    _tile_stored(4, sa, stride * 4);
    _tile_stored(5, sa + 16, stride * 4);
    if (qz != NULL) {
        _tile_stored(6, sz, stride * 4);
        _tile_stored(7, sz + 16, stride * 4);
    }
}

/* oa, oz (16 x dim float32 each) = weights wa, wz (16 x n bfloat16, n a
 * multiple of 32, rows n apart; wz NULL: one head) x the values of vp's
 * 32-key steps from `step0`, 32 dims at a time (four sums again). */
static void weigh_values(const uint16_t *wa, const uint16_t *wz, int64_t n, const uint16_t *vp, int64_t step0,
                         int64_t dim, float *oa, float *oz)
{
    for (int64_t d = 0; d < dim; d += 32) {
        _tile_zero(4);
        _tile_zero(5);
        _tile_zero(6);
        _tile_zero(7);
        for (int64_t k = 0; k < n; k += 32) {
            const uint16_t *v = vp + (step0 + k / 32) * 32 * dim + d / 16 * 512;
            _tile_loadd(2, v, 64);
            _tile_loadd(3, v + 512, 64);
            _tile_loadd(0, wa + k, n * 2);
            _tile_dpbf16ps(4, 0, 2);
            _tile_dpbf16ps(5, 0, 3);
            if (wz != NULL) {
                _tile_loadd(1, wz + k, n * 2);
                _tile_dpbf16ps(6, 1, 2);
                _tile_dpbf16ps(7, 1, 3);
            }
        }
        _tile_stored(4, oa + d, dim * 4);
        _tile_stored(5, oa + d + 16, dim * 4);
        if (wz != NULL) {
            _tile_stored(6, oz + d, dim * 4);
            _tile_stored(7, oz + d + 16, dim * 4);
        }
    }
}

/* One work item: the 16 query rows from `row0` of chunk s, query heads g0 ..
 * g0 + heads - 1 of KV head h. Scratch (the thread's): qb 4 x 16 x dim
 * bfloat16, scores 4 x 16 x width floats, weights 4 x 16 x width bfloat16,
 * visible 16 x width bytes, x width floats, o 2 x 16 x dim floats. */
static void attend_rows(const paged_cache *c, const prefill_rows *p, int64_t s, int64_t row0, int64_t h,
                        int64_t groups, int64_t g0, int heads, const uint16_t *q, int64_t q_heads, float scale,
                        float softcap, const float *sinks, uint16_t *out, const uint16_t *kp, const uint16_t *vp,
                        uint16_t *qb, float *scores, uint16_t *weights, uint8_t *visible, float *x, float *o)
{
    const int64_t dim = c->head_dim, start = p->start[s] + row0, key_pos = p->key_pos[s];
    const int64_t rows = p->count[s] - row0 < 16 ? p->count[s] - row0 : 16;
    /* the 32-key steps any of these rows sees: from the first row's first key to the last row */
    int64_t lo = p->first[start] - key_pos;
    for (int64_t i = 1; i < rows; i++)
        lo = p->first[start + i] - key_pos < lo ? p->first[start + i] - key_pos : lo;
    lo = lo / 32 * 32;
    const int64_t hi = (p->query_pos[s] + row0 + rows - 1 - key_pos) / 32 * 32 + 32, n = hi - lo;
    /* each head's rows as the tiles read them: [32-dim step][16 rows][32] */
    for (int g = 0; g < heads; g++)
        for (int64_t i = 0; i < 16; i++)
            for (int64_t d = 0; d < dim; d += 32) {
                uint16_t *dst = qb + g * 16 * dim + d * 16 + i * 32;
                if (i < rows)
                    memcpy(dst, q + ((start + i) * q_heads + h * groups + g0 + g) * dim + d, 64);
                else
                    memset(dst, 0, 64);
            }
    for (int g = 0; g < heads; g += 2) {
        const int two = g + 1 < heads;
        for (int64_t b = lo / 16; b < hi / 16; b += 2)
            score_blocks(qb + g * 16 * dim, two ? qb + (g + 1) * 16 * dim : NULL, dim, kp + b * 16 * dim,
                         scores + g * 16 * n + b * 16 - lo, scores + (g + 1) * 16 * n + b * 16 - lo, n);
    }
    for (int64_t i = 0; i < 16; i++) {
        uint8_t *vis = visible + i * n;
        memset(vis, 0, (size_t)n);
        if (i < rows) {
            const int64_t a = p->first[start + i] - key_pos - lo, z = p->query_pos[s] + row0 + i - key_pos - lo;
            memset(vis + a, 1, (size_t)(z - a + 1));
        }
    }
    for (int g = 0; g < heads; g++) {
        const float *sink = sinks != NULL ? sinks + h * groups + g0 + g : NULL;
        for (int64_t i = 0; i < 16; i++) {
            if (i < rows)
                masked_softmax_row(scores + (g * 16 + i) * n, 0, visible + i * n, n, scale, softcap, sink,
                                   weights + (g * 16 + i) * n, x, F32, BF16);
            else
                memset(weights + (g * 16 + i) * n, 0, sizeof(uint16_t) * n);
        }
    }
    for (int g = 0; g < heads; g += 2) {
        const int two = g + 1 < heads;
        weigh_values(weights + g * 16 * n, two ? weights + (g + 1) * 16 * n : NULL, n, vp, lo / 32, dim, o,
                     o + 16 * dim);
        for (int k = 0; k <= two; k++)
            for (int64_t i = 0; i < rows; i++)
                copy_as(o + (k * 16 + i) * dim, F32, out + ((start + i) * q_heads + h * groups + g0 + g + k) * dim,
                        BF16, dim);
    }
}
#else
#define AMX_ATTENTION 0
#endif

/* Whether prefill_attention was built (this CPU has AMX's bfloat16 tiles). */
const int amx_prefill_attention = AMX_ATTENTION;

/* Prefill chunks' attention (`prefill_rows`) on AMX tiles: q [tokens,
 * q_heads, head_dim] bfloat16 (contiguous), the pool's pages bfloat16,
 * out like q (only the chunks' rows written); scale, softcap (<= 0: none)
 * and sinks (float32 [q_heads] or NULL) as decode_attention takes them.
 * Returns 0; -1 where scratch memory could not be had; -3 where it cannot
 * run: no AMX in this build, other dtypes, or a head_dim that is no
 * multiple of 32; -4 where Linux refused the tiles' state (the caller then
 * runs the tiles' path). */
int prefill_attention(const paged_cache *cache, const prefill_rows *p, const void *q, int64_t q_heads, float scale,
                      float softcap, const float *sinks, void *out, int dtype, int threads)
{
#if AMX_ATTENTION
    const int64_t dim = cache->head_dim, heads = cache->kv_heads, groups = q_heads / heads;
    if (dtype != BF16 || cache->dtype != BF16 || dim % 32 != 0 || dim > 1024)
        return -3;
    if (!tiles_granted())
        return -4;
    /* each chunk's packed keys and values: n = its keys up to its last query, in 32s */
    int64_t *offset = malloc(sizeof(int64_t) * (size_t)(p->segments + 1)), width = 32, blocks = 0;
    if (offset == NULL)
        return -1;
    offset[0] = 0;
    for (int64_t s = 0; s < p->segments; s++) {
        const int64_t n = (p->query_pos[s] + p->count[s] - p->key_pos[s] + 31) / 32 * 32;
        offset[s + 1] = offset[s] + n * dim * heads;
        width = n > width ? n : width;
        blocks += n / 16 * heads;
    }
    uint16_t *packed = malloc(sizeof(uint16_t) * (size_t)(2 * offset[p->segments] + 1));
    if (packed == NULL) {
        free(offset);
        return -1;
    }
    const int64_t batches = (groups + 3) / 4;
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        /* keys and values laid out, block by block */
#pragma omp for schedule(static)
        for (int64_t j = 0; j < blocks; j++) {
            int64_t s = 0, k = j;
            while (k >= (offset[s + 1] - offset[s]) / dim / 16) /* blocks of chunk s, over its heads */
                k -= (offset[s + 1] - offset[s]) / dim / 16, s++;
            const int64_t n = (offset[s + 1] - offset[s]) / dim / heads, h = k / (n / 16), b = k % (n / 16);
            const int64_t real = p->query_pos[s] + p->count[s] - p->key_pos[s];
            uint16_t *kp = packed + 2 * offset[s] + 2 * h * n * dim;
            pack_block(cache, p->pages + s * p->max_blocks, h, b, real < p->keys[s] ? real : p->keys[s], kp,
                       kp + n * dim);
        }
        const size_t bytes = sizeof(uint16_t) * (size_t)(64 * dim) + (sizeof(float) * 64 + sizeof(uint16_t) * 64 +
                             16 + sizeof(float)) * (size_t)width + sizeof(float) * (size_t)(32 * dim);
        char *scratch = malloc(bytes);
        failed |= scratch == NULL;
        if (scratch != NULL)
            configure_tiles();
        /* then every chunk's 16-row blocks, KV heads and up to 4 of their query heads */
        int64_t items = 0;
        for (int64_t s = 0; s < p->segments; s++)
            items += (p->count[s] + 15) / 16;
#pragma omp for schedule(dynamic, 1) collapse(2)
        for (int64_t j = 0; j < items; j++) {
            for (int64_t hb = 0; hb < heads * batches; hb++) {
                if (scratch == NULL)
                    continue;
                int64_t s = 0, block = j;
                while (block >= (p->count[s] + 15) / 16)
                    block -= (p->count[s] + 15) / 16, s++;
                const int64_t h = hb / batches, g0 = hb % batches * 4, n = (offset[s + 1] - offset[s]) / dim / heads;
                const uint16_t *kp = packed + 2 * offset[s] + 2 * h * n * dim;
                uint16_t *qb = (uint16_t *)scratch;
                float *scores = (float *)(qb + 64 * dim);
                uint16_t *weights = (uint16_t *)(scores + 64 * width);
                float *o = (float *)(weights + 64 * width);
                float *x = o + 32 * dim;
                uint8_t *visible = (uint8_t *)(x + width);
                attend_rows(cache, p, s, block * 16, h, groups, g0, (int)(groups - g0 < 4 ? groups - g0 : 4), q,
                            q_heads, scale, softcap, sinks, out, kp, kp + n * dim, qb, scores, weights, visible, x,
                            o);
            }
        }
        if (scratch != NULL)
            _tile_release();
        free(scratch);
    }
    free(packed);
    free(offset);
    return failed ? -1 : 0;
#else
    (void)cache, (void)p, (void)q, (void)q_heads, (void)scale, (void)softcap, (void)sinks, (void)out, (void)dtype,
        (void)threads;
    return -3;
#endif
}

/* The float32 norm the decoder layer runs on its scratch rows. */
static void norm_row(const float *row, const float *weight, float offset, float eps, int64_t dim, float *out)
{
    norm_row_as(row, F32, weight, F32, offset, eps, 0, dim, out, F32);
}

/* o (dim elements of type ot, in place) rotated half against half by c
 * and s (type ct); each product and sum rounded to ot. */
INLINE void rotate_row_as(void *o, int ot, const void *c, const void *s, int ct, int64_t dim)
{
    const int64_t half = dim / 2;
    int64_t d = 0;
    for (; d + LANES <= half; d += LANES) {
        const vec x1 = load_as(o, d, ot), x2 = load_as(o, half + d, ot);
        store_as(o, d, rounded_as(x1 * load_as(c, d, ct), ot) - rounded_as(x2 * load_as(s, d, ct), ot), ot);
        store_as(o, half + d,
                 rounded_as(x2 * load_as(c, half + d, ct), ot) + rounded_as(x1 * load_as(s, half + d, ct), ot), ot);
    }
    for (; d < half; d++) {
        const float x1 = get_as(o, d, ot), x2 = get_as(o, half + d, ot);
        put_as(o, d, rounded1_as(x1 * get_as(c, d, ct), ot) - rounded1_as(x2 * get_as(s, d, ct), ot), ot);
        put_as(o, half + d,
               rounded1_as(x2 * get_as(c, half + d, ct), ot) + rounded1_as(x1 * get_as(s, half + d, ct), ot), ot);
    }
}

/* One row of norm_rotary, x and out (and cos, sin) of type t, the weight
 * of type wt. */
INLINE void norm_rotary_row(const void *row, void *o, int64_t dim, const void *weight, float offset, float eps,
                            int round_first, const void *c, const void *s, int t, int wt)
{
    if (weight != NULL)
        norm_row_as(row, t, weight, wt, offset, eps, round_first, dim, o, t);
    else if (o != row)
        memcpy(o, row, size_of(t) * (size_t)dim);
    if (c != NULL)
        rotate_row_as(o, t, c, s, t, dim);
}

/* x [outer, inner, dim] of storage type `dtype`, with strides
 * (outer_stride, inner_stride, 1); out the same shape and type,
 * contiguous. Each row of dim: with weight (of type weight_dtype), scaled
 * by rsqrt(mean(x^2) + eps) * (weight + offset) (`norm_row_as`, with
 * round_first); then, with cos and sin ([outer, dim], contiguous,
 * `dtype`), rotated half against half (rotary embeddings, the rotate-half
 * convention; dim even). */
void norm_rotary(const void *x, int64_t outer, int64_t inner, int64_t dim, int64_t outer_stride,
                 int64_t inner_stride, const void *weight, int weight_dtype, float offset, float eps, int round_first,
                 const void *cos, const void *sin, void *out, int dtype, int threads)
{
    const int t = dtype, wt = weight_dtype;
#pragma omp parallel for num_threads(threads) schedule(static) if (outer * inner * dim > PARALLEL_WORK)
    for (int64_t a = 0; a < outer; a++) {
        const void *c = cos != NULL ? at(cos, a * dim, t) : NULL, *s = sin != NULL ? at(sin, a * dim, t) : NULL;
        for (int64_t b = 0; b < inner; b++) {
            const void *row = at(x, a * outer_stride + b * inner_stride, t);
            void *o = at(out, (a * inner + b) * dim, t);
            /* one inlined copy per pair of types */
            if (t == F32 && wt == F32)
                norm_rotary_row(row, o, dim, weight, offset, eps, round_first, c, s, F32, F32);
            else if (t == F32)
                norm_rotary_row(row, o, dim, weight, offset, eps, round_first, c, s, F32, BF16);
            else if (wt == F32)
                norm_rotary_row(row, o, dim, weight, offset, eps, round_first, c, s, BF16, F32);
            else
                norm_rotary_row(row, o, dim, weight, offset, eps, round_first, c, s, BF16, BF16);
        }
    }
}

/* sigmoid(x) from exp of a non-positive argument only: 1 / (1 + e^-x)
 * for x >= 0, e^x / (1 + e^x) below. */
static inline vec sigmoid(vec x)
{
    const vec e = exp_nonpositive(select(x > 0.0f, -x, x)); /* e^-|x| */
    const vec s = 1.0f / (1.0f + e);
    return select(x >= 0.0f, s, e * s);
}

/* act(x): SiLU (kind 0) or GELU with the tanh approximation (kind 1),
 * where 0.5 x (1 + tanh(y)) = x * sigmoid(2y). */
static inline vec activation(vec x, int kind)
{
    const vec y = kind == 0 ? x : 1.5957691216f * (x + 0.044715f * x * x * x); /* 2 sqrt(2/pi) (...) */
    return x * sigmoid(y);
}

static inline float activation1(float x, int kind)
{
    const float y = kind == 0 ? x : 1.5957691216f * (x + 0.044715f * x * x * x);
    return x / (1.0f + expf(-y));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* `activation` in AVX-512 without a division: sigmoid(y) = 1 / (1 + e^-y),
 * e^-y as exp_nonpositive takes it (2^n e^r, ln 2 in two parts, e^r to
 * r^6; roundscale and scalef here) for -y held within +-87 (the sigmoid
 * then within 1e-38 of 0 or 1 past it), the reciprocal from rcp14 refined
 * by one Newton step, x / d corrected by its residual. A division's
 * throughput bound the portable code: the real Gemma-3 270M's gated
 * activations over a 2,048-token prefill step took 1.2-1.3x as long on a
 * Xeon with AMX. (Not exp2_lanes of -y log2(e): that product's rounding
 * moves e^-y by up to ~4e-7 at |y| ~ 10, enough to turn bfloat16 ties.) */
static inline vec activation_avx512(vec v, int kind)
{
    const __m512 x = (__m512)v;
    __m512 y = x;
    if (kind != 0)
        y = _mm512_mul_ps(_mm512_set1_ps(1.5957691216f),
                          _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(x, x), x), _mm512_set1_ps(0.044715f), x));
    const __m512 z = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), y), _mm512_set1_ps(-87.0f)),
                                   _mm512_set1_ps(87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(z, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), z);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512 d = _mm512_add_ps(_mm512_scalef_ps(p, n), _mm512_set1_ps(1.0f));
    __m512 inv = _mm512_rcp14_ps(d);
    inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(d, inv, _mm512_set1_ps(2.0f)));
    /* x / d: the quotient corrected by its residual (two fused operations),
     * as a division rounds it but in rare last bits; a bit off decides a
     * bfloat16 rounding where the value lies on a tie (SiLU(5.9375)) */
    const __m512 q = _mm512_mul_ps(x, inv);
    return (vec)_mm512_fmadd_ps(_mm512_fnmadd_ps(q, d, x), inv, q);
}
#define ACTIVATION activation_avx512
#else
#define ACTIVATION activation
#endif

/* One row of gated_activation, of type t: the activation rounded to t
 * before the product, as torch's two ops round. */
INLINE void gated_row(const void *g, const void *u, void *o, int64_t inter, int kind, int t)
{
    int64_t j = 0;
    for (; j + LANES <= inter; j += LANES)
        store_as(o, j, rounded_as(ACTIVATION(load_as(g, j, t), kind), t) * load_as(u, j, t), t);
    for (; j < inter; j++)
        put_as(o, j, rounded1_as(activation1(get_as(g, j, t), kind), t) * get_as(u, j, t), t);
}

/* gate_up [rows, 2 * inter] (row stride `stride`): the gate's columns,
 * then the up projection's. out [rows, inter] = act(gate) * up
 * (`activation`); both of storage type `dtype`. */
void gated_activation(const void *gate_up, int64_t rows, int64_t inter, int64_t stride, int kind, void *out,
                      int dtype, int threads)
{
#pragma omp parallel for num_threads(threads) schedule(static) if (rows * inter > PARALLEL_WORK)
    for (int64_t r = 0; r < rows; r++) {
        const void *g = at(gate_up, r * stride, dtype), *u = at(g, inter, dtype);
        void *o = at(out, r * inter, dtype);
        if (dtype == F32)
            gated_row(g, u, o, inter, kind, F32);
        else
            gated_row(g, u, o, inter, kind, BF16);
    }
}

/* ---- A decoder layer's decode step in one call: a few query rows, every
 * product a matrix-vector one that reads each weight once, all of it in
 * one parallel region. At batch 1 a step through torch's modules spends
 * as long between the products as in the elementwise work itself: ~15
 * calls per layer from Python, each waking the threads again. */

/* The dot products of x (k floats) with `count` (<= 4) consecutive rows
 * of w, k elements of type wt each (rows past count repeat the last:
 * computed, not kept). */
INLINE void dot_rows_as(const float *x, const void *w, int64_t k, int64_t count, float *out, int wt)
{
    const void *w0 = w, *w1 = at(w, (count > 1) * k, wt), *w2 = at(w, (count > 2 ? 2 : count - 1) * k, wt),
               *w3 = at(w, (count > 3 ? 3 : count - 1) * k, wt);
    vec a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t d = 0;
    for (; d + LANES <= k; d += LANES) {
        const vec xv = load(x + d);
        a0 += load_as(w0, d, wt) * xv, a1 += load_as(w1, d, wt) * xv, a2 += load_as(w2, d, wt) * xv,
            a3 += load_as(w3, d, wt) * xv;
    }
    float s[4] = {sum_lanes(a0), sum_lanes(a1), sum_lanes(a2), sum_lanes(a3)};
    for (; d < k; d++)
        s[0] += x[d] * get_as(w0, d, wt), s[1] += x[d] * get_as(w1, d, wt), s[2] += x[d] * get_as(w2, d, wt),
            s[3] += x[d] * get_as(w3, d, wt);
    for (int64_t c = 0; c < count; c++)
        out[c] = s[c];
}

/* dot_rows_as inlined once per weight type. */
static inline void dot_rows(const float *x, const void *w, int64_t k, int64_t count, float *out, int wt)
{
    if (wt == F32)
        dot_rows_as(x, w, k, count, out, F32);
    else
        dot_rows_as(x, w, k, count, out, BF16);
}

/* out [rows, n] = x [rows, k] times w [n, k] (type wt) transposed, plus
 * bias (or none): the calling thread's share of the columns (a
 * worksharing loop inside the caller's parallel region; its end is a
 * barrier). Four weight rows at a time, read once for every row of x. */
static void products(const float *x, int64_t rows, int64_t k, const void *w, int wt, const float *bias, int64_t n,
                     float *out)
{
#pragma omp for schedule(static)
    for (int64_t j = 0; j < n; j += 4) {
        const int64_t count = n - j < 4 ? n - j : 4;
        for (int64_t r = 0; r < rows; r++) {
            float *o = out + r * n + j;
            dot_rows(x + r * k, at(w, j * k, wt), k, count, o, wt);
            if (bias != NULL)
                for (int64_t c = 0; c < count; c++)
                    o[c] += bias[j + c];
        }
    }
}

/* The gated MLP's first half: out [rows, inter] = act(gate) * up, gate_up
 * [2 * inter, k] (type wt; the gate's rows, then up's), LANES columns at a
 * time. */
static void gated_products(const float *x, int64_t rows, int64_t k, const void *gate_up, int wt, int64_t inter,
                           int kind, float *out)
{
#pragma omp for schedule(static)
    for (int64_t j = 0; j < inter; j += LANES) {
        const int64_t count = inter - j < LANES ? inter - j : LANES;
        for (int64_t r = 0; r < rows; r++) {
            float g[LANES] = {0}, u[LANES] = {0};
            for (int64_t c = 0; c < count; c += 4) {
                const int64_t part = count - c < 4 ? count - c : 4;
                dot_rows(x + r * k, at(gate_up, (j + c) * k, wt), k, part, g + c, wt);
                dot_rows(x + r * k, at(gate_up, (inter + j + c) * k, wt), k, part, u + c, wt);
            }
            float o[LANES];
            store(o, activation(load(g), kind) * load(u));
            memcpy(out + r * inter + j, o, sizeof(float) * (size_t)count);
        }
    }
}

#if defined(__AVX512BF16__)
/* ---- bfloat16 products on the CPU's own dot product (AVX-512 BF16's
 * vdpbf16ps: pairs of bfloat16 multiplied and added into float32 lanes).
 * The inputs are rounded to bfloat16 first, as torch's modules hold them
 * (a bfloat16 Linear reads a bfloat16 input), so a weight is read once and
 * never widened: at four rows and up the widening products above spend
 * more time converting weights than memory takes to deliver them, which
 * kept the one-call layers below oneDNN's products at five rows and up. */
#define NATIVE_BF16 1

/* `count` (<= 4) elements of 16-bit type at p and up, zero past them. */
static inline __m512i load_pairs(const uint16_t *p, int64_t count)
{
    return count >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16((__mmask32)((1ull << count) - 1), p);
}

/* The weights these products read are laid out in tiles (decoder.py
 * `tiles`, once at load): a matrix [n, k] as [n / 4][k / 32][4][32],
 * four rows' next 32 elements side by side, n rounded up to 4 rows and k
 * to 32 columns with zeros. A tile's four rows then stream from one run
 * of memory, where four rows of the dense matrix were four runs 2k bytes
 * apart, which the hardware's prefetchers follow less well (batch-1
 * steps of the real Gemma-3 270M in bfloat16: benchmarks/cpu_decode_step.py
 * --dtype bfloat16). */
static inline int64_t tile_width(int64_t k) { return (k + 31) / 32 * 32; }

/* out[b * stride + a] = xb row b . weight row a (+ bias[a]) for the
 * `count` (<= 4) rows of one tile and rc (<= 4) rows of xb (bfloat16, k
 * each; inlined once per rc, so that one row does one row's work). */
INLINE void tile_rows(const uint16_t *xb, int64_t k, const uint16_t *tile, int64_t count, const float *bias,
                      float *out, int64_t stride, int rc)
{
    __m512 acc[4][4];
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < rc; b++)
            acc[a][b] = _mm512_setzero_ps();
    for (int64_t d = 0; d < k; d += 32) {
        const int64_t left = k - d;
        const uint16_t *p = tile + 4 * d; /* the tile's next 4 x 32 elements */
        __m512bh wv[4], xv[4];
        for (int a = 0; a < 4; a++) {
            /* the next tile's same line: fetched while this one's further
             * rows of xb take it from cache (a few lines ahead left 16-row
             * products waiting on memory) */
            _mm_prefetch((const char *)(p + 4 * tile_width(k) + 32 * a), _MM_HINT_T0);
            wv[a] = (__m512bh)_mm512_loadu_si512(p + 32 * a);
        }
        for (int b = 0; b < rc; b++)
            xv[b] = (__m512bh)load_pairs(xb + b * k + d, left);
        for (int a = 0; a < 4; a++)
            for (int b = 0; b < rc; b++)
                acc[a][b] = _mm512_dpbf16_ps(acc[a][b], wv[a], xv[b]);
    }
    for (int b = 0; b < rc; b++)
        for (int64_t a = 0; a < count; a++)
            out[b * stride + a] = _mm512_reduce_add_ps(acc[a][b]) + (bias != NULL ? bias[a] : 0.0f);
}

/* tile_rows over every row of xb [rows, k], four rows at a time: the
 * tile read from memory once and from cache for each further four
 * (sixteen float32 sums at most). */
static void tile_bf16(const uint16_t *xb, int64_t rows, int64_t k, const uint16_t *tile, int64_t count,
                      const float *bias, float *out, int64_t stride)
{
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const uint16_t *x = xb + r0 * k;
        float *o = out + r0 * stride;
        switch (rows - r0 < 4 ? rows - r0 : 4) {
        case 1: tile_rows(x, k, tile, count, bias, o, stride, 1); break;
        case 2: tile_rows(x, k, tile, count, bias, o, stride, 2); break;
        case 3: tile_rows(x, k, tile, count, bias, o, stride, 3); break;
        default: tile_rows(x, k, tile, count, bias, o, stride, 4); break;
        }
    }
}

/* xb [rows, k] = x [rows, k] rounded to bfloat16: each thread its own
 * copy (a few KB), so that no barrier waits for a shared one. */
static void rounded_rows(const float *x, int64_t rows, int64_t k, uint16_t *xb)
{
    for (int64_t r = 0; r < rows; r++)
        copy_as(x + r * k, F32, xb + r * k, BF16, k);
}
#else
#define NATIVE_BF16 0
#endif

/* A layer's product (as `products`): where the weights are bfloat16 and the
 * CPU has its dot product, on it, the weights in tiles and the input
 * rounded to bfloat16 first into the thread's xb (rows * k); else widening
 * each (dense) weight to float32. */
static void layer_products(const float *x, int64_t rows, int64_t k, const void *w, int wt, const float *bias,
                           int64_t n, float *out, uint16_t *xb)
{
#if NATIVE_BF16
    if (wt == BF16) {
        rounded_rows(x, rows, k, xb);
        const int64_t kp = tile_width(k);
#pragma omp for schedule(static)
        for (int64_t j = 0; j < n; j += 4)
            tile_bf16(xb, rows, k, (const uint16_t *)w + j * kp, n - j < 4 ? n - j : 4,
                      bias != NULL ? bias + j : NULL, out + j, n);
        return;
    }
#endif
    (void)xb;
    products(x, rows, k, w, wt, bias, n, out);
}

/* The gated MLP's first half as layer_products does it: LANES columns of
 * gate and of up at a time into gu [rows, 2 * inter] (scratch), then
 * act(gate) * up for those columns, by the same thread (no barrier). */
static void layer_gated_products(const float *x, int64_t rows, int64_t k, const void *gate_up, int wt,
                                 int64_t inter, int kind, float *out, uint16_t *xb, float *gu)
{
#if NATIVE_BF16
    if (wt == BF16) {
        /* gate's tiles, then up's (each rounded up to whole tiles) */
        const int64_t kp = tile_width(k);
        const uint16_t *gate = (const uint16_t *)gate_up, *up = gate + (inter + 3) / 4 * 4 * kp;
        rounded_rows(x, rows, k, xb);
#pragma omp for schedule(static)
        for (int64_t j = 0; j < inter; j += LANES) {
            const int64_t count = inter - j < LANES ? inter - j : LANES;
            for (int64_t c = 0; c < count; c += 4) {
                const int64_t part = count - c < 4 ? count - c : 4;
                tile_bf16(xb, rows, k, gate + (j + c) * kp, part, NULL, gu + j + c, 2 * inter);
                tile_bf16(xb, rows, k, up + (j + c) * kp, part, NULL, gu + inter + j + c, 2 * inter);
            }
            for (int64_t r = 0; r < rows; r++) {
                const float *g = gu + r * 2 * inter + j, *u = g + inter;
                if (count == LANES)
                    store(out + r * inter + j, activation(load(g), kind) * load(u));
                else
                    for (int64_t c = 0; c < count; c++)
                        out[r * inter + j + c] = activation1(g[c], kind) * u[c];
            }
        }
        return;
    }
#endif
    (void)xb, (void)gu;
    gated_products(x, rows, k, gate_up, wt, inter, kind, out);
}

/* 1 where bfloat16 products run on the CPU's dot product (the one-call
 * layers then keep up with oneDNN's products to more rows: decoder.py
 * reads it through library.py), else 0. A constant, not a function: no
 * kernel to test. */
const int native_bf16_products = NATIVE_BF16;

/* out [rows, n] (bfloat16) = x [rows, k] (bfloat16, contiguous) times w
 * [n, k] transposed, w in tiles (decoder.py `tiles`), each sum float32
 * and rounded once: a bfloat16 LM head on small decode steps (head.py).
 * Its weight is the largest a step reads (Gemma-3 270M: 335 MB of 511),
 * and oneDNN's product read it at 13.6 GB/s on one Xeon with AMX, where
 * these tiles stream at memory's rate (~20 GB/s there). Returns 0, -1
 * for more than HEAD_MAX_ROWS rows, -2 where the CPU has no bfloat16 dot
 * product (the caller runs oneDNN's). */
#define HEAD_MAX_ROWS 64

int head_products(const void *x, int64_t rows, int64_t k, const void *w, int64_t n, void *out, int threads)
{
#if NATIVE_BF16
    if (rows > HEAD_MAX_ROWS)
        return -1;
    const int64_t kp = tile_width(k);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t j = 0; j < n; j += 4) {
        const int64_t count = n - j < 4 ? n - j : 4;
        float sums[HEAD_MAX_ROWS * 4];
        tile_bf16((const uint16_t *)x, rows, k, (const uint16_t *)w + j * kp, count, NULL, sums, 4);
        for (int64_t r = 0; r < rows; r++)
            for (int64_t a = 0; a < count; a++)
                ((uint16_t *)out)[r * n + j + a] = narrow1(sums[r * 4 + a]);
    }
    return 0;
#else
    (void)x, (void)rows, (void)k, (void)w, (void)n, (void)out, (void)threads;
    return -2;
#endif
}

/* x += norm(sub) (sub, float32, normed in place; no norm: x += sub), dim
 * elements; x of type t, rounded once per add (the residual stream as
 * the model holds it). */
static void add_residual(void *x, int t, float *sub, const float *norm, float offset, float eps, int64_t dim)
{
    if (norm != NULL)
        norm_row(sub, norm, offset, eps, dim, sub);
    if (t == F32)
        for (int64_t d = 0; d < dim; d++)
            ((float *)x)[d] += sub[d];
    else
        for (int64_t d = 0; d < dim; d++)
            put_as(x, d, get_as(x, d, BF16) + sub[d], BF16);
}

/* h (float32) = norm(a row of x, type t): norm_row_as inlined per type. */
static void norm_x_row(const void *x, int t, const float *norm, float offset, float eps, int64_t dim, float *h)
{
    if (t == F32)
        norm_row(x, norm, offset, eps, dim, h);
    else
        norm_row_as(x, BF16, norm, F32, offset, eps, 0, dim, h, F32);
}

/* One decoder layer's weights and shape (decoder.py fills it).
 * Products' weights are [out, in], of storage type `dtype`, which is
 * also the type of the residual stream x and of cos and sin; norms,
 * biases and sinks ([q_heads] attention sink logits) are float32, and
 * NULL where absent. k_centre [kv_heads, head_dim] float32: the keys are
 * stored less it (kv_quant.py KeyCentre), after the rotary and before
 * quantized pages' rotation; NULL: as they are. */
typedef struct {
    int64_t hidden, q_heads, kv_heads, head_dim, inter, activation, dtype;
    float eps, norm_offset, scale, softcap; /* softcap <= 0: none */
    const float *input_norm, *post_attention_norm, *pre_feedforward_norm, *post_feedforward_norm;
    const float *q_norm, *k_norm, *sinks, *qkv_bias, *o_bias, *k_centre;
    const void *qkv, *o, *gate_up, *down;
    /* 1: the products' weights in tiles (tile_width), as the bfloat16
     * products on the CPU's dot product read them, and only they; 0: dense */
    int64_t tiled;
} decoder_layer;

/* The layer's parts, between which a tensor-parallel rank (decoder.py)
 * sums its output products with the other ranks': it holds its share of
 * the heads and of the MLP's width, so Wo and down give partial sums, and
 * the residual add and the norms after them need the whole sum. */
enum { LAYER_WHOLE = 0, LAYER_ATTENTION = 1, LAYER_FEED_FORWARD = 2, LAYER_LAST_RESIDUAL = 3 };

/* attn [rows, q_heads * head_dim] = attention of qkv [rows, q, k, v] (float32,
 * the q/k/v product's output): q and k normed and rotated (k less its
 * centre, and K/V rotated for int8 pages), the new K/V stored, each row's
 * queries attended over its keys. Inside the caller's parallel region; a
 * failed attention row sets *failed. */
static void attention_between(const decoder_layer *L, const paged_cache *c, const decode_rows *d, const void *cos,
                              const void *sin, float *qkv, float *attn, int *failed)
{
    const int64_t rows = d->rows, block_size = c->block_size, page_stride = c->page_stride;
    const int64_t half_stride = c->half_stride, slot_stride = c->slot_stride, head_stride = c->head_stride;
    const int64_t *store_pages = d->store_pages, *store_offsets = d->store_offsets;
    const int64_t *store_scale_pages = d->store_scale_pages != NULL ? d->store_scale_pages : store_pages;
    const int t = (int)L->dtype, ct = (int)c->dtype;
    const size_t row_bytes = size_of(ct) * (size_t)L->head_dim;
    const int64_t dim = L->head_dim, heads = L->q_heads + L->kv_heads;
    const int64_t q_width = L->q_heads * dim, kv_width = L->kv_heads * dim, qkv_width = q_width + 2 * kv_width;
    const int64_t groups = L->q_heads / L->kv_heads, batches = (groups + 3) / 4;
    const float offset = L->norm_offset, eps = L->eps;
#pragma omp for schedule(static) collapse(2)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t head = 0; head < heads; head++) { /* the query heads, then the key heads */
            float *row = qkv + r * qkv_width + head * dim;
            const float *weight = head < L->q_heads ? L->q_norm : L->k_norm;
            if (weight != NULL)
                norm_row(row, weight, offset, eps, dim, row);
            const void *cr = at(cos, r * dim, t), *sr = at(sin, r * dim, t);
            if (t == F32)
                rotate_row_as(row, F32, cr, sr, F32, dim);
            else
                rotate_row_as(row, F32, cr, sr, BF16, dim);
            if (head >= L->q_heads && L->k_centre != NULL) {
                const float *centre = L->k_centre + (head - L->q_heads) * dim;
                for (int64_t i = 0; i < dim; i++)
                    row[i] -= centre[i];
            }
        }
    }
    if (ct == I8 && c->rotated) { /* keys and values stored rotated; attend_row rotates the queries and output */
#pragma omp for schedule(static) collapse(2)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t head = 0; head < 2 * L->kv_heads; head++)
                rotate_hadamard(qkv + r * qkv_width + q_width + head * dim, dim);
    }
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t page = store_pages[r] * page_stride;
        const float *k = qkv + r * qkv_width + q_width, *v = k + kv_width;
        for (int64_t head = 0; head < L->kv_heads; head++) {
            const int64_t slot0 = page + store_offsets[r] * slot_stride + head * head_stride;
            if (is_code(ct)) {
                float *scales = (float *)c->scales + store_scale_pages[r] * c->scale_page_stride +
                                store_offsets[r] * c->scale_slot_stride + head * c->scale_head_stride;
                quantize_row(k + head * dim, dim, (uint8_t *)c->data + slot0, scales, ct);
                quantize_row(v + head * dim, dim, (uint8_t *)c->data + slot0 + half_stride,
                             scales + c->scale_half_stride, ct);
            } else {
                copy_as(k + head * dim, F32, at(c->data, slot0, ct), ct, dim);
                copy_as(v + head * dim, F32, at(c->data, slot0 + half_stride, ct), ct, dim);
            }
            for (int64_t s = 1; store_offsets[r] == 0 && s < block_size; s++) {
                memset(at(c->data, page + s * slot_stride + head * head_stride, ct), 0, row_bytes);
                memset(at(c->data, page + half_stride + s * slot_stride + head * head_stride, ct), 0, row_bytes);
                if (is_code(ct)) {
                    float *scales = (float *)c->scales + store_scale_pages[r] * c->scale_page_stride +
                                    s * c->scale_slot_stride + head * c->scale_head_stride;
                    scales[0] = scales[c->scale_half_stride] = 0.0f;
                }
            }
        }
    }
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t hb = 0; hb < L->kv_heads * batches; hb++) {
            const int64_t head = hb / batches, g0 = hb % batches * 4;
            const int64_t count = groups - g0 < 4 ? groups - g0 : 4;
            if (attend_row(qkv + r * qkv_width, c, d, r, groups, head, g0, count, L->scale, L->softcap, L->sinks,
                           attn + r * q_width, F32) != 0) {
#pragma omp atomic write
                *failed = 1;
            }
        }
    }
}

/* sums [rows, hidden] = attn(rotary(norm(q)), ...) Wo (+ b) of h = norm(x),
 * the new K/V stored: each thread's share, inside the caller's parallel
 * region. A failed attention row sets *failed. */
static void attention_part(const decoder_layer *L, const paged_cache *c, const decode_rows *d, const void *x,
                           const void *cos, const void *sin, float *h, float *qkv, float *attn, float *sums,
                           uint16_t *xb, int *failed)
{
    const int64_t rows = d->rows, H = L->hidden, q_width = L->q_heads * L->head_dim;
    const int t = (int)L->dtype;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        norm_x_row(at(x, r * H, t), t, L->input_norm, L->norm_offset, L->eps, H, h + r * H);
    layer_products(h, rows, H, L->qkv, t, L->qkv_bias, q_width + 2 * L->kv_heads * L->head_dim, qkv, xb);
    attention_between(L, c, d, cos, sin, qkv, attn, failed);
    layer_products(attn, rows, q_width, L->o, t, L->o_bias, H, sums, xb);
}

/* x += post_attention_norm(sub) (float32, normed in place), then h
 * (float32) = pre_feedforward_norm(x): one row. */
static void residual_then_norm(const decoder_layer *L, void *x, float *sub, float *h)
{
    const int t = (int)L->dtype;
    add_residual(x, t, sub, L->post_attention_norm, L->norm_offset, L->eps, L->hidden);
    norm_x_row(x, t, L->pre_feedforward_norm, L->norm_offset, L->eps, L->hidden, h);
}

/* x += post_norm(sums) (the attention's), then sums [rows, hidden] =
 * down(act(h Wg) * h Wu) with h = pre_norm(x): inside the caller's region. */
static void feed_forward_part(const decoder_layer *L, int64_t rows, void *x, float *h, float *act, float *sums,
                              uint16_t *xb, float *gu)
{
    const int64_t H = L->hidden;
    const int t = (int)L->dtype;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++)
        residual_then_norm(L, at(x, r * H, t), sums + r * H, h + r * H);
    layer_gated_products(h, rows, H, L->gate_up, t, L->inter, (int)L->activation, act, xb, gu);
    layer_products(act, rows, L->inter, L->down, t, NULL, H, sums, xb);
}

/* x [rows, hidden] (in place: the residual stream) through one layer, each
 * row one sequence's next token:
 *   h = norm(x); q, k, v = h Wqkv (+ b); q, k = rotary(norm(q), norm(k));
 *   k, v stored at (store_pages[r], store_offsets[r]) of the cache;
 *   attention as decode_attention over the rows' keys (`decode_rows`),
 *   with the layer's sinks where it has them;
 *   x += post_norm(attn Wo (+ b)); x += post_norm(down(act(h Wg) * h Wu))
 *   with h = pre_norm(x)
 * (a missing post norm is the identity). A block written first here gets
 * the slots after the new token zeroed, as the torch reference's `store`
 * does. x, cos and sin ([rows, head_dim]) are of the layer's type; all in
 * between is float32, K/V rounded to the cache's type where stored and x
 * to its own where each residual is added.
 *
 * `part` LAYER_WHOLE runs all of it in one parallel region (`sums` may be
 * NULL). A tensor-parallel rank runs it in three calls, adding up `sums`
 * [rows, hidden] (float32) with the other ranks' after the first two: LAYER_ATTENTION
 * leaves its attention's partial output product in `sums`,
 * LAYER_FEED_FORWARD adds the summed one to x and leaves the MLP's partial
 * product there, LAYER_LAST_RESIDUAL adds the summed one to x. Returns 0,
 * or -1 where memory for scratch could not be had (or `part` is none of
 * these, or the weights are not laid out as these products read them:
 * `tiled`). */
int decode_layer(const decoder_layer *L, const paged_cache *c, const decode_rows *d, void *x, const void *cos,
                 const void *sin, float *sums, int part, int threads)
{
    if (part < LAYER_WHOLE || part > LAYER_LAST_RESIDUAL || (is_code((int)c->dtype) && c->scales == NULL) ||
        (c->rotated && (c->head_dim & (c->head_dim - 1))) || L->tiled != (NATIVE_BF16 && L->dtype == BF16))
        return -1;
    const int64_t rows = d->rows, H = L->hidden, dim = L->head_dim;
    const int64_t q_width = L->q_heads * dim, qkv_width = q_width + 2 * L->kv_heads * dim;
    /* Floats: h, qkv, attn, act, sub, gate_up's product; then each thread's
     * copy of the products' inputs rounded to bfloat16 (layer_products),
     * the widest of them. */
    const int64_t widest = H > q_width ? (H > L->inter ? H : L->inter) : (q_width > L->inter ? q_width : L->inter);
    const int64_t floats = rows * (2 * H + qkv_width + q_width + 3 * L->inter);
    float *scratch = malloc(sizeof(float) * (size_t)floats + sizeof(uint16_t) * (size_t)(threads * rows * widest));
    if (scratch == NULL)
        return -1;
    float *h = scratch, *qkv = h + rows * H, *attn = qkv + rows * qkv_width, *act = attn + rows * q_width,
          *sub = act + rows * L->inter, *gu = sub + rows * H;
    uint16_t *const xbs = (uint16_t *)(scratch + floats);
    if (sums == NULL)
        sums = sub;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        uint16_t *xb = xbs + (int64_t)omp_get_thread_num() * rows * widest;
        if (part == LAYER_WHOLE || part == LAYER_ATTENTION)
            attention_part(L, c, d, x, cos, sin, h, qkv, attn, sums, xb, &failed);
        if (part == LAYER_WHOLE || part == LAYER_FEED_FORWARD)
            feed_forward_part(L, rows, x, h, act, sums, xb, gu);
        if (part == LAYER_WHOLE || part == LAYER_LAST_RESIDUAL) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++)
                add_residual(at(x, r * H, (int)L->dtype), (int)L->dtype, sums + r * H, L->post_feedforward_norm,
                             L->norm_offset, L->eps, H);
        }
    }
    free(scratch);
    return failed ? -1 : 0;
}

/* The stages of `decode_layer` between its four products, for a caller
 * that makes those itself (decoder.py: oneDNN's batched products, which
 * beat the layer's own from a dozen rows on, a few in float32, where the
 * modules' way spent a fifth of a 16-row step between the products, in
 * Python). `in` is the
 * product before the stage, `out` the input of the one after it, [rows, n]
 * each, of the layer's type t (the products read and write it):
 *   LAYER_STAGE_INPUT:  out = input_norm(x)                       (in unused)
 *   LAYER_STAGE_ATTEND: out = attention of in = q/k/v, the new K/V stored
 *   LAYER_STAGE_MID:    x += post_attention_norm(in); out = pre_feedforward_norm(x)
 *   LAYER_STAGE_ACT:    out = act(in's gate) * in's up
 *   LAYER_STAGE_END:    x += post_feedforward_norm(in)            (out unused)
 * each computed in float32 as `decode_layer` does it and rounded to t once,
 * where written. Returns 0, or -1 where memory for scratch could not be had
 * (or a row's attention could not, or `stage` is none of these). */
enum { LAYER_STAGE_INPUT = 0, LAYER_STAGE_ATTEND = 1, LAYER_STAGE_MID = 2, LAYER_STAGE_ACT = 3, LAYER_STAGE_END = 4 };

int layer_stage(const decoder_layer *L, const paged_cache *c, const decode_rows *d, void *x, const void *cos,
                const void *sin, const void *in, void *out, int stage, int threads)
{
    if (stage < LAYER_STAGE_INPUT || stage > LAYER_STAGE_END || (is_code((int)c->dtype) && c->scales == NULL) ||
        (c->rotated && (c->head_dim & (c->head_dim - 1))))
        return -1;
    const int t = (int)L->dtype;
    const int64_t rows = d->rows, H = L->hidden, dim = L->head_dim, inter = L->inter;
    const int64_t q_width = L->q_heads * dim, qkv_width = q_width + 2 * L->kv_heads * dim;
    /* Floats: q/k/v and the attention's output (ATTEND), or a row of the
     * product and of the norm after it per row (the others). */
    const int64_t floats = stage == LAYER_STAGE_ATTEND ? rows * (qkv_width + q_width) : rows * 2 * H;
    float *scratch = malloc(sizeof(float) * (size_t)(floats > 0 ? floats : 1));
    if (scratch == NULL)
        return -1;
    int failed = 0;
#pragma omp parallel num_threads(threads)
    {
        if (stage == LAYER_STAGE_INPUT) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                norm_x_row(at(x, r * H, t), t, L->input_norm, L->norm_offset, L->eps, H, scratch + r * H);
                copy_as(scratch + r * H, F32, at(out, r * H, t), t, H);
            }
        } else if (stage == LAYER_STAGE_ATTEND) {
            float *qkv = scratch, *attn = scratch + rows * qkv_width;
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++)
                copy_as(at(in, r * qkv_width, t), t, qkv + r * qkv_width, F32, qkv_width);
            attention_between(L, c, d, cos, sin, qkv, attn, &failed);
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++)
                copy_as(attn + r * q_width, F32, at(out, r * q_width, t), t, q_width);
        } else if (stage == LAYER_STAGE_MID) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                float *sub = scratch + r * 2 * H, *h = sub + H;
                copy_as(at(in, r * H, t), t, sub, F32, H);
                residual_then_norm(L, at(x, r * H, t), sub, h);
                copy_as(h, F32, at(out, r * H, t), t, H);
            }
        } else if (stage == LAYER_STAGE_ACT) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                const void *g = at(in, r * 2 * inter, t), *u = at(g, inter, t);
                void *o = at(out, r * inter, t);
                int64_t j = 0;
                for (; j + LANES <= inter; j += LANES)
                    store_as(o, j, activation(load_as(g, j, t), (int)L->activation) * load_as(u, j, t), t);
                for (; j < inter; j++)
                    put_as(o, j, activation1(get_as(g, j, t), (int)L->activation) * get_as(u, j, t), t);
            }
        } else {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < rows; r++) {
                float *sub = scratch + r * 2 * H;
                copy_as(at(in, r * H, t), t, sub, F32, H);
                add_residual(at(x, r * H, t), t, sub, L->post_feedforward_norm, L->norm_offset, L->eps, H);
            }
        }
    }
    free(scratch);
    return failed ? -1 : 0;
}

/* ---- the greedy pick over a step's logits.
 * values[r], indices[r] = the largest element of row r of x [rows, cols]
 * (storage type `dtype`, float32 or bfloat16: a bfloat16 model's logits
 * are read as the LM head wrote them, not widened to float32 first; rows
 * `stride` elements apart) and the first column holding it, as
 * torch's max over the last dimension gives them; a row holding a NaN
 * gets a NaN value (its index is then meaningless). A 262,144-word
 * vocabulary makes this a pass over 16 MB at batch 16, which torch's max
 * (values and indices) reads at about 8 GB/s on one core at a time; here
 * both cores read at memory's rate. Rows are cut into spans of
 * MAX_SPAN columns, each span's best found by one thread, the spans of a
 * row then joined in order (so the first column wins a tie). */
#define MAX_SPAN (1 << 14)

/* The best (value, first column) of x[0, n) and whether it holds a NaN. */
INLINE void span_max(const void *x, int64_t n, float *value, int64_t *index, int *nan, int t)
{
    vec best = splat(-INFINITY);
    ivec at_best = {0}, column = {0}, unordered = {0};
    for (int i = 0; i < LANES; i++)
        column[i] = i;
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES) {
        const vec v = load_as(x, d, t);
        const ivec greater = v > best; /* strictly: a lane keeps its first column of a tie */
        unordered |= v != v;
        best = select(greater, v, best);
        at_best = (greater & column) | (~greater & at_best);
        column += LANES;
    }
    float b = -INFINITY;
    int64_t i = -1;
    int found_nan = 0;
    for (int l = 0; l < LANES; l++) {
        found_nan |= unordered[l] != 0;
        if (d > 0 && (best[l] > b || (best[l] == b && at_best[l] < i))) {
            b = best[l];
            i = at_best[l];
        }
    }
    for (; d < n; d++) {
        const float v = get_as(x, d, t);
        found_nan |= v != v;
        if (v > b || i < 0) {
            b = v;
            i = d;
        }
    }
    *value = b, *index = i < 0 ? 0 : i, *nan = found_nan;
}

/* Returns 0, -1 where memory for the spans' results could not be had, -2
 * for a dtype other than float32 and bfloat16. */
int row_max(const void *x, int64_t rows, int64_t cols, int64_t stride, float *values, int64_t *indices, int threads,
            int dtype)
{
    if (dtype != F32 && dtype != BF16)
        return -2;
    const int64_t spans = cols <= 0 ? 1 : (cols + MAX_SPAN - 1) / MAX_SPAN;
    float *best = malloc((sizeof(float) + sizeof(int64_t) + sizeof(int)) * (size_t)(rows * spans));
    if (best == NULL)
        return -1;
    int64_t *where = (int64_t *)(best + rows * spans);
    int *nan = (int *)(where + rows * spans);
#pragma omp parallel for schedule(static) num_threads(threads) if (rows * cols >= PARALLEL_WORK)
    for (int64_t t = 0; t < rows * spans; t++) {
        const int64_t r = t / spans, s0 = t % spans * MAX_SPAN, n = cols - s0 < MAX_SPAN ? cols - s0 : MAX_SPAN;
        const void *span = at(x, r * stride + s0, dtype);
        if (dtype == F32)
            span_max(span, n, best + t, where + t, nan + t, F32);
        else
            span_max(span, n, best + t, where + t, nan + t, BF16);
        where[t] += s0;
    }
    for (int64_t r = 0; r < rows; r++) {
        float b = best[r * spans];
        int64_t i = where[r * spans];
        int any_nan = nan[r * spans];
        for (int64_t s = 1; s < spans; s++) {
            any_nan |= nan[r * spans + s];
            if (best[r * spans + s] > b) {
                b = best[r * spans + s];
                i = where[r * spans + s];
            }
        }
        values[r] = any_nan ? NAN : b;
        indices[r] = i;
    }
    free(best);
    return 0;
}

/* The gated delta rule (layers/gated_delta_ops.py) token by token, for
 * `requests` runs of tokens side by side, each from its float32 state,
 * updated in place. Per value head h (of key head h / (value_heads /
 * key_heads)) and token t: S = exp(g) S; u = beta (v - S^T k);
 * S += k u^T; o = S^T q, with S [key_dim, value_dim] row-major. Two passes
 * over S a token: the decay with the read of S^T k, then the write with
 * the read of S^T q. Sequential, so a run cut anywhere leaves the same
 * states, to the bit, as one pass.
 *
 * q, k [requests, length, key_heads, key_dim]; v [requests, length,
 * value_heads, value_dim]; g, beta [requests, length, value_heads]; all
 * float32, contiguous. Request r's state is at states + rows[r] *
 * row_stride: [value_heads, key_dim, value_dim]. out [requests, length,
 * value_heads, value_dim]: nothing is written past a request's length.
 * Returns 0, or -1 where value_dim is over 1,024. */
int gated_delta(const float *q, const float *k, const float *v, const float *g, const float *beta,
                const int64_t *lengths, int64_t requests, int64_t length, int64_t key_heads, int64_t value_heads,
                int64_t key_dim, int64_t value_dim, float *states, const int64_t *rows, int64_t row_stride,
                float *out, int threads)
{
    if (value_dim > 1024)
        return -1;
    const int64_t per_key = value_heads / key_heads, K = key_dim, V = value_dim;
    const int64_t work = requests * value_heads * length * K * V;
#pragma omp parallel for schedule(static) num_threads(threads) if (work > PARALLEL_WORK)
    for (int64_t rh = 0; rh < requests * value_heads; rh++) {
        const int64_t r = rh / value_heads, h = rh % value_heads, kh = h / per_key;
        float *S = states + rows[r] * row_stride + h * K * V;
        float kv[1024], u[1024];
        for (int64_t t = 0; t < lengths[r]; t++) {
            const int64_t at = r * length + t;
            float *o = out + (at * value_heads + h) * V;
            const float *qt = q + (at * key_heads + kh) * K, *kt = k + (at * key_heads + kh) * K;
            const float *vt = v + (at * value_heads + h) * V;
            const float decay = expf(g[at * value_heads + h]), b = beta[at * value_heads + h];
            for (int64_t j = 0; j < V; j++)
                kv[j] = 0.0f;
            for (int64_t i = 0; i < K; i++) {
                float *row = S + i * V;
                const float ki = kt[i];
                for (int64_t j = 0; j < V; j++) {
                    row[j] *= decay;
                    kv[j] += ki * row[j];
                }
            }
            for (int64_t j = 0; j < V; j++) {
                u[j] = b * (vt[j] - kv[j]);
                o[j] = 0.0f;
            }
            for (int64_t i = 0; i < K; i++) {
                float *row = S + i * V;
                const float ki = kt[i], qi = qt[i];
                for (int64_t j = 0; j < V; j++) {
                    row[j] += ki * u[j];
                    o[j] += qi * row[j];
                }
            }
        }
    }
    return 0;
}

/* Mamba-2's state update (layers/ssd_ops.py) token by token, for
 * `requests` runs of tokens side by side, each from its float32 state,
 * updated in place. Per head h (of group h / (heads / groups)) and token t:
 * S = exp(dt A_h) S + dt x B^T; y = S C + D_h x, with S [head_dim,
 * state_size] row-major: one pass over S a token. Sequential, so a run cut
 * anywhere leaves the same states, to the bit, as one pass.
 *
 * x [requests, length, heads, head_dim]; dt [requests, length, heads];
 * A, D [heads]; B, C [requests, length, groups, state_size]; all float32,
 * contiguous. Request r's state is at states + rows[r] * row_stride:
 * [heads, head_dim, state_size]. y [requests, length, heads, head_dim]:
 * nothing is written past a request's length. */
void ssd(const float *x, const float *dt, const float *A, const float *B, const float *C, const float *D,
         const int64_t *lengths, int64_t requests, int64_t length, int64_t heads, int64_t head_dim, int64_t groups,
         int64_t state_size, float *states, const int64_t *rows, int64_t row_stride, float *y, int threads)
{
    const int64_t per_group = heads / groups, P = head_dim, N = state_size;
    const int64_t work = requests * heads * length * P * N;
#pragma omp parallel for schedule(static) num_threads(threads) if (work > PARALLEL_WORK)
    for (int64_t rh = 0; rh < requests * heads; rh++) {
        const int64_t r = rh / heads, h = rh % heads, g = h / per_group;
        float *S = states + rows[r] * row_stride + h * P * N;
        for (int64_t t = 0; t < lengths[r]; t++) {
            const int64_t at = r * length + t;
            float *out = y + (at * heads + h) * P;
            const float *xt = x + (at * heads + h) * P;
            const float *Bt = B + (at * groups + g) * N, *Ct = C + (at * groups + g) * N;
            const float step = dt[at * heads + h], decay = expf(step * A[h]);
            for (int64_t p = 0; p < P; p++) {
                float *row = S + p * N;
                const float input = step * xt[p];
                float acc = 0.0f;
                for (int64_t n = 0; n < N; n++) {
                    row[n] = decay * row[n] + input * Bt[n];
                    acc += row[n] * Ct[n];
                }
                out[p] = acc + D[h] * xt[p];
            }
        }
    }
}

/* An all-reduce (sum) among the `world` processes of one host that map
 * the same segment (engine/tensor_parallel.py makes it): each rank copies
 * its part into its slot, every rank sums the slots in rank order (so all
 * get the same bits), float32 sums (bfloat16 rounded once). Parts of at
 * most `slot_bytes` each, one after the other.
 *
 * The segment: per rank an `arrived` and a `left` counter (64 bytes
 * apart), an abort word after them, then the slots from byte 4096. A part
 * numbered `seq` (the caller's count of parts so far, the same on every
 * rank, from 1) may be written once every rank has left part seq - 1, and
 * read once every rank has arrived with part seq. Returns the parts used,
 * or -1 where the abort word was set, -2 past `timeout_s` of waiting. */
#define SHM_LINE 64
#define SHM_SLOTS 4096

static int shm_wait(const char *segment, int64_t first_line, int world, int64_t value, double deadline)
{
    const int64_t *abort_flag = (const int64_t *)(segment + 2 * world * SHM_LINE);
    for (int64_t spins = 0;; spins++) {
        int ready = 1;
        for (int i = 0; i < world && ready; i++)
            ready = __atomic_load_n((const int64_t *)(segment + (first_line + i) * SHM_LINE), __ATOMIC_ACQUIRE) >= value;
        if (ready)
            return 0;
        if (__atomic_load_n(abort_flag, __ATOMIC_ACQUIRE))
            return -1;
        if (spins % 1024 == 1023) {
            if (omp_get_wtime() > deadline)
                return -2;
            sched_yield(); /* ranks may share cores: let the one we wait for run */
        }
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
    }
}

int host_all_reduce(void *data, int dtype, int64_t n, char *segment, int64_t slot_bytes, int rank, int world,
                    int64_t seq, float timeout_s)
{
    const int64_t size = dtype == BF16 ? 2 : 4, per_part = slot_bytes / size;
    const double deadline = omp_get_wtime() + timeout_s;
    int64_t parts = 0;
    for (int64_t start = 0; start < n; start += per_part, parts++) { /* (nothing to exchange: no part at all) */
        const int64_t count = n - start < per_part ? n - start : per_part, s = seq + parts;
        int status = shm_wait(segment, world, world, s - 1, deadline); /* every rank done with the last part */
        if (status)
            return status;
        memcpy(segment + SHM_SLOTS + rank * slot_bytes, (char *)data + start * size, (size_t)(count * size));
        __atomic_store_n((int64_t *)(segment + rank * SHM_LINE), s, __ATOMIC_RELEASE);
        status = shm_wait(segment, 0, world, s, deadline); /* every rank's part there */
        if (status)
            return status;
        const char *slots = segment + SHM_SLOTS;
        if (dtype == BF16) {
            for (int64_t b = 0; b < count; b += 1024) {
                const int64_t m = count - b < 1024 ? count - b : 1024;
                float acc[1024];
                for (int i = 0; i < world; i++) {
                    const uint16_t *slot = (const uint16_t *)(slots + i * slot_bytes) + b;
                    for (int64_t j = 0; j < m; j++) {
                        const uint32_t bits = (uint32_t)slot[j] << 16;
                        float f;
                        memcpy(&f, &bits, sizeof f);
                        acc[j] = i ? acc[j] + f : f;
                    }
                }
                uint16_t *out = (uint16_t *)data + start + b;
                for (int64_t j = 0; j < m; j++)
                    out[j] = (uint16_t)(bf16_bits1(acc[j]) >> 16);
            }
        } else {
            float *out = (float *)data + start;
            memcpy(out, slots, (size_t)(count * size));
            for (int i = 1; i < world; i++) {
                const float *slot = (const float *)(slots + i * slot_bytes);
                for (int64_t j = 0; j < count; j++)
                    out[j] += slot[j];
            }
        }
        __atomic_store_n((int64_t *)(segment + (world + rank) * SHM_LINE), s, __ATOMIC_RELEASE);
    }
    return (int)parts;
}

/* The sizes of the structs above, in the order they are declared, for the
 * loader to check against its own (library.py). */
void struct_sizes(int64_t *out)
{
    out[0] = (int64_t)sizeof(paged_cache);
    out[1] = (int64_t)sizeof(decode_rows);
    out[2] = (int64_t)sizeof(prefill_rows);
    out[3] = (int64_t)sizeof(decoder_layer);
}
