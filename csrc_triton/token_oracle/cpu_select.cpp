// SPDX-License-Identifier: Apache-2.0
// The token oracle's selection on the CPU (SPEC §3.3): from every row's logits and log-sum-exps (the tiled oracle
// kernel writes both, `oracle/cpu_tiled.cpp`) to S_t, the k candidates with the largest reduced probability R plus
// the recent window, ascending. It replaces `token_oracle/batched.py: select_from_logits`, whose PyTorch top-k over
// [rows, groups, context] cost several times the attention itself on a prefill chunk.
//
// One (row, group) at a time, every pass linear in the context:
//   1. R[j] = reduce over the group's heads of exp(z_h[j] - lse_h), for the candidates j < t - w + 1. For `max`,
//      exp is monotone, so R = exp(max_h (z_h - lse_h)): one exp per key instead of one per head.
//   2. The k-th largest R by radix select: R >= 0, so its float bits order like its value; a histogram of the top
//      11 bits finds the bucket that holds the k-th value, and a partial sort of that bucket alone finds it.
//   3. One ascending scan writes every j with R above the k-th value and, in position order, as many of those
//      equal to it as are still missing (SPEC's tie rule: the smaller position first), then the window.
// So no position is sorted: the scan emits them in order.

// ATen and op registration only, not torch/extension.h: see cpu_ext.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "../cpu_tile.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

namespace {

constexpr int RADIX_SHIFT = 20;                       // bits 30..20 of a non-negative float: exponent + 3 bits
constexpr int64_t RADIX_BUCKETS = 1 << (31 - RADIX_SHIFT);

inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
}

// R of candidates [0, count) of one row and group: `z` points at the group's first head, heads `stride` apart.
void reduced_probabilities(const float* z, int64_t stride, const float* lse, int64_t heads, int64_t count, bool sum,
                           float* r) {
  int64_t j = 0;
  for (; j + 8 <= count; j += 8) {
    v8 acc;
    if (sum) {
      acc = splat(0.f);
      for (int64_t h = 0; h < heads; ++h) acc += exp8(load8(z + h * stride + j) - splat(lse[h]));
    } else {
      acc = load8(z + j) - splat(lse[0]);
      for (int64_t h = 1; h < heads; ++h) {
        const v8 x = load8(z + h * stride + j) - splat(lse[h]);
        acc = x > acc ? x : acc;
      }
      acc = exp8(acc);
    }
    store8(r + j, acc);
  }
  for (; j < count; ++j) {  // the tail: the same operations, one lane
    v8 x = splat(0.f);
    if (sum) {
      for (int64_t h = 0; h < heads; ++h) x += exp8(splat(z[h * stride + j] - lse[h]));
    } else {
      float m = z[j] - lse[0];
      for (int64_t h = 1; h < heads; ++h) m = std::max(m, z[h * stride + j] - lse[h]);
      x = exp8(splat(m));
    }
    r[j] = x[0];
  }
}

// The k-th largest of r[0, count) (1 <= k <= count), every r >= 0.
float kth_largest(const float* r, int64_t count, int64_t k, std::vector<int64_t>& hist, std::vector<float>& bucket) {
  std::fill(hist.begin(), hist.end(), 0);
  for (int64_t j = 0; j < count; ++j) ++hist[bits_of(r[j]) >> RADIX_SHIFT];
  int64_t b = RADIX_BUCKETS - 1, above = 0;
  while (above + hist[b] < k) above += hist[b--];
  bucket.clear();
  for (int64_t j = 0; j < count; ++j)
    if (static_cast<int64_t>(bits_of(r[j]) >> RADIX_SHIFT) == b) bucket.push_back(r[j]);
  const int64_t nth = k - above - 1;  // 0-based, in descending order, within the bucket
  std::nth_element(bucket.begin(), bucket.begin() + nth, bucket.end(), std::greater<float>());
  return bucket[nth];
}

// S_t of one row and group into o[0, topk + window): `r` the candidates' R (read when more than topk), t the row's
// position. Returns how many positions were written.
int64_t select_row(const float* r, int64_t t, int64_t topk, int64_t window, int32_t* o, std::vector<int64_t>& hist,
                   std::vector<float>& bucket) {
  int64_t written = 0;
  const int64_t first_window = std::max<int64_t>(0, t - window + 1);  // candidates are [0, first_window)
  if (first_window <= topk) {
    for (int64_t j = 0; j < first_window; ++j) o[written++] = static_cast<int32_t>(j);
  } else if (topk > 0) {
    const float kth = kth_largest(r, first_window, topk, hist, bucket);
    int64_t ties = topk;  // the candidates equal to the k-th value that are taken: the rest of k
    for (int64_t j = 0; j < first_window; ++j) ties -= r[j] > kth;
    for (int64_t j = 0; j < first_window; ++j)
      if (r[j] > kth || (r[j] == kth && ties-- > 0)) o[written++] = static_cast<int32_t>(j);
  }
  for (int64_t j = first_window; j <= t; ++j) o[written++] = static_cast<int32_t>(j);
  return written;
}

// The checks both entries share: topk and window, pos [N] int64, ids [N, G, topk + window] int32, and every row's
// position within the L columns it selects from. Returns topk + window.
int64_t check_selection(const char* op, int64_t n, int64_t groups, int64_t len, int64_t topk, int64_t window,
                        const at::Tensor& pos, const at::Tensor& ids) {
  const int64_t width = topk + window;
  TORCH_CHECK(topk >= 0 && window >= 0 && width > 0, op, ": topk and window >= 0, not both 0");
  TORCH_CHECK(pos.scalar_type() == at::kLong && pos.is_contiguous() && pos.numel() == n, op,
              ": pos must be contiguous int64 [N]");
  TORCH_CHECK(ids.scalar_type() == at::kInt && ids.is_contiguous() && ids.numel() == n * groups * width, op,
              ": ids must be contiguous int32 [N, G, topk + window]");
  const int64_t* ps = pos.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(ps[i] < len, op, ": row ", i, " at position ", ps[i], " past the ", len, " columns");
  return width;
}

void token_select(const at::Tensor& logits, const at::Tensor& lse, const at::Tensor& pos, int64_t groups,
                  int64_t topk, int64_t window, bool sum, at::Tensor& ids) {
  TORCH_CHECK(logits.dim() == 3 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "token_select: logits must be contiguous float32 [N, H, L]");
  const int64_t n = logits.size(0), heads = logits.size(1), len = logits.size(2);
  TORCH_CHECK(groups > 0 && heads % groups == 0, "token_select: ", heads, " heads in ", groups, " groups");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.numel() == n * heads,
              "token_select: lse must be contiguous float32 [N, H]");
  const int64_t width = check_selection("token_select", n, groups, len, topk, window, pos, ids);
  const float* z = logits.data_ptr<float>();
  const float* l = lse.data_ptr<float>();
  const int64_t* ps = pos.data_ptr<int64_t>();
  int32_t* out = ids.data_ptr<int32_t>();
  const int64_t per_group = heads / groups;
  at::parallel_for(0, n * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> r(len), bucket;
    std::vector<int64_t> hist(RADIX_BUCKETS);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / groups, g = task % groups, t = ps[row];
      int32_t* o = out + task * width;
      int64_t written = 0;
      if (t >= 0) {
        const int64_t first_window = std::max<int64_t>(0, t - window + 1);
        if (first_window > topk && topk > 0) {
          const int64_t h0 = row * heads + g * per_group;
          reduced_probabilities(z + h0 * len, len, l + h0, per_group, first_window, sum, r.data());
        }
        written = select_row(r.data(), t, topk, window, o, hist, bucket);
      }
      std::fill(o + written, o + width, -1);
    }
  });
}

// S_t from R itself [N, G, L] (the tiled oracle's second pass writes it: `oracle_tiled_reduced`), R read for
// j < each row's position - window + 1 only.
void token_select_probs(const at::Tensor& probs, const at::Tensor& pos, int64_t topk, int64_t window, at::Tensor& ids) {
  TORCH_CHECK(probs.dim() == 3 && probs.scalar_type() == at::kFloat && probs.is_contiguous(),
              "token_select_probs: probs must be contiguous float32 [N, G, L]");
  const int64_t n = probs.size(0), groups = probs.size(1), len = probs.size(2);
  const int64_t width = check_selection("token_select_probs", n, groups, len, topk, window, pos, ids);
  const float* pr = probs.data_ptr<float>();
  const int64_t* ps = pos.data_ptr<int64_t>();
  int32_t* out = ids.data_ptr<int32_t>();
  at::parallel_for(0, n * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> bucket;
    std::vector<int64_t> hist(RADIX_BUCKETS);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = ps[task / groups];
      int32_t* o = out + task * width;
      const int64_t written = t >= 0 ? select_row(pr + task * len, t, topk, window, o, hist, bucket) : 0;
      std::fill(o + written, o + width, -1);
    }
  });
}

}  // namespace

TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  // S_t of every row and KV group from the rows' logits [N, H, L] (-inf past each row) and lse [N, H] (SPEC §3.3).
  m.def("token_select(Tensor logits, Tensor lse, Tensor pos, int groups, int topk, int window, bool sum, "
        "Tensor(a!) ids) -> ()");
  // The same from the reduced probabilities R [N, G, L] themselves.
  m.def("token_select_probs(Tensor probs, Tensor pos, int topk, int window, Tensor(a!) ids) -> ()");
}

TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) {
  m.impl("token_select", &token_select);
  m.impl("token_select_probs", &token_select_probs);
}
