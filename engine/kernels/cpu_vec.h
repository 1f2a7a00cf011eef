// 16-lane fp32 vectors for the CPU kernels (GCC's vector extension: one AVX-512 register, two AVX2 ones, as the
// build machine has), and the exponential the softmax and the activations share.
#pragma once

#include <cstdint>
#include <cstring>

using vec = float __attribute__((vector_size(64)));  // 16 lanes: one AVX-512 register, two AVX2 ones
using ivec = int32_t __attribute__((vector_size(64)));

inline vec splat(float x) { return vec{} + x; }

inline vec load(const float* p) {
  vec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vec v) { std::memcpy(p, &v, sizeof v); }

// the lanes' sum, from lane 0 up (a fixed order: the same bits wherever it is called)
inline float lane_sum(vec x) {
  float t = 0.0f;
  for (int i = 0; i < 16; ++i) t += x[i];
  return t;
}

inline float lane_max(vec x) {
  float m = x[0];
  for (int i = 1; i < 16; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// e^x, 0 below -87 (and at -inf: a masked key), e^88 above 88: Cody-Waite range reduction and Cephes' degree-6
// polynomial, about 1 ulp; e^0 is exactly 1.
inline vec exp16(vec x) {
  const vec floor = splat(-87.0f), ceil = splat(88.0f);
  vec c = x < floor ? floor : x;
  c = c > ceil ? ceil : c;
  const vec k = (c * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  vec r = c - k * 0.693359375f;
  r = r + k * 2.12194440e-4f;
  vec p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const ivec bits = (__builtin_convertvector(k, ivec) + 127) << 23;
  vec scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < floor ? splat(0.0f) : p * scale;
}
