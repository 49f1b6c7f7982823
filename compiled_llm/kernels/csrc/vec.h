// Portable SIMD vectors for the CPU kernels: GCC vector types of 8 or 16 floats.
//
// Written once, the kernels compile to AVX2 (8-float vectors in ymm registers), AVX-512 (16 in
// zmm) or any other target; on a CPU without 512-bit registers a 16-float vector runs as two
// 8-float halves, so both widths are built and tested on every machine. The width a kernel uses
// by default is the target's own (`kNativeLanes`, from -march=native: the CPU's flags).

#pragma once

#include <cstdint>

namespace compiled_llm_cpu {

typedef float v8 __attribute__((vector_size(32)));
typedef float v16 __attribute__((vector_size(64)));

#if defined(__AVX512F__)
constexpr int kNativeLanes = 16;
#else
constexpr int kNativeLanes = 8;
#endif

template <typename V>
constexpr int lanes() {
  return sizeof(V) / sizeof(float);
}

// Unaligned loads and stores (a template argument loses a typedef's alignment attribute, so a
// cast pointer would be assumed aligned to the vector's size).
template <typename V>
inline V load(const float* p) {
  V v;
  __builtin_memcpy(&v, p, sizeof(V));
  return v;
}

template <typename V>
inline void store(float* p, V v) {
  __builtin_memcpy(p, &v, sizeof(V));
}

// One float in every lane, written so that GCC emits a broadcast (a lane-by-lane loop or `V{} + x`
// becomes inserts or an add).
template <typename V>
inline V splat(float x);

template <>
inline v8 splat<v8>(float x) {
  return v8{x, x, x, x, x, x, x, x};
}

template <>
inline v16 splat<v16>(float x) {
  return v16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

template <typename V>
inline float reduce_max(V v) {
  float m = v[0];
  for (int i = 1; i < lanes<V>(); i++) m = v[i] > m ? v[i] : m;
  return m;
}

template <typename V>
inline float reduce_sum(V v) {
  float s = 0.f;
  for (int i = 0; i < lanes<V>(); i++) s += v[i];
  return s;
}

// exp(x) for x <= 0 (softmax arguments; below -87 gives 0): split off the power of two, a degree-6
// polynomial on the rest; relative error ~1e-7.
template <typename V>
inline V exp_nonpositive(V x) {
  typedef int32_t I __attribute__((vector_size(sizeof(V))));
  x = x < splat<V>(-87.f) ? splat<V>(-87.f) : x;
  const V magic = splat<V>(12582912.f);  // 1.5 * 2^23: adding it rounds to an integer
  const V t = x * splat<V>(1.44269504088896341f) + magic;
  const V k = t - magic;
  const V r = x - k * splat<V>(0.693147180559945309f);
  V p = splat<V>(1.38888889e-3f);
  p = p * r + splat<V>(8.33333333e-3f);
  p = p * r + splat<V>(4.16666666e-2f);
  p = p * r + splat<V>(1.66666666e-1f);
  p = p * r + splat<V>(0.5f);
  p = p * r + splat<V>(1.f);
  p = p * r + splat<V>(1.f);
  I bits;
  __builtin_memcpy(&bits, &t, sizeof(V));
  I magic_bits;
  __builtin_memcpy(&magic_bits, &magic, sizeof(V));
  const I scale_bits = (bits - magic_bits + 127) << 23;
  V scale;
  __builtin_memcpy(&scale, &scale_bits, sizeof(V));
  return p * scale;
}

}  // namespace compiled_llm_cpu
