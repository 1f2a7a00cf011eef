// The small ops of a decoder layer on the CPU in fp32, one pass over the data each where torch's composition of them
// takes several (and allocates between): RoPE in place on q and k, the gated activation times up, RMSNorm (and the
// residual's add before it).
//
// Built on first use by engine/kernels/cpu_kernels.py and called through ctypes; threads split the rows (tokens)
// where there are enough of them, each row computed by one thread the same way whatever the split.

#include <cmath>
#include <cstdint>

#include "cpu_vec.h"

namespace {

constexpr int64_t PARALLEL_MIN = 1 << 16;  // elements below which one thread does it all

inline vec silu(vec g) { return g / (1.0f + exp16(-g)); }

// 0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3), as g / (1 + e^-2y): the same value without the
// cancellation of 1 + tanh(y) where tanh(y) nears -1
inline vec gelu_tanh(vec g) {
  const vec y = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  return g / (1.0f + exp16(-2.0f * y));
}

template <bool GELU>
inline vec act(vec g) {
  return GELU ? gelu_tanh(g) : silu(g);
}

template <bool GELU>
void act_rows(const float* x, float* out, int64_t rows, int64_t inter, int64_t x_stride, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * inter >= PARALLEL_MIN)
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = x + r * x_stride;
    const float* u = g + inter;
    float* o = out + r * inter;
    int64_t i = 0;
    for (; i + 16 <= inter; i += 16) store(o + i, act<GELU>(load(g + i)) * load(u + i));
    if (i < inter) {  // the last few, through zero-padded lanes
      const int64_t n = inter - i;
      alignas(64) float gb[16] = {}, ub[16] = {}, ob[16];
      std::memcpy(gb, g + i, n * sizeof(float));
      std::memcpy(ub, u + i, n * sizeof(float));
      store(ob, act<GELU>(load(gb)) * load(ub));
      std::memcpy(o + i, ob, n * sizeof(float));
    }
  }
}

// x / rms(x) * (offset + w) over one row of dim floats, HF's order: the row times 1 / sqrt(mean of squares + eps),
// rounded, then times the weight
inline void norm_row(const float* x, float* out, const float* w, int64_t dim, float eps, float offset) {
  vec acc = {};
  int64_t i = 0;
  for (; i + 16 <= dim; i += 16) {
    const vec v = load(x + i);
    acc += v * v;
  }
  float sum = lane_sum(acc);
  for (; i < dim; ++i) sum += x[i] * x[i];
  const float r = 1.0f / std::sqrt(sum / dim + eps);
  for (i = 0; i < dim; ++i) out[i] = (offset + w[i]) * (x[i] * r);
}

}  // namespace

// out [rows, inter] = act(gate) * up of x [rows, 2 * inter] (gate | up, rows x_stride floats apart); act: 0 silu,
// 1 gelu (tanh approximation).
extern "C" void cpu_act_and_mul(const float* x, float* out, int64_t rows, int64_t inter, int64_t x_stride, int act,
                                int threads) {
  if (act) act_rows<true>(x, out, rows, inter, x_stride, threads);
  else act_rows<false>(x, out, rows, inter, x_stride, threads);
}

// Rotate-half RoPE in place: x holds rows tokens of heads heads (a token's heads x_stride floats after the previous
// token's, a head's head_dim floats contiguous and head_dim after the previous head's); table [positions, head_dim]
// holds cos | sin of the head_dim / 2 frequencies at each position.
extern "C" void cpu_rope(float* x, int64_t rows, int heads, int64_t x_stride, int head_dim, const float* table,
                         const int32_t* positions, int threads) {
  const int half = head_dim / 2;
#pragma omp parallel for num_threads(threads) if (rows * heads * head_dim >= PARALLEL_MIN)
  for (int64_t t = 0; t < rows; ++t) {
    const float* c = table + (int64_t)positions[t] * head_dim;
    const float* s = c + half;
    for (int h = 0; h < heads; ++h) {
      float* a = x + t * x_stride + (int64_t)h * head_dim;
      float* b = a + half;
      for (int i = 0; i < half; ++i) {
        const float x1 = a[i], x2 = b[i];
        a[i] = x1 * c[i] - x2 * s[i];
        b[i] = x2 * c[i] + x1 * s[i];
      }
    }
  }
}

// RMSNorm of rows tokens x heads heads: row (t, h) at x + t * x_stride + h * dim, written at the same place under
// out (out may be x: in place); offset 0 (Llama, Qwen) or 1 (Gemma stores w - 1).
extern "C" void cpu_rmsnorm(const float* x, int64_t x_stride, float* out, int64_t out_stride, int64_t rows,
                            int64_t heads, int64_t dim, const float* w, float eps, float offset, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * heads * dim >= PARALLEL_MIN)
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < heads; ++h) norm_row(x + t * x_stride + h * dim, out + t * out_stride + h * dim, w, dim,
                                                 eps, offset);
}

// residual += x, then x = RMSNorm(residual), both [rows, dim] contiguous, in place (FlashInfer's fused_add_rmsnorm's
// contract).
extern "C" void cpu_add_rmsnorm(float* x, float* residual, int64_t rows, int64_t dim, const float* w, float eps,
                                float offset, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * dim >= PARALLEL_MIN)
  for (int64_t t = 0; t < rows; ++t) {
    float* xr = x + t * dim;
    float* rr = residual + t * dim;
    for (int64_t i = 0; i < dim; ++i) rr[i] += xr[i];
    norm_row(rr, xr, w, dim, eps, offset);
  }
}
