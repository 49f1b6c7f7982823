// Narrow integers and 16-bit floats loaded into 32-bit lanes, for the GEMMs that convert compressed
// weights in registers (cpu_quant_gemm.cpp: int8, packed nibbles and fp16 scales; cpu_half_gemm.cpp:
// 16-bit floats).
//
// Why intrinsics: GCC 12 lowers __builtin_convertvector from 8- or 16-bit lanes to 32-bit ones
// lane by lane or through halves, several instructions where one vpmovzx/vpmovsx does it (and that
// one reads memory directly). The intrinsics are taken where the target has them (AVX-512F for 16
// lanes, AVX2 for 8, or 16 as two halves), a plain loop elsewhere.

#pragma once

#include <type_traits>

#include <cstdint>

#include "vec.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace compiled_llm_cpu {

typedef int32_t vi8 __attribute__((vector_size(32)));
typedef int32_t vi16 __attribute__((vector_size(64)));

// The int32 vector with V's lanes.
template <typename V>
struct IntsOf;
template <>
struct IntsOf<v8> {
  using type = vi8;
};
template <>
struct IntsOf<v16> {
  using type = vi16;
};
template <typename V>
using ints_of = typename IntsOf<V>::type;

template <typename V, typename T>
inline ints_of<V> widen_portable(const T* p) {
  ints_of<V> r;
  for (int i = 0; i < lanes<V>(); i++) r[i] = p[i];
  return r;
}

#if defined(__AVX2__)
// Glues two 8-lane halves (a 16-lane vector on AVX2).
inline vi16 join(vi8 lo, vi8 hi) {
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
#endif

// lanes<V>() unsigned bytes from p, zero-extended.
template <typename V>
inline ints_of<V> widen_u8(const uint8_t* p) {
#if defined(__AVX2__)
  if constexpr (lanes<V>() == 8) {
    return (vi8)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  } else {
#if defined(__AVX512F__)
    return (vi16)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    return join(widen_u8<v8>(p), widen_u8<v8>(p + 8));
#endif
  }
#else
  return widen_portable<V>(p);
#endif
}

// lanes<V>() signed bytes from p, sign-extended.
template <typename V>
inline ints_of<V> widen_s8(const int8_t* p) {
#if defined(__AVX2__)
  if constexpr (lanes<V>() == 8) {
    return (vi8)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  } else {
#if defined(__AVX512F__)
    return (vi16)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
    return join(widen_s8<v8>(p), widen_s8<v8>(p + 8));
#endif
  }
#else
  return widen_portable<V>(p);
#endif
}

// lanes<V>() unsigned 16-bit values from p, zero-extended.
template <typename V>
inline ints_of<V> widen_u16(const uint16_t* p) {
#if defined(__AVX2__)
  if constexpr (lanes<V>() == 8) {
    return (vi8)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  } else {
#if defined(__AVX512F__)
    return (vi16)_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
    return join(widen_u16<v8>(p), widen_u16<v8>(p + 8));
#endif
  }
#else
  return widen_portable<V>(p);
#endif
}

// 16-bit floats as float32 lanes (the half GEMM's weights, the quantized GEMM's fp16 scales).
struct Bf16 {
  template <typename V>
  static V load(const uint16_t* p) {
    const ints_of<V> bits = widen_u16<V>(p) << 16;
    V v;
    __builtin_memcpy(&v, &bits, sizeof(V));
    return v;
  }
};

// fp16 bits to float32 without a conversion instruction: rebias the exponent of normal numbers,
// carry infinities and NaNs over, and compute subnormals (and zero) as an integer times 2^-24.
template <typename V>
inline V fp16_to_float_portable(const uint16_t* p) {
  const ints_of<V> u = widen_u16<V>(p);
  const ints_of<V> magnitude = u & 0x7fff;
  const ints_of<V> normal = (magnitude << 13) + ((127 - 15) << 23);
  const ints_of<V> special = (magnitude << 13) | 0x7f800000;
  const V subnormal = __builtin_convertvector(magnitude, V) * splat<V>(0x1p-24f);
  ints_of<V> sub_bits;
  __builtin_memcpy(&sub_bits, &subnormal, sizeof(V));
  const ints_of<V> bits = (magnitude >= 0x7c00 ? special : magnitude < 0x400 ? sub_bits : normal) | (u & 0x8000) << 16;
  V v;
  __builtin_memcpy(&v, &bits, sizeof(V));
  return v;
}

struct Fp16 {
  template <typename V>
  static V load(const uint16_t* p);
};

template <>
inline v8 Fp16::load<v8>(const uint16_t* p) {
#if defined(__F16C__)
  return (v8)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return fp16_to_float_portable<v8>(p);
#endif
}

template <>
inline v16 Fp16::load<v16>(const uint16_t* p) {
#if defined(__AVX512F__)
  return (v16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__)
  const v8 lo = load<v8>(p), hi = load<v8>(p + 8);
  return __builtin_shufflevector(lo, hi, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  return fp16_to_float_portable<v16>(p);
#endif
}

// Values stored as float32 or as fp16 (their bits), as a float vector: quantized weights' scales
// and LoRA adapters' matrices are kept in either.
using Fp16Bits = uint16_t;

template <typename V, typename S>
inline V load_widened(const S* p) {
  if constexpr (std::is_same_v<S, float>)
    return load<V>(p);
  else
    return Fp16::load<V>(p);
}

}  // namespace compiled_llm_cpu
