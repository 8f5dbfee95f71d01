// SPDX-License-Identifier: Apache-2.0
// Sparse paged attention on the CPU: each query row attends, with one sink softmax, only the keys
// of its own selection, read straight from the paged cache.
//
// A selection entry `id` stands for the positions [id * span, id * span + span): span is the block
// size for HySparse's block-sparse layers and 1 for HySparse2's token-sparse layers. Positions after
// the row's own are skipped. The work of a row is O(selected keys), whatever the context length,
// which neither the masked dense path nor gathering copies can give a prefill.

// ATen and op registration only, not torch/extension.h: see cpu_ext.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_online_softmax.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

struct SparseProblem {
  const float* q;       // [N, H, D]
  const float* kv;      // pages of [G, page, 2D]
  const int32_t* bt;    // [R, max_pages]
  const int64_t* reqs;  // [N]
  const int64_t* pos;   // [N]
  const int32_t* ids;   // [N, G, W]
  const float* sinks;   // [H] or nullptr
  float* out;           // [N, H, D]
  int64_t heads, groups, page, width, span, s_page, s_group, s_tok, s_bt;
  float scale;
};

template <int DIM>
void sparse_tasks(const SparseProblem& pb, int64_t dim_rt, int64_t begin, int64_t end) {
  const int64_t dim = DIM > 0 ? DIM : dim_rt;
  const int64_t per_group = pb.heads / pb.groups, page = pb.page;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  std::vector<float> m(per_group), l(per_group), acc(per_group * dim), z(page), w(page);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t row = task / pb.groups, g = task % pb.groups;
    const int64_t t_pos = pb.pos[row];
    const int32_t* pages = pb.bt + pb.reqs[row] * pb.s_bt;
    const int32_t* sel = pb.ids + (row * pb.groups + g) * pb.width;
    const float* qg = pb.q + (row * pb.heads + g * per_group) * dim;
    std::fill(m.begin(), m.end(), neg_inf);
    std::fill(l.begin(), l.end(), 0.f);
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t s = 0; s < pb.width; ++s) {
      if (sel[s] < 0) continue;
      const int64_t start = int64_t(sel[s]) * pb.span;
      const int64_t stop = std::min(start + pb.span, t_pos + 1);
      // the run [start, stop), one page segment at a time
      for (int64_t first = start; first < stop;) {
        const int64_t off = first % page, count = std::min(page - off, stop - first);
        const float* slab = pb.kv + pages[first / page] * pb.s_page + g * pb.s_group + off * pb.s_tok;
        for (int64_t p = 0; p < per_group; ++p)
          online_softmax_run<DIM>(qg + p * dim, slab, count, pb.s_tok, dim, pb.scale, z.data(), w.data(), m[p],
                                  l[p], acc.data() + p * dim);
        first += count;
      }
    }
    for (int64_t p = 0; p < per_group; ++p) {
      const int64_t h = g * per_group + p;
      float* o = pb.out + (row * pb.heads + h) * dim;
      float factor = 0.f;  // a row with no key is 0, sink or not
      if (l[p] > 0.f) {
        if (pb.sinks != nullptr) {
          const float top = std::max(m[p], pb.sinks[h]);  // the sink joins the denominator
          const float keep = std::exp(m[p] - top);
          factor = keep / (l[p] * keep + std::exp(pb.sinks[h] - top));
        } else {
          factor = 1.f / l[p];
        }
      }
      for (int64_t d = 0; d < dim; ++d) o[d] = acc[p * dim + d] * factor;
    }
  }
}

// q [N, H, D], kv [pages, G, page, 2D] float32; reqs, pos [N] int64; ids [N, G, W] int32 (-1 padded);
// sinks [H] float32 or an empty tensor. Returns out [N, H, D].
at::Tensor paged_sparse(at::Tensor q, at::Tensor kv, at::Tensor block_table, at::Tensor reqs,
                           at::Tensor pos, at::Tensor ids, int64_t span, double scale, at::Tensor sinks) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat, "q: expected [N, H, D] float32");
  TORCH_CHECK(kv.dim() == 4 && kv.scalar_type() == at::kFloat && kv.stride(3) == 1,
              "kv: expected [pages, G, page, 2D] float32 with a contiguous last dim");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1,
              "block_table: expected int32 with contiguous rows");
  TORCH_CHECK(reqs.scalar_type() == at::kLong && pos.scalar_type() == at::kLong, "reqs, pos: int64");
  TORCH_CHECK(ids.dim() == 3 && ids.scalar_type() == at::kInt, "ids: expected [N, G, W] int32");
  TORCH_CHECK(span >= 1, "span must be positive");
  q = q.contiguous();
  reqs = reqs.contiguous();
  pos = pos.contiguous();
  ids = ids.contiguous();
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2), groups = kv.size(1);
  TORCH_CHECK(kv.size(3) == 2 * dim && heads % groups == 0 && ids.size(0) == n && ids.size(1) == groups,
              "inconsistent shapes of q, kv and ids");
  const bool has_sinks = sinks.numel() > 0;
  if (has_sinks) {
    TORCH_CHECK(sinks.numel() == heads && sinks.scalar_type() == at::kFloat, "sinks: expected [H] float32");
    sinks = sinks.contiguous();
  }
  auto out = at::empty({n, heads, dim}, q.options());
  const SparseProblem pb{q.data_ptr<float>(), kv.data_ptr<float>(), block_table.data_ptr<int32_t>(),
                         reqs.data_ptr<int64_t>(), pos.data_ptr<int64_t>(), ids.data_ptr<int32_t>(),
                         has_sinks ? sinks.data_ptr<float>() : nullptr, out.data_ptr<float>(), heads, groups,
                         kv.size(2), ids.size(2), span, kv.stride(0), kv.stride(1), kv.stride(2),
                         block_table.stride(0), static_cast<float>(scale)};
  at::parallel_for(0, n * groups, 1, [&](int64_t begin, int64_t end) {
    switch (dim) {
      case 64: sparse_tasks<64>(pb, dim, begin, end); break;
      case 128: sparse_tasks<128>(pb, dim, begin, end); break;
      case 256: sparse_tasks<256>(pb, dim, begin, end); break;
      default: sparse_tasks<0>(pb, dim, begin, end);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  // Sparse sink attention of each row over its selected runs of the paged cache.
  m.def("paged_sparse(Tensor q, Tensor kv, Tensor block_table, Tensor reqs, Tensor pos, Tensor ids, int span, "
        "float scale, Tensor sinks) -> Tensor");
}

TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) { m.impl("paged_sparse", &paged_sparse); }
