// SPDX-License-Identifier: Apache-2.0
// A branch's output gate, applied where a kernel stores a row: out = (accumulate ? out : 0) + sigmoid(g) * o.
// A HySparse sparse layer sums its two branches' outputs so (SPEC §2.5): the window kernel stores its gated rows,
// the block-sparse kernel adds its own. Each branch's output is gated while it is in the kernel's hands, instead
// of a pass over both branches' [T, H, Dv] outputs and both gates after the two kernels.
#pragma once

#include <ATen/core/Tensor.h>

#include "cpu_tile.h"

namespace {

struct Gate {
  const float* g = nullptr;  // logits at g[row * s_row + h * s_head + d * s_dim]; nullptr: no gate
  int64_t s_row = 0, s_head = 0, s_dim = 0;  // s_dim 0: one gate per head (headwise), 1: one per element
  bool accumulate = false;                   // add to the row already stored (the other branch's)
};

// gate [N, H, D] float32 whose last stride is 1 (elementwise) or 0 (a headwise gate expanded over D), or an empty
// tensor (no gate: accumulate must then be false).
inline Gate gate_of(const at::Tensor& gate, bool accumulate, int64_t n, int64_t heads, int64_t dim) {
  if (gate.numel() == 0) {
    TORCH_CHECK(!accumulate, "accumulate: only with a gate");
    return {};
  }
  TORCH_CHECK(gate.scalar_type() == at::kFloat && gate.dim() == 3 && gate.size(0) == n && gate.size(1) == heads &&
                  gate.size(2) == dim && (gate.stride(2) == 0 || gate.stride(2) == 1),
              "gate: expected [N, H, D] float32 with a last stride of 1 or 0");
  return {gate.data_ptr<float>(), gate.stride(0), gate.stride(1), gate.stride(2), accumulate};
}

// o [dim] = acc [dim] * factor, through row `row`'s gate of head h when there is one. dim: a multiple of 8 (the
// tiled kernels' head dims, HYSPARSE_TILE_DIMS).
inline void store_gated(const Gate& gt, int64_t row, int64_t h, const float* acc, float factor, float* o,
                        int64_t dim) {
  if (gt.g == nullptr) {
    for (int64_t d = 0; d < dim; ++d) o[d] = acc[d] * factor;
    return;
  }
  const float* g = gt.g + row * gt.s_row + h * gt.s_head;
  const v8 one = splat(1.f), f = splat(factor);
  for (int64_t d = 0; d < dim; d += 8) {
    const v8 s = one / (one + exp8(-(gt.s_dim == 0 ? splat(g[0]) : load8(g + d))));  // sigmoid
    const v8 y = s * (load8(acc + d) * f);
    store8(o + d, gt.accumulate ? load8(o + d) + y : y);
  }
}

}  // namespace
