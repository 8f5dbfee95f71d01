// SPDX-License-Identifier: Apache-2.0
// Oracle decode on the CPU: exact attention of single-row queries over their requests' pages,
// keeping the logits (the oracles select blocks or tokens from the same scores).
//
// One pass over each request's pages, straight from the paged cache (keys, then the same
// page's values while it is in cache, with an online softmax): the PyTorch twin must first
// copy every page of the context, which costs more than the attention itself. Work is split
// over (row, KV group) pairs.

// ATen and op registration only, not torch/extension.h: see cpu_ext.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "../cpu_online_softmax.h"

#include <cmath>
#include <limits>
#include <vector>

namespace {

struct Problem {
  const float* q;       // [N, H, D]
  const float* kv;      // pages of [G, page, 2D] at the given strides
  const int32_t* bt;    // [R, max_pages]
  const int64_t* reqs;  // [N]
  const int64_t* lens;  // [N]
  float* out;           // [N, H, D]
  float* logits;        // [N, H, max_len]
  float* lse;           // [N, H]
  int64_t n, heads, groups, page, max_len, s_page, s_group, s_tok, s_bt;
  float scale;
};

// Rows x groups [begin, end) of `pb`; DIM > 0 fixes the head dim at compile time (unrolled dot
// products), DIM = 0 reads it from `dim`.
template <int DIM>
void decode_tasks(const Problem& pb, int64_t dim_rt, int64_t begin, int64_t end) {
  const int64_t dim = DIM > 0 ? DIM : dim_rt;
  const int64_t per_group = pb.heads / pb.groups, max_len = pb.max_len, page = pb.page;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> m(per_group), l(per_group), acc(per_group * dim), w(page);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t row = task / pb.groups, g = task % pb.groups;
    const int64_t len = std::min(pb.lens[row], max_len);
    const int32_t* pages = pb.bt + pb.reqs[row] * pb.s_bt;
    const float* qg = pb.q + (row * pb.heads + g * per_group) * dim;
    float* zg = pb.logits + (row * pb.heads + g * per_group) * max_len;
    std::fill(m.begin(), m.end(), neg_inf);
    std::fill(l.begin(), l.end(), 0.f);
    std::fill(acc.begin(), acc.end(), 0.f);
    // one page at a time, keys then values while the page is in cache (online softmax)
    for (int64_t first = 0; first < len; first += page) {
      const int64_t count = std::min(page, len - first);
      const float* slab = pb.kv + pages[first / page] * pb.s_page + g * pb.s_group;
      for (int64_t p = 0; p < per_group; ++p)
        online_softmax_run<DIM>(qg + p * dim, slab, count, pb.s_tok, dim, pb.scale, zg + p * max_len + first,
                                w.data(), m[p], l[p], acc.data() + p * dim);
    }
    for (int64_t p = 0; p < per_group; ++p) {
      const int64_t h = g * per_group + p;
      float* o = pb.out + (row * pb.heads + h) * dim;
      const float inv = len > 0 ? 1.f / l[p] : 0.f;
      for (int64_t d = 0; d < dim; ++d) o[d] = acc[p * dim + d] * inv;
      pb.lse[row * pb.heads + h] = len > 0 ? m[p] + std::log(l[p]) : neg_inf;
      std::fill(zg + p * max_len + len, zg + (p + 1) * max_len, neg_inf);
    }
  }
}

// q [N, H, D], kv [pages, G, page, 2D] (K then V in the last dim), float32.
// Returns out [N, H, D], logits [N, H, max_len] (-inf past each row's length) and lse [N, H].
std::vector<at::Tensor> paged_decode(at::Tensor q, at::Tensor kv, at::Tensor block_table,
                                        at::Tensor reqs, at::Tensor lens, int64_t max_len, double scale) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "q: expected [N, H, D] float32");
  TORCH_CHECK(kv.dim() == 4 && kv.scalar_type() == at::kFloat, "kv: expected [pages, G, page, 2D] float32");
  TORCH_CHECK(kv.stride(3) == 1, "kv: the last dim must be contiguous");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1,
              "block_table: expected int32 with contiguous rows");
  TORCH_CHECK(reqs.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "reqs, lens: int64");
  q = q.contiguous();
  reqs = reqs.contiguous();
  lens = lens.contiguous();
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t groups = kv.size(1);
  TORCH_CHECK(kv.size(3) == 2 * dim, "kv: last dim must be 2 * head dim");
  TORCH_CHECK(heads % groups == 0, "query heads must be a multiple of KV groups");
  auto out = at::empty({n, heads, dim}, q.options());
  auto logits = at::empty({n, heads, max_len}, q.options());
  auto lse = at::empty({n, heads}, q.options());
  const Problem pb{q.data_ptr<float>(), kv.data_ptr<float>(), block_table.data_ptr<int32_t>(),
                   reqs.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                   logits.data_ptr<float>(), lse.data_ptr<float>(), n, heads, groups, kv.size(2), max_len,
                   kv.stride(0), kv.stride(1), kv.stride(2), block_table.stride(0), static_cast<float>(scale)};
  at::parallel_for(0, n * groups, 1, [&](int64_t begin, int64_t end) {
    switch (dim) {
      case 64: decode_tasks<64>(pb, dim, begin, end); break;
      case 128: decode_tasks<128>(pb, dim, begin, end); break;
      case 256: decode_tasks<256>(pb, dim, begin, end); break;
      default: decode_tasks<0>(pb, dim, begin, end);
    }
  });
  return {out, logits, lse};
}

}  // namespace

TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  // Oracle decode attention over a paged cache, keeping the logits: (out, logits, lse).
  m.def("paged_decode(Tensor q, Tensor kv, Tensor block_table, Tensor reqs, Tensor lens, int max_len, "
        "float scale) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) { m.impl("paged_decode", &paged_decode); }
