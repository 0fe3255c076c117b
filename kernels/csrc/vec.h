// Vec16: sixteen fp32 lanes, the one vector type labkit's CPU kernels are written in.
//
// The kernels (paged_decode_attention.cpp, fused_ops.cpp) are written once, over this type;
// this header implements it three times, and the build chooses one: kernels/cpu_extension.py
// asks the CPU what it runs and passes -DLABKIT_VEC_AVX512, -DLABKIT_VEC_AVX2 or
// -DLABKIT_VEC_PORTABLE with the matching compiler flags (-march=native for the CPU's best,
// -mavx2 -mfma for a forced AVX2 build). Without one of those, the compiler's own target
// macros choose. Asking explicitly matters: a "portable" build compiled with -march=native
// (a CPU whose flags labkit cannot read) must still be the portable one it says it is.
//
//   avx512    one 512-bit register   (__AVX512F__: Intel Skylake-SP and later, AMD Zen 4/5)
//   avx2      two 256-bit registers  (__AVX2__ and __FMA__: Intel Haswell and later, AMD Zen 1-3)
//   portable  an array of 16 floats and plain loops, which the compiler vectorizes for whatever
//             it targets (SSE2 on any x86-64, NEON on ARM). It is also the definition of every
//             operation: the other two must compute the same thing.
//
// Sixteen lanes whatever the machine, as vLLM's FP32Vec16 (csrc/cpu/cpu_types_x86.hpp): the
// kernels' shapes (16 tokens of scores per vector, head sizes that are multiples of 16) do
// not change with the ISA, and 16 fp32 numbers are one 64-byte cache line.
//
// bf16 numbers are passed as their 16 bits (uint16_t): a bf16 number is the high half of the
// fp32 number with the same bits, so widening is a shift, and narrowing rounds to nearest even.
//
// A quantized KV cache (kernels/kv_quant.py) holds one byte per number, read here only (the
// cache write quantizes in torch or Triton): int8_t, widened exactly; and fp8_e4m3 (a byte:
// sign, 4 exponent bits with bias 7, 3 mantissa bits; torch.float8_e4m3fn), decoded field by
// field (fp8_to_fp32): a normal byte's exponent and mantissa move into an fp32 number's fields,
// exponent + 120 (127 - 7); a subnormal one (exponent 0) is mantissa * 2^-9, computed as a
// small whole number times 2^-9. Every fp8 value is exact in fp32, so all three versions give
// the same bits, and no fp32 subnormal appears on the way (those a CPU may flush to zero).
// The byte 0x7f (NaN in e4m3fn) reads as 480: the cache write never stores it (|x| <= 448).
//
// exp: the AVX-512 and AVX2 versions are one algorithm, exp(x) = 2^n exp(r) with n = round(x /
// ln 2) and |r| <= ln(2)/2, exp(r) by Cephes' degree-6 polynomial (expf.c). Against exp in
// double precision: within 2 ulp for x in [-87, 88] (tests/test_cpu_vec.py measures it on a
// dense grid, every build). Softmax and SiLU never need more: their arguments are <= 0 and
// the smallest weight that matters is exp(-88) ~ 6e-39 against the largest, 1. Outside that
// range: below -87.3 the result is 0 (AVX-512 goes through the subnormals first), and above
// 88.0 every version saturates at exp(88) ~ 1.7e38: never infinity. The kernels are compiled
// with -ffast-math, which lets the compiler assume there are no infinities: SiLU's
// g / (1 + exp(-g)) at g = -100 gave NaN on AVX-512 (the division done as a reciprocal and a
// Newton step, inf * 0) until exp was clamped; a finite exp(-g) gives the quotient ~0 that
// silu(-100) is. The portable version is the AVX2 one, lane by lane in plain C++, but for its
// reduction x - n ln 2, done in double (see exp_lane).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if !defined(LABKIT_VEC_AVX512) && !defined(LABKIT_VEC_AVX2) && !defined(LABKIT_VEC_PORTABLE)
#if defined(__AVX512F__)
#define LABKIT_VEC_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define LABKIT_VEC_AVX2
#else
#define LABKIT_VEC_PORTABLE
#endif
#endif
#if defined(LABKIT_VEC_AVX512) && !defined(__AVX512F__)
#error "LABKIT_VEC_AVX512 needs AVX-512F enabled in the compiler (-march=native on an AVX-512 CPU)"
#endif
#if defined(LABKIT_VEC_AVX2) && !(defined(__AVX2__) && defined(__FMA__))
#error "LABKIT_VEC_AVX2 needs AVX2 and FMA enabled in the compiler (-mavx2 -mfma)"
#endif

#if defined(LABKIT_VEC_AVX512) || defined(LABKIT_VEC_AVX2)
#include <immintrin.h>
#endif

#define VEC_INLINE inline __attribute__((always_inline))

namespace vec {

// One fp8 e4m3 number, its byte as it is stored; a type of its own so that a byte of fp8 is
// never mistaken for a byte of int8 (both are one byte; they mean different numbers).
struct fp8_e4m3 {
  uint8_t bits;
};

// ---- scalars: bf16 <-> fp32, and the quantized cache's bytes -> fp32 -------------------------

VEC_INLINE float to_float(float x) { return x; }
VEC_INLINE float to_float(uint16_t bits) {  // bf16 -> fp32: the 16 bits become the high half
  const uint32_t u = uint32_t(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

VEC_INLINE float to_float(int8_t x) { return float(x); }
VEC_INLINE float to_float(fp8_e4m3 x) {  // the definition of fp8_to_fp32 below
  const uint32_t em = x.bits & 0x7fu;  // exponent and mantissa, without the sign
  float magnitude;
  if (em < 8) {  // exponent 0: subnormal, mantissa * 2^-9
    magnitude = float(em) * (1.f / 512.f);
  } else {
    const uint32_t u = (em << 20) + (120u << 23);  // the fields in place, exponent rebiased
    std::memcpy(&magnitude, &u, sizeof magnitude);
  }
  return (x.bits & 0x80u) ? -magnitude : magnitude;
}

VEC_INLINE uint16_t to_bf16(float x) {  // fp32 -> bf16, rounded to nearest even
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u += 0x7fff + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}

// Constants of exp (Cephes' expf.c): ln 2 in two parts, so that x - n ln 2 is exact enough,
// and the polynomial for exp(r) - 1 - r, in Horner form.
constexpr float kExpMax = 88.0f;  // exp(88) ~ 1.65e38 < FLT_MAX ~ 3.4e38: where every version saturates
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

#if defined(LABKIT_VEC_AVX512)
// ---- AVX-512: one zmm register --------------------------------------------------------------

constexpr const char* kIsa = "avx512";

namespace detail {
// fp32 bits rounded to the nearest bf16 (ties to even): the high 16 bits are then the bf16 number
VEC_INLINE __m512i bf16_rounded(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
}
// 16 fp8 e4m3 bytes, one per 32-bit lane -> fp32 (to_float(fp8_e4m3), lane by lane)
VEC_INLINE __m512 fp8_to_fp32(__m512i b) {
  const __m512i em = _mm512_and_si512(b, _mm512_set1_epi32(0x7f));
  const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(em, 20), _mm512_set1_epi32(120 << 23)));
  const __m512 subnormal = _mm512_mul_ps(_mm512_cvtepi32_ps(em), _mm512_set1_ps(1.f / 512.f));
  const __m512 magnitude = _mm512_mask_blend_ps(_mm512_cmplt_epi32_mask(em, _mm512_set1_epi32(8)), normal, subnormal);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(magnitude), sign));
}
}  // namespace detail

struct Vec16 {
  static constexpr int size = 16;
  __m512 r;

  static VEC_INLINE Vec16 zero() { return {_mm512_setzero_ps()}; }
  static VEC_INLINE Vec16 all(float x) { return {_mm512_set1_ps(x)}; }
  static VEC_INLINE Vec16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static VEC_INLINE Vec16 load(const uint16_t* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
  }
  static VEC_INLINE Vec16 load(const int8_t* p) {
    return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  static VEC_INLINE Vec16 load(const fp8_e4m3* p) {
    return {detail::fp8_to_fp32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
  }
  VEC_INLINE void store(float* p) const { _mm512_storeu_ps(p, r); }
  VEC_INLINE void store(uint16_t* p) const {
    const __m512i bits = _mm512_srli_epi32(detail::bf16_rounded(r), 16);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
  }
  VEC_INLINE float reduce_sum() const { return _mm512_reduce_add_ps(r); }
  VEC_INLINE float reduce_max() const { return _mm512_reduce_max_ps(r); }
  // The first n lanes (0 <= n <= 16) of this vector, the others `fill`.
  VEC_INLINE Vec16 first(int n, float fill = 0.f) const {
    return {_mm512_mask_blend_ps(__mmask16((1u << n) - 1u), _mm512_set1_ps(fill), r)};
  }
};

VEC_INLINE Vec16 operator+(Vec16 a, Vec16 b) { return {_mm512_add_ps(a.r, b.r)}; }
VEC_INLINE Vec16 operator-(Vec16 a, Vec16 b) { return {_mm512_sub_ps(a.r, b.r)}; }
VEC_INLINE Vec16 operator*(Vec16 a, Vec16 b) { return {_mm512_mul_ps(a.r, b.r)}; }
VEC_INLINE Vec16 operator/(Vec16 a, Vec16 b) { return {_mm512_div_ps(a.r, b.r)}; }
VEC_INLINE Vec16 fma(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.r, b.r, c.r)}; }  // a * b + c
VEC_INLINE Vec16 max(Vec16 a, Vec16 b) { return {_mm512_max_ps(a.r, b.r)}; }
// Each lane rounded to the nearest bf16 number (ties to even), kept as fp32: store then load, in registers.
VEC_INLINE Vec16 round_to_bf16(Vec16 v) {
  return {_mm512_castsi512_ps(_mm512_and_si512(detail::bf16_rounded(v.r), _mm512_set1_epi32(int(0xffff0000u))))};
}

VEC_INLINE Vec16 exp(Vec16 v) {
  // scalef underflows to 0 cleanly below -104; above kExpMax the result would round to infinity
  const __m512 x = _mm512_min_ps(_mm512_max_ps(v.r, _mm512_set1_ps(-104.f)), _mm512_set1_ps(kExpMax));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return {_mm512_scalef_ps(p, n)};  // p * 2^n
}

// Lane i of the result is v[i].reduce_sum(): sixteen horizontal sums as one transpose-and-add,
// four rounds of pairwise shuffles (45 instructions, not ~130).
VEC_INLINE Vec16 sum_lanes(const Vec16 (&v)[16]) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] for a = v[2i], b = v[2i+1]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i].r, v[2 * i + 1].r),
                         _mm512_unpackhi_ps(v[2 * i].r, v[2 * i + 1].r));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sums of v[4i .. 4i+3]
    const __m512d a = _mm512_castps_pd(t[2 * i]), b = _mm512_castps_pd(t[2 * i + 1]);
    u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                        _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)))};
}

#elif defined(LABKIT_VEC_AVX2)
// ---- AVX2 + FMA: two ymm registers, lanes 0-7 in lo and 8-15 in hi --------------------------

constexpr const char* kIsa = "avx2";

namespace detail {
VEC_INLINE __m256 widen_bf16(__m128i bits) {  // 8 bf16 -> 8 fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
VEC_INLINE __m128i load8_bytes(const void* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
VEC_INLINE __m256 widen_int8(__m128i bytes) {  // the low 8 int8 -> 8 fp32
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}
VEC_INLINE __m256 widen_fp8(__m128i bytes) {  // the low 8 fp8 e4m3 -> 8 fp32 (to_float(fp8_e4m3), lane by lane)
  const __m256i b = _mm256_cvtepu8_epi32(bytes);
  const __m256i em = _mm256_and_si256(b, _mm256_set1_epi32(0x7f));
  const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 subnormal = _mm256_mul_ps(_mm256_cvtepi32_ps(em), _mm256_set1_ps(1.f / 512.f));
  const __m256 is_subnormal = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(8), em));
  const __m256 magnitude = _mm256_blendv_ps(normal, subnormal, is_subnormal);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(magnitude), sign));
}
// fp32 bits rounded to the nearest bf16 (ties to even): the high 16 bits are then the bf16 number
VEC_INLINE __m256i bf16_rounded(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
}
VEC_INLINE __m256i bf16_bits(__m256 x) {  // 8 fp32 -> their bf16 bits (rounded to nearest even), in 32-bit lanes
  return _mm256_srli_epi32(bf16_rounded(x), 16);
}
VEC_INLINE __m256 round_to_bf16(__m256 x) {
  return _mm256_castsi256_ps(_mm256_and_si256(bf16_rounded(x), _mm256_set1_epi32(int(0xffff0000u))));
}
VEC_INLINE float reduce(__m128 x, bool sum) {  // the sum or the maximum of 4 lanes
  __m128 y = sum ? _mm_add_ps(x, _mm_movehl_ps(x, x)) : _mm_max_ps(x, _mm_movehl_ps(x, x));
  y = sum ? _mm_add_ss(y, _mm_movehdup_ps(y)) : _mm_max_ss(y, _mm_movehdup_ps(y));
  return _mm_cvtss_f32(y);
}
VEC_INLINE __m256 exp8(__m256 v) {
  // 2^n is built from its exponent bits, so n must stay in [-126, 127]: x is clamped to
  // [ln 2^-126, 88.0] (e^88 ~ 1.7e38 < FLT_MAX) and lanes below the clamp become 0.
  const __m256 lo = _mm256_set1_ps(-87.33654475f);
  const __m256 x = _mm256_min_ps(_mm256_max_ps(v, lo), _mm256_set1_ps(kExpMax));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpPoly[i]));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(_mm256_cmp_ps(v, lo, _CMP_LT_OQ), _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}
// Lane i of the result is the sum of the 8 lanes of v[i], for 8 vectors: the AVX-512 version's
// transpose-and-add, within 128-bit lanes, then one exchange of halves.
VEC_INLINE __m256 sum_lanes8(const __m256* v) {
  __m256 t[4], u[2];
  for (int i = 0; i < 4; ++i)
    t[i] = _mm256_add_ps(_mm256_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm256_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 2; ++i) {
    const __m256d a = _mm256_castps_pd(t[2 * i]), b = _mm256_castps_pd(t[2 * i + 1]);
    u[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(a, b)), _mm256_castpd_ps(_mm256_unpackhi_pd(a, b)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(u[0], u[1], 0x20), _mm256_permute2f128_ps(u[0], u[1], 0x31));
}
}  // namespace detail

struct Vec16 {
  static constexpr int size = 16;
  __m256 lo, hi;

  static VEC_INLINE Vec16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static VEC_INLINE Vec16 all(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static VEC_INLINE Vec16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static VEC_INLINE Vec16 load(const uint16_t* p) {
    return {detail::widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            detail::widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  static VEC_INLINE Vec16 load(const int8_t* p) {
    return {detail::widen_int8(detail::load8_bytes(p)), detail::widen_int8(detail::load8_bytes(p + 8))};
  }
  static VEC_INLINE Vec16 load(const fp8_e4m3* p) {
    return {detail::widen_fp8(detail::load8_bytes(p)), detail::widen_fp8(detail::load8_bytes(p + 8))};
  }
  VEC_INLINE void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
  VEC_INLINE void store(uint16_t* p) const {
    // packus interleaves the 128-bit halves of its operands; the permute puts them back in order
    const __m256i packed = _mm256_packus_epi32(detail::bf16_bits(lo), detail::bf16_bits(hi));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(packed, _MM_SHUFFLE(3, 1, 2, 0)));
  }
  VEC_INLINE float reduce_sum() const {
    const __m256 s = _mm256_add_ps(lo, hi);
    return detail::reduce(_mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)), true);
  }
  VEC_INLINE float reduce_max() const {
    const __m256 s = _mm256_max_ps(lo, hi);
    return detail::reduce(_mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)), false);
  }
  VEC_INLINE Vec16 first(int n, float fill = 0.f) const {
    const __m256i k = _mm256_set1_epi32(n);
    const __m256 keep_lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(k, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
    const __m256 keep_hi = _mm256_castsi256_ps(_mm256_cmpgt_epi32(k, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)));
    const __m256 f = _mm256_set1_ps(fill);
    return {_mm256_blendv_ps(f, lo, keep_lo), _mm256_blendv_ps(f, hi, keep_hi)};
  }
};

VEC_INLINE Vec16 operator+(Vec16 a, Vec16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
VEC_INLINE Vec16 operator-(Vec16 a, Vec16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
VEC_INLINE Vec16 operator*(Vec16 a, Vec16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
VEC_INLINE Vec16 operator/(Vec16 a, Vec16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
VEC_INLINE Vec16 fma(Vec16 a, Vec16 b, Vec16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
VEC_INLINE Vec16 max(Vec16 a, Vec16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
VEC_INLINE Vec16 round_to_bf16(Vec16 v) { return {detail::round_to_bf16(v.lo), detail::round_to_bf16(v.hi)}; }
VEC_INLINE Vec16 exp(Vec16 v) { return {detail::exp8(v.lo), detail::exp8(v.hi)}; }

VEC_INLINE Vec16 sum_lanes(const Vec16 (&v)[16]) {
  __m256 halves[16];  // each vector's 16 lanes folded to 8, then eight sums at a time
  for (int i = 0; i < 16; ++i) halves[i] = _mm256_add_ps(v[i].lo, v[i].hi);
  return {detail::sum_lanes8(halves), detail::sum_lanes8(halves + 8)};
}

#else
// ---- portable: 16 floats and plain loops (the definition of every operation) ----------------

constexpr const char* kIsa = "portable";

struct Vec16 {
  static constexpr int size = 16;
  float x[16];

  static VEC_INLINE Vec16 all(float a) {
    Vec16 v;
    for (int i = 0; i < 16; ++i) v.x[i] = a;
    return v;
  }
  static VEC_INLINE Vec16 zero() { return all(0.f); }
  template <typename T>
  static VEC_INLINE Vec16 load(const T* p) {
    Vec16 v;
    for (int i = 0; i < 16; ++i) v.x[i] = to_float(p[i]);
    return v;
  }
  VEC_INLINE void store(float* p) const {
    for (int i = 0; i < 16; ++i) p[i] = x[i];
  }
  VEC_INLINE void store(uint16_t* p) const {
    for (int i = 0; i < 16; ++i) p[i] = to_bf16(x[i]);
  }
  VEC_INLINE float reduce_sum() const {
    float s = 0.f;
    for (int i = 0; i < 16; ++i) s += x[i];
    return s;
  }
  VEC_INLINE float reduce_max() const {
    float m = x[0];
    for (int i = 1; i < 16; ++i) m = std::max(m, x[i]);
    return m;
  }
  VEC_INLINE Vec16 first(int n, float fill = 0.f) const {
    Vec16 v;
    for (int i = 0; i < 16; ++i) v.x[i] = i < n ? x[i] : fill;
    return v;
  }
};

template <typename F>
VEC_INLINE Vec16 lanewise(F f) {
  Vec16 v;
  for (int i = 0; i < 16; ++i) v.x[i] = f(i);
  return v;
}
VEC_INLINE Vec16 operator+(Vec16 a, Vec16 b) { return lanewise([&](int i) { return a.x[i] + b.x[i]; }); }
VEC_INLINE Vec16 operator-(Vec16 a, Vec16 b) { return lanewise([&](int i) { return a.x[i] - b.x[i]; }); }
VEC_INLINE Vec16 operator*(Vec16 a, Vec16 b) { return lanewise([&](int i) { return a.x[i] * b.x[i]; }); }
VEC_INLINE Vec16 operator/(Vec16 a, Vec16 b) { return lanewise([&](int i) { return a.x[i] / b.x[i]; }); }
VEC_INLINE Vec16 fma(Vec16 a, Vec16 b, Vec16 c) { return lanewise([&](int i) { return a.x[i] * b.x[i] + c.x[i]; }); }
VEC_INLINE Vec16 max(Vec16 a, Vec16 b) { return lanewise([&](int i) { return std::max(a.x[i], b.x[i]); }); }
VEC_INLINE Vec16 round_to_bf16(Vec16 a) { return lanewise([&](int i) { return to_float(to_bf16(a.x[i])); }); }
// exp, lane by lane: the AVX2 version's algorithm, in plain C++ (which the compiler vectorizes).
// Not std::exp: under -ffast-math GCC calls glibc's vector expf there, measured at 2.7 ulp.
VEC_INLINE float exp_lane(float v) {
  constexpr float lo = -87.33654475f;  // ln 2^-126: below, 2^n is no longer a normal number
  const float x = std::min(std::max(v, lo), kExpMax);
  const float n = std::nearbyint(x * kLog2e);
  // r = x - n ln 2 in double, not as the vector versions' two fused steps with ln 2 in two parts:
  // -ffast-math lets the compiler merge (x - n Hi) - n Lo into x - n (Hi + Lo), losing the bits
  // the split is for (measured: 68 ulp). In double, n ln 2 is exact enough at once.
  const float r = float(double(x) - double(n) * 0.693147180559945309);
  float p = kExpPoly[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpPoly[i];
  p = p * (r * r) + (r + 1.f);
  const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return v < lo ? 0.f : p * scale;
}
VEC_INLINE Vec16 exp(Vec16 a) { return lanewise([&](int i) { return exp_lane(a.x[i]); }); }
VEC_INLINE Vec16 sum_lanes(const Vec16 (&v)[16]) { return lanewise([&](int i) { return v[i].reduce_sum(); }); }

#endif

// ---- on top of any of the three ------------------------------------------------------------

// The first n (0 <= n <= 16) elements at p, the other lanes 0: loops over a length that is not
// a multiple of 16 end with one of these instead of a scalar copy of their body.
template <typename T>
VEC_INLINE Vec16 load(const T* p, int n) {
  if (n == 16) return Vec16::load(p);
  T tail[16] = {};
  std::memcpy(tail, p, sizeof(T) * n);
  return Vec16::load(tail);
}

template <typename T>
VEC_INLINE void store(Vec16 v, T* p, int n) {
  if (n == 16) return v.store(p);
  T tail[16];
  v.store(tail);
  std::memcpy(p, tail, sizeof(T) * n);
}

// silu(g) = g * sigmoid(g), computed as g / (1 + exp(-g)): for g << 0 exp(-g) is huge (or
// infinite), and the quotient 0. SwiGLU's activation, wherever it is applied (fused_ops.cpp's
// silu_and_mul, linear.cpp's fused gate/up): one definition, the same bits.
VEC_INLINE Vec16 silu(Vec16 g) { return g / (Vec16::all(1.f) + exp(Vec16::zero() - g)); }

// v as the storage type T holds it: unchanged for fp32, rounded to bf16 for uint16_t.
template <typename T>
VEC_INLINE Vec16 round_to(Vec16 v) {
  if constexpr (sizeof(T) == sizeof(float)) {
    return v;
  } else {
    return round_to_bf16(v);
  }
}

}  // namespace vec
