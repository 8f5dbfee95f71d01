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

#include "cpu_gate.h"
#include "cpu_tile.h"

#include <omp.h>

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
  Gate gate;  // the branch's output gate (`cpu_gate.h`), or none
};

// out[row, h] = acc / (l + exp(sink - m)) in a stable form, through the gate if any; a row with no key is 0, sink
// or not (its gated term, with `accumulate`).
inline void store_row(const SparseProblem& pb, int64_t row, int64_t h, int64_t dim, float m, float l, const float* acc) {
  float* o = pb.out + (row * pb.heads + h) * dim;
  float factor = 0.f;
  if (l > 0.f) {
    if (pb.sinks != nullptr) {
      const float top = std::max(m, pb.sinks[h]);  // the sink joins the denominator
      const float keep = std::exp(m - top);
      factor = keep / (l * keep + std::exp(pb.sinks[h] - top));
    } else {
      factor = 1.f / l;
    }
  }
  store_gated(pb.gate, row, h, acc, factor, o, dim);
}

// Rows in tiles: a task is up to SPARSE_TILE_ROWS consecutive rows of one request and one KV group, whose query vectors
// (rows x the group's heads) walk the union of the rows' selected positions KEYS keys at a time, as the tiled
// oracle walks a whole context. Consecutive prefill rows select mostly the same keys (HySparse: all visible blocks
// while the context fits the budget; HySparse2: overlapping windows), so each key is loaded and transposed once
// for the tile, and one FMA scores 8 keys. Per key, a mask says which rows selected it; a row skips the others
// and the keys after its position. Selections must be distinct within a row (the oracles' are).
// Rows per task (a bit each in a 64-bit key mask): a taller tile loads and transposes each key once for more query
// vectors (16 -> 63 rows, one core: 512 prefill rows over all 512 keys 9.4 -> 7.8 ms; 1024 rows at 8k, 16 random
// blocks each, 118 -> 78 ms).
constexpr int64_t SPARSE_TILE_ROWS = 63;
typedef uint64_t RowMask;

struct SparseTask {
  int64_t row0, rows, group, cost;
  const int64_t* row_ids;  // rows on a shared prefix (not consecutive): row_ids[r], else row0 + r
  int64_t shared;          // keys [0, shared) sit at the same pages for every row (row(0)'s block table)
  int64_t row(int64_t r) const { return row_ids != nullptr ? row_ids[r] : row0 + r; }
};

struct TileScratch {
  std::vector<float> buf;
  std::vector<RowMask> who;       // per run: bit r set when row r selected it
  std::vector<int64_t> keys;      // the union's positions, ascending
  std::vector<RowMask> masks;     // per key: its run's `who`
  std::vector<const float*> kp;   // per key: its K in the pages (V follows at + DIM)
  std::vector<int64_t> act;       // per query vector a key tile concerns: its index, accumulator and weights
  std::vector<float*> acc_of;
  std::vector<const float*> w_of;
};

template <int DIM>
void sparse_tile(const SparseProblem& pb, const SparseTask& tk, TileScratch& sc) {
  const int64_t per_group = pb.heads / pb.groups, nq = tk.rows * per_group;
  int64_t pos[SPARSE_TILE_ROWS];
  int64_t last = -1;  // the tile's largest position
  for (int64_t r = 0; r < tk.rows; ++r) last = std::max(last, pos[r] = pb.pos[tk.row(r)]);
  if (last < 0) last = 0;
  const int64_t nb = last / pb.span + 1;  // runs that may hold a key visible to some row
  sc.who.assign(nb, 0u);
  for (int64_t r = 0; r < tk.rows; ++r) {
    const int32_t* sel = pb.ids + (tk.row(r) * pb.groups + tk.group) * pb.width;
    for (int64_t s = 0; s < pb.width; ++s)
      if (sel[s] >= 0 && sel[s] * pb.span <= pos[r]) sc.who[sel[s]] |= RowMask{1} << r;
  }
  // The union's keys with their masks and page addresses, built once per tile: the keys before `tk.shared` once
  // for all rows that selected them, then each row's own keys past it (at its own pages). Positions ascend within
  // each part, so the page is advanced incrementally: an integer division per key (three, before) cost more than
  // scoring it.
  sc.keys.clear();
  sc.masks.clear();
  sc.kp.clear();
  const float* base = pb.kv + tk.group * pb.s_group;
  const auto add_run = [&](const int32_t* pages, int64_t t0, int64_t stop, RowMask mask) {
    int64_t pg = t0 / pb.page, off = t0 - pg * pb.page;
    for (int64_t t = t0; t < stop; ++t) {
      sc.keys.push_back(t);
      sc.masks.push_back(mask);
      sc.kp.push_back(base + pages[pg] * pb.s_page + off * pb.s_tok);
      if (++off == pb.page) off = 0, ++pg;
    }
  };
  const int32_t* pages = pb.bt + pb.reqs[tk.row(0)] * pb.s_bt;
  for (int64_t b = 0; b < nb && b * pb.span < tk.shared; ++b)
    if (sc.who[b] != 0) add_run(pages, b * pb.span, std::min({(b + 1) * pb.span, last + 1, tk.shared}), sc.who[b]);
  for (int64_t r = 0; r < tk.rows && last + 1 > tk.shared; ++r) {
    const RowMask bit = RowMask{1} << r;
    const int32_t* own = pb.bt + pb.reqs[tk.row(r)] * pb.s_bt;
    for (int64_t b = tk.shared / pb.span; b < nb; ++b)
      if (sc.who[b] & bit)
        add_run(own, std::max(b * pb.span, tk.shared), std::min((b + 1) * pb.span, pos[r] + 1), bit);
  }
  const size_t need = 2 * nq * DIM + DIM * KEYS + nq * KEYS + nq * DIM + 2 * nq;
  if (sc.buf.size() < need) sc.buf.resize(need);
  float* qs = sc.buf.data();  // [nq, DIM] scaled queries
  float* qc = qs + nq * DIM;  // [nq, DIM] the queries of the rows a key tile concerns, compacted
  float* kt = qc + nq * DIM;
  float* s = kt + DIM * KEYS;
  float* acc = s + nq * KEYS;
  float* m = acc + nq * DIM;
  float* l = m + nq;
  sc.act.resize(nq);  // the query vectors a key tile concerns
  sc.acc_of.resize(nq);
  sc.w_of.resize(nq);
  int64_t* act = sc.act.data();
  float** acc_of = sc.acc_of.data();
  const float** w_of = sc.w_of.data();
  const float* vp[KEYS];
  for (int64_t r = 0; r < tk.rows; ++r) {
    const float* src = pb.q + (tk.row(r) * pb.heads + tk.group * per_group) * DIM;
    for (int64_t i = 0; i < per_group * DIM; ++i) qs[r * per_group * DIM + i] = src[i] * pb.scale;
  }
  std::fill(acc, acc + nq * DIM, 0.f);
  std::fill(m, m + nq, NEG_INF);
  std::fill(l, l + nq, 0.f);
  const RowMask all = (RowMask{1} << tk.rows) - 1;  // tk.rows <= SPARSE_TILE_ROWS < 64
  const int64_t total = static_cast<int64_t>(sc.keys.size());
  RowMask active = 0;  // the rows whose query vectors `act` / `qa` hold (none yet)
  int64_t na = 0;
  const float* qa = qs;
  for (int64_t c0 = 0; c0 < total; c0 += KEYS) {
    const int64_t count = std::min(KEYS, total - c0);
    const int64_t* key = sc.keys.data() + c0;
    const RowMask* kmask = sc.masks.data() + c0;
    const float* const* kp = sc.kp.data() + c0;
    RowMask rows = 0, every = ~RowMask{0};  // rows that selected some / every key of the tile
    int64_t first = key[0], final = key[0];  // the tile's smallest and largest positions (parts restart)
    for (int64_t j = 0; j < count; ++j)
      rows |= kmask[j], every &= kmask[j], first = std::min(first, key[j]), final = std::max(final, key[j]);
    for (int64_t r = 0; r < tk.rows; ++r)
      if (pos[r] < first) rows &= ~(RowMask{1} << r);  // this row sees none of them
    if (rows == 0) continue;
    if (rows != active) {  // the rows concerned changed: compact their query vectors (a block's tiles share them)
      active = rows;
      na = 0;
      for (int64_t r = 0; r < tk.rows; ++r)
        if (rows >> r & 1u)
          for (int64_t p = 0; p < per_group; ++p) act[na++] = r * per_group + p;
      qa = qs;
      if (rows != all) {  // score only the rows concerned
        for (int64_t a = 0; a < na; ++a) std::copy(qs + act[a] * DIM, qs + (act[a] + 1) * DIM, qc + a * DIM);
        qa = qc;
      }
    }
    for (int64_t j = 0; j < count; ++j) vp[j] = kp[j] + DIM;
    if (na <= DIRECT_MAX) {
      score_direct<DIM>(qa, na, kp, count, s);
    } else {
      transpose_keys<DIM>(kp, count, kt);
      score_tiled<DIM>(qa, na, kt, s);
    }
    int64_t nw = 0;  // the query vectors with a key in this tile: accumulators and weights
    for (int64_t a = 0; a < na; ++a) {
      const int64_t i = act[a], r = i / per_group;
      const RowMask bit = RowMask{1} << r;
      float* si = s + a * KEYS;
      float mt = m[i];
      if (count == KEYS && (every & bit) && final <= pos[r]) {  // most prefill tiles: every key attended
        mt = std::max(mt, max_tile(si));
      } else {
        bool any = false;
        for (int64_t j = 0; j < KEYS; ++j) {
          const bool seen = j < count && (kmask[j] & bit) && key[j] <= pos[r];
          si[j] = seen ? si[j] : NEG_INF;
          mt = std::max(mt, si[j]);
          any |= seen;
        }
        if (!any) continue;
      }
      // The whole tile at once (exactly 0 for the keys this row does not attend).
      online_rescale<DIM>(mt, exp_tile(si, mt), m[i], l[i], acc + i * DIM);
      acc_of[nw] = acc + i * DIM;
      w_of[nw++] = si;
    }
    accumulate_many<DIM>(acc_of, w_of, nw, vp, count);
  }
  for (int64_t i = 0; i < nq; ++i)
    store_row(pb, tk.row(i / per_group), tk.group * per_group + i % per_group, DIM, m[i], l[i], acc + i * DIM);
}

template <int DIM>
void sparse_tiled(const SparseProblem& pb, const std::vector<SparseTask>& tasks) {
#pragma omp parallel num_threads(at::get_num_threads())
  {
    TileScratch scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < static_cast<int64_t>(tasks.size()); ++t) sparse_tile<DIM>(pb, tasks[t], scratch);
  }
}

// Tasks of `sparse_tiled`: tiles of consecutive rows of one request (a request's rows are contiguous in a vLLM
// batch), per KV group, costliest first. Rows alone in their tile (decode rows) on a shared prefix (see
// `prefix_clusters`) share a task: the keys they selected in the prefix are loaded once for all of them.
// `clustered` keeps those rows in cluster order (the tasks point into it).
std::vector<SparseTask> sparse_tasks_of(const SparseProblem& pb, int64_t n, std::vector<int64_t>& clustered) {
  constexpr int64_t ALL = std::numeric_limits<int64_t>::max();
  std::vector<SparseTask> tasks;
  for (int64_t r0 = 0; r0 < n;) {
    int64_t r1 = r0 + 1;
    while (r1 < n && r1 - r0 < SPARSE_TILE_ROWS && pb.reqs[r1] == pb.reqs[r0]) ++r1;
    if (r1 - r0 == 1 && pb.pos[r0] + 1 >= SHARED_MIN_KEYS) {
      clustered.push_back(r0);
    } else {
      for (int64_t g = 0; g < pb.groups; ++g) tasks.push_back({r0, r1 - r0, g, (r1 - r0) * pb.width, nullptr, ALL});
    }
    r0 = r1;
  }
  std::vector<int64_t> seen;  // per selection id: the last (row tile, group) that counted it
  for (const PrefixCluster& c : prefix_clusters(clustered, pb.bt, pb.s_bt, pb.reqs, pb.pos, pb.page)) {
    const int64_t shared = c.pages * pb.page;
    for (int64_t x = c.first; x < c.first + c.rows; x += SPARSE_TILE_ROWS) {
      const int64_t rows = std::min(SPARSE_TILE_ROWS, c.first + c.rows - x);
      for (int64_t g = 0; g < pb.groups; ++g) {
        // One task pays only where the rows selected the same keys: every key of the union is scored for each
        // row a tile of it concerns, so rows that picked different blocks (random weights do) lose more to the
        // masked scores than they gain from the shared loads. Shared when each id in the prefix serves two
        // rows on average, else a task per row.
        int64_t total = 0, distinct = 0;
        if (rows >= 2) {
          seen.resize(shared / pb.span + 1, -1);
          const int64_t stamp = x * pb.groups + g;
          for (int64_t r = x; r < x + rows; ++r) {
            const int32_t* sel = pb.ids + (clustered[r] * pb.groups + g) * pb.width;
            for (int64_t k = 0; k < pb.width; ++k)
              if (sel[k] >= 0 && sel[k] * pb.span < shared) {
                ++total;
                if (seen[sel[k]] != stamp) seen[sel[k]] = stamp, ++distinct;
              }
          }
        }
        if (rows >= 2 && total >= 2 * distinct) {
          tasks.push_back({clustered[x], rows, g, rows * pb.width, clustered.data() + x, shared});
        } else {
          for (int64_t r = x; r < x + rows; ++r) tasks.push_back({clustered[r], 1, g, pb.width, nullptr, ALL});
        }
      }
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const SparseTask& a, const SparseTask& b) { return a.cost > b.cost; });
  return tasks;
}

// q [N, H, D], kv [pages, G, page, 2D] float32; reqs, pos [N] int64; ids [N, G, W] int32 (-1 padded);
// sinks [H] float32 or an empty tensor; gate [N, H, D] or an empty tensor (`gate_of`), `accumulate` adding the gated
// rows to out's. Writes every row of out [N, H, D] float32 (in place where it is contiguous, which the serving
// path's output buffers are).
void paged_sparse(at::Tensor q, at::Tensor kv, at::Tensor block_table, at::Tensor reqs, at::Tensor pos,
                  at::Tensor ids, int64_t span, double scale, at::Tensor sinks, at::Tensor gate, bool accumulate,
                  at::Tensor out) {
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
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 3 && out.size(0) == n && out.size(1) == heads &&
              out.size(2) == dim, "out: expected [N, H, D] float32");
  const bool direct = out.is_contiguous();
  at::Tensor dst = direct ? out : (accumulate ? out.contiguous() : at::empty({n, heads, dim}, q.options()));
  const SparseProblem pb{q.data_ptr<float>(), kv.data_ptr<float>(), block_table.data_ptr<int32_t>(),
                         reqs.data_ptr<int64_t>(), pos.data_ptr<int64_t>(), ids.data_ptr<int32_t>(),
                         has_sinks ? sinks.data_ptr<float>() : nullptr, dst.data_ptr<float>(), heads, groups,
                         kv.size(2), ids.size(2), span, kv.stride(0), kv.stride(1), kv.stride(2),
                         block_table.stride(0), static_cast<float>(scale), gate_of(gate, accumulate, n, heads, dim)};
  TORCH_CHECK(heads / groups <= 64, "paged_sparse: at most 64 query heads per KV group");
  std::vector<int64_t> clustered;  // decode rows in shared-prefix order; tasks point into it
  switch (dim) {
#define HYSPARSE_DIM(D) \
  case D: sparse_tiled<D>(pb, sparse_tasks_of(pb, n, clustered)); break;
    HYSPARSE_TILE_DIMS(HYSPARSE_DIM)
#undef HYSPARSE_DIM
    default: TORCH_CHECK(false, "paged_sparse: head dim ", dim, " not compiled (see supported_dims)");
  }
  if (!direct) out.copy_(dst);
}

// The pages-per-query counters of one oracle layer's selections (`vllm_hysparse.metrics.pages_touched` is the
// PyTorch twin): adds (rows x groups, distinct pages holding a selected key j <= t, pages up to t of a dense row per
// group) to totals [3] int64. One call instead of the twin's twenty small tensor ops (0.25 ms per oracle layer on the
// 2-core CPU). ids [N, G, K] int32, ascending per row and group, -1 padded; pos [N] int64. A block whose first page is
// the previous entry's last page counts that page once (ascending blocks share at most that one).
void add_pages_touched(at::Tensor ids, at::Tensor pos, int64_t block, int64_t page, at::Tensor totals) {
  TORCH_CHECK(ids.dim() == 3 && ids.scalar_type() == at::kInt, "ids: expected [N, G, K] int32");
  TORCH_CHECK(pos.dim() == 1 && pos.scalar_type() == at::kLong && pos.size(0) == ids.size(0), "pos: expected [N] int64");
  TORCH_CHECK(totals.numel() == 3 && totals.scalar_type() == at::kLong && totals.is_contiguous(),
              "totals: expected [3] int64");
  TORCH_CHECK(block >= 1 && page >= 1, "block and page must be positive");
  ids = ids.contiguous();
  pos = pos.contiguous();
  const int64_t n = ids.size(0), groups = ids.size(1), width = ids.size(2);
  const int32_t* id = ids.data_ptr<int32_t>();
  const int64_t* ps = pos.data_ptr<int64_t>();
  int64_t pages = 0, dense = 0;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t t = ps[r];
    dense += (t / page + 1) * groups;
    for (int64_t g = 0; g < groups; ++g) {
      int64_t prev_last = -1;
      for (int64_t k = 0; k < width; ++k, ++id) {
        const int64_t start = static_cast<int64_t>(*id) * block;
        if (*id < 0 || start > t) {
          prev_last = -1;
          continue;
        }
        const int64_t first = start / page, last = std::min(start + block - 1, t) / page;
        pages += last - first + 1 - (first == prev_last);
        prev_last = last;
      }
    }
  }
  int64_t* tot = totals.data_ptr<int64_t>();
  tot[0] += n * groups, tot[1] += pages, tot[2] += dense;
}

// key [T, G, Dk] and value [T, G, Dv] float32 -> the pages kv [pages, G, page, Dk + Dv] at flat slots
// `page_id * page + offset` (`vllm_hysparse.attention.paged.write_kv` is the PyTorch twin); slots [n] int64, n <= T.
// Negative slots are padding rows and are skipped (the twin writes them to vLLM's null block 0, which it must
// do without a host read of the count of valid slots; here the skip is free). One call instead of the twin's
// eight tensor ops (0.05-0.09 ms per layer call on the 2-core CPU for one decode row).
void write_pages(at::Tensor kv, at::Tensor key, at::Tensor value, at::Tensor slots) {
  TORCH_CHECK(kv.dim() == 4 && kv.scalar_type() == at::kFloat && kv.stride(3) == 1,
              "kv: expected [pages, G, page, Dk + Dv] float32 with a contiguous last dim");
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key.scalar_type() == at::kFloat &&
                  value.scalar_type() == at::kFloat, "key, value: expected [T, G, D] float32");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong, "slots: expected [n] int64");
  const int64_t n = slots.size(0), groups = kv.size(1), page = kv.size(2), dk = key.size(2), dv = value.size(2);
  TORCH_CHECK(key.size(0) >= n && value.size(0) >= n && key.size(1) == groups && value.size(1) == groups &&
                  dk + dv == kv.size(3), "write_pages: inconsistent shapes of kv, key, value and slots");
  if (key.stride(2) != 1) key = key.contiguous();
  if (value.stride(2) != 1) value = value.contiguous();
  slots = slots.contiguous();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t capacity = kv.size(0) * page;
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(sl[t] < capacity, "write_pages: slot ", sl[t], " past the cache's ", capacity, " slots");
  float* base = kv.data_ptr<float>();
  const float* k = key.data_ptr<float>();
  const float* v = value.data_ptr<float>();
  const int64_t sp = kv.stride(0), sg = kv.stride(1), st = kv.stride(2);
  const int64_t kt = key.stride(0), kg = key.stride(1), vt = value.stride(0), vg = value.stride(1);
  at::parallel_for(0, n, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (sl[t] < 0) continue;
      float* dst = base + (sl[t] / page) * sp + (sl[t] % page) * st;
      for (int64_t g = 0; g < groups; ++g) {
        std::copy(k + t * kt + g * kg, k + t * kt + g * kg + dk, dst + g * sg);
        std::copy(v + t * vt + g * vg, v + t * vt + g * vg + dv, dst + g * sg + dk);
      }
    }
  });
}

}  // namespace

#define HYSPARSE_DIM(D) D,
static std::vector<int64_t> supported_dims() { return {HYSPARSE_TILE_DIMS(HYSPARSE_DIM)}; }
#undef HYSPARSE_DIM

TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  // Sparse sink attention of each row over its selected runs of the paged cache.
  m.def("paged_sparse(Tensor q, Tensor kv, Tensor block_table, Tensor reqs, Tensor pos, Tensor ids, int span, "
        "float scale, Tensor sinks, Tensor gate, bool accumulate, Tensor(a!) out) -> ()");
  // Pages-per-query counters of one oracle layer's selections, added into totals in place.
  m.def("add_pages_touched(Tensor ids, Tensor pos, int block, int page, Tensor(a!) totals) -> ()");
  // New keys and values stored into the pages at their slots, in place.
  m.def("write_pages(Tensor(a!) kv, Tensor key, Tensor value, Tensor slots) -> ()");
  // The head dims the kernel compiles.
  m.def("supported_dims() -> int[]", &supported_dims);
}

TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) {
  m.impl("paged_sparse", &paged_sparse);
  m.impl("add_pages_touched", &add_pages_touched);
  m.impl("write_pages", &write_pages);
}
