// SPDX-License-Identifier: Apache-2.0
// The step both C++ CPU kernels share: one head's online softmax over a contiguous run of keys.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

// Keys and values of `count` tokens at `slab` (token stride `s_tok`, V `dim` floats after K):
// logits go to z[0, count), weights to w; the running max m, sum l and output acc [dim] are
// updated (acc rescaled to the new max). DIM > 0 fixes the head dim at compile time.
template <int DIM>
inline void online_softmax_run(const float* qh, const float* slab, int64_t count, int64_t s_tok, int64_t dim_rt,
                               float scale, float* z, float* w, float& m, float& l, float* acc) {
  const int64_t dim = DIM > 0 ? DIM : dim_rt;
  float mx = m;
  for (int64_t t = 0; t < count; ++t) {
    const float* k = slab + t * s_tok;
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t d = 0; d < dim; ++d) dot += qh[d] * k[d];
    z[t] = dot * scale;
    mx = std::max(mx, z[t]);
  }
  const float rescale = std::exp(m - mx);  // 0 while nothing was seen (m = -inf)
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < count; ++t) {
    w[t] = std::exp(z[t] - mx);
    sum += w[t];
  }
  l = l * rescale + sum;
  m = mx;
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) acc[d] *= rescale;
  for (int64_t t = 0; t < count; ++t) {
    const float* v = slab + t * s_tok + dim;
    const float wt = w[t];
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d) acc[d] += wt * v[d];
  }
}
