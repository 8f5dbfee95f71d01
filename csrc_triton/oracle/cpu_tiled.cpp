// SPDX-License-Identifier: Apache-2.0
// The HySparse oracle on the CPU as one tiled pass (SPEC §3.1): exact causal attention of every
// query row of a step (decode rows and prefill rows, chunked prefill included) over its request's
// pages, plus the top-k blocks of Eq. 3, without materialising the [rows, context] logits.
//
// A task is a tile of up to `tile_rows` consecutive rows of one request and one KV group: its query
// vectors (rows x the group's heads) walk the request's keys OKEYS (64) at a time, straight from the
// pages, with an online softmax. Each query vector keeps the running max u of every sparse block it
// has seen; after the pass its final statistics turn u into the Eq. 3 score exp(u - lse), the group
// keeps the max over its heads, and the top-k runs over those block scores.
//
// Dot products run over keys with vector FMAs: a tile's keys are transposed once into a [D, OKEYS]
// scratch (L1-resident) and every query vector of the task reuses it, so one FMA scores 16 keys (8 without
// AVX-512).
// Decode tiles have few query vectors, which would not repay the transpose: they dot the keys
// directly (FMAs over the head dim, eight keys' sums reduced together: `score_direct`).
//
// Shared prefixes: single-row tasks (decode rows) of different requests whose block tables start with the
// same pages (vLLM's prefix cache hands them the same physical pages) walk those pages once, as one task of
// all their query vectors (the transposed path), and each row walks its own tail alone. The two partial
// states (running max and sum, accumulators, block maxima) are merged by log-sum-exp before the outputs and
// the top-k, so the result is the one pass over each row's own pages. Eight decode rows on an 8k shared
// prompt read the prompt's K/V once instead of eight times. With few KV groups that walk is one task, so one
// core would run it while the others wait (HySparse2, one group: 9.5 ms for eight rows on a 32k prompt, with one
// thread or two): the prefix is then cut into parts along its keys, one task each, merged the same way; so is a
// lone decode row of a long context when the step has too few tasks for the threads.
//
// Sliding windows (`window_tiled`, HySparse's SWA branch): the same walk over the one key range a tile of rows'
// windows cover, each query vector skipping the keys before its window as it skips those after its position, with
// sinks and no block scores.

// ATen and op registration only, not torch/extension.h: see cpu_ext.py.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <omp.h>

#include "../cpu_gate.h"
#include "../cpu_tile.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace {

// Rows per task: each tile of keys is loaded and transposed once for all of a task's query vectors, so a taller
// task spends less on that per query vector (16 -> 64 rows, one core: 512 prefill rows on 2048 keys 45 -> 39 ms,
// 1024 rows on 8192 keys 403 -> 335 ms), most of all with few heads per KV group: 2,048 prefill rows on 8,192
// keys, 4 groups of 3 heads, one core, 549 ms at 64 rows and 483 at 256
// (benchmarks/results/attention_micro_2026-12-06_0156.md, _0203.md). A tile is as tall as that while the step
// still gives every thread two tasks (`tile_rows`). Not with logits: a task writes a row of logits per query vector
// at every key tile, and 12 heads x 227 rows of such streams made the token oracle's chunk slower than 64 rows do
// (789 against 706 ms, _0202_tall_logit_tiles.md, _0203.md).
constexpr int64_t ORACLE_TILE_ROWS = 256, ORACLE_MIN_TILE_ROWS = 64;

// Keys per tile: twice the kernels' default, which halves the per-tile work of each query vector (its tile max,
// the exp sum's reduction, the running max's update, its accumulators' loads and stores) against the same FMAs.
constexpr int64_t OKEYS = 64;
// Query vectors scored, weighed and accumulated together per tile of keys: their scores are 4 KiB of scratch (a
// 256-row task's scores were 196 KiB), and a chunk whose rows all end before the tile is skipped whole.
constexpr int64_t QCHUNK = 16;
// A shared prefix (or a lone long row) is cut into parts until the step has two tasks per thread, none shorter
// than this many keys (a part's state is merged once per row, query vector and part), at most MAX_PREFIX_PARTS.
constexpr int64_t PREFIX_PART_MIN_KEYS = 2048, MAX_PREFIX_PARTS = 16;
// Rows per task of a sliding window: a tile of r consecutive rows walks window + r - 1 keys, of which each row
// attends `window`; each chunk of its query vectors scores only its rows' band of a key tile, and 16 or 64 rows did
// no better than 32 (benchmarks/results/experiments/shared_decode_2026-12-07.md).
constexpr int64_t WINDOW_TILE_ROWS = 32;

inline int64_t tile_rows(int64_t rows, int64_t groups, bool logits) {
  if (logits) return ORACLE_MIN_TILE_ROWS;
  const int64_t per_task = rows * groups / (2 * std::max(1, at::get_num_threads()));
  return std::clamp<int64_t>(per_task, ORACLE_MIN_TILE_ROWS, ORACLE_TILE_ROWS);
}

struct Problem {
  const float* q;       // [N, H, D]
  const float* kv;      // pages of [G, page, 2D]
  const int32_t* bt;    // [R, max_pages]
  const int64_t* reqs;  // [N]
  const int64_t* pos;   // [N]
  float* out;           // [N, H, D]
  int32_t* ids;         // [N, G, topk] at row stride s_ids
  float* scores;        // [N, G, n_scores] or nullptr
  float* logits;        // [N, H, max_len] or nullptr: the token oracle's logits (-inf past each row's position)
  float* lse;           // [N, H] with logits
  float* reduced;       // [N, G, max_len] or nullptr: the token oracle's reduced probabilities R (second pass)
  bool reduce_sum;      // with `reduced`: R = sum over the group's heads, else max
  int64_t heads, groups, page, block, topk, n_scores, max_len, s_page, s_group, s_tok, s_bt, s_q, s_ids;
  float scale;
  int64_t window = 0;            // > 0: each row attends only [pos - window + 1, pos] (`window_tiled`)
  const float* sinks = nullptr;  // [H] sink logits (`window_tiled`), or none
  Gate gate = {};                // the output gate (`window_tiled`, `cpu_gate.h`), or none
};

struct Task {
  int64_t row0, rows, group;
  int64_t begin, keys;     // keys [begin, keys): keys is the tile's longest context (its largest position + 1)
  const int64_t* row_ids;  // the rows when not consecutive (a shared prefix): row_ids[r], else row0 + r
  int64_t slot0, part;     // split rows (see `Partials`): row r's slot is slot0 + r, `part` its key range; slot0
                           // -1 when not split
  int64_t row(int64_t r) const { return row_ids != nullptr ? row_ids[r] : row0 + r; }
};

// The partial states of rows whose keys are split (shared prefix, own tail): per row, group and part (the
// prefix's parts 0 .. parts - 2 in key order, then the tail) and per query vector of the group,
// [m, l, acc[D], u[nb]] at a stride of 2 + D + nb. A part with no keys for a row keeps the empty state.
struct Partials {
  int64_t groups, per_group, nb, stride, parts;
  std::vector<float> data;
  std::vector<int64_t> rows;  // the split rows, in slot order
  void init(int64_t groups_, int64_t per_group_, int64_t dim, int64_t nb_, int64_t parts_) {
    groups = groups_, per_group = per_group_, nb = nb_, stride = 2 + dim + nb_, parts = parts_;
    data.resize(rows.size() * groups * parts * per_group * stride);
    // the empty state (a tail with no keys merges as nothing): m = -inf, l = 0, acc = 0, u = -inf
    for (size_t x = 0; x < data.size(); x += stride) {
      data[x] = NEG_INF;
      data[x + 1] = 0.f;
      std::fill(data.begin() + x + 2, data.begin() + x + 2 + dim, 0.f);
      std::fill(data.begin() + x + 2 + dim, data.begin() + x + stride, NEG_INF);
    }
  }
  float* at(int64_t slot, int64_t g, int64_t part) {
    return data.data() + ((slot * groups + g) * parts + part) * per_group * stride;
  }
};

// The task's keys [k0, k0 + count) as pointers into its pages (each key's value follows it, DIM floats on).
inline void tile_keys(const Problem& pb, const Task& tk, int64_t k0, int64_t count, const float** kp) {
  const int32_t* pages = pb.bt + pb.reqs[tk.row(0)] * pb.s_bt;  // a shared prefix: the same pages for all rows
  const float* base = pb.kv + tk.group * pb.s_group;
  for (int64_t j = 0, pg = k0 / pb.page, off = k0 - pg * pb.page; j < count; ++j) {
    kp[j] = base + pages[pg] * pb.s_page + off * pb.s_tok;
    if (++off == pb.page) off = 0, ++pg;
  }
}

// Scores of query vectors [c0, c1) against a tile of keys starting at k0 (kp, or kt transposed where not
// `direct`), only over the chunk's band of the tile: from its rows' first key (`low`, a window's first position;
// none: 0) to their last position (`lim`), in whole 16-key vectors, written to s [c1 - c0, OKEYS] at columns
// [j0, j1) (the others untouched; j1 = the band's end, not rounded). False, scoring nothing, when every key of the
// tile is past or before every one of those rows. A 32-row window tile walks 159 keys for rows that attend 128,
// its chunks' bands about 144.
template <int DIM>
inline bool score_chunk(const float* qs, const float* lim, const float* low, int64_t c0, int64_t c1, int64_t k0,
                        bool direct, const float* const* kp, int64_t count, const float* kt, float* s, int64_t& j0,
                        int64_t& j1) {
  const int64_t last = static_cast<int64_t>(*std::max_element(lim + c0, lim + c1)) - k0;
  const int64_t first = low == nullptr ? -k0 : static_cast<int64_t>(*std::min_element(low + c0, low + c1)) - k0;
  if (last < 0 || first >= count) return false;
  j0 = std::max<int64_t>(first, 0) / 16 * 16;
  j1 = std::min(count, last + 1);
  if (direct) {
    score_direct<DIM, OKEYS>(qs + c0 * DIM, c1 - c0, kp + j0, j1 - j0, s + j0);
  } else {
    score_tiled_range<DIM, OKEYS>(qs + c0 * DIM, c1 - c0, kt, s, j0, std::min<int64_t>(OKEYS, (j1 + 15) / 16 * 16));
  }
  return true;
}

// One row's outputs, Eq. 3 scores (group max over heads) and top-k from its final state: the group's query
// vectors' m, l (stride 1), acc (stride DIM) and block maxima u (stride nb). score / order: nb floats / ints.
template <int DIM>
void finish_row(const Problem& pb, int64_t row, int64_t group, const float* m, const float* l, const float* acc,
                const float* u, int64_t nb, float* score, int32_t* order) {
  const int64_t per_group = pb.heads / pb.groups;
  const int64_t n_vis = pb.pos[row] / pb.block + 1;  // blocks holding at least one visible key
  std::fill(score, score + n_vis, 0.f);
  for (int64_t p = 0; p < per_group; ++p) {
    const float lse = m[p] + std::log(l[p]);
    float inv = 1.f / l[p];
    if (pb.sinks != nullptr) {  // the sink joins the denominator, in a stable form (as the sparse kernel's rows)
      const float sink = pb.sinks[group * per_group + p], top = std::max(m[p], sink), keep = std::exp(m[p] - top);
      inv = keep / (l[p] * keep + std::exp(sink - top));
    }
    const int64_t head = group * per_group + p;
    store_gated(pb.gate, row, head, acc + p * DIM, inv, pb.out + (row * pb.heads + head) * DIM, DIM);
    for (int64_t b = 0; b < n_vis; ++b) score[b] = std::max(score[b], std::exp(u[p * nb + b] - lse));
    if (pb.logits != nullptr) {
      pb.lse[row * pb.heads + head] = lse;
      float* z = pb.logits + (row * pb.heads + head) * pb.max_len;
      std::fill(z + pb.pos[row] + 1, z + pb.max_len, NEG_INF);
    }
  }
  if (pb.scores != nullptr) {
    float* sc = pb.scores + (row * pb.groups + group) * pb.n_scores;
    for (int64_t b = 0; b < pb.n_scores; ++b) sc[b] = b < n_vis ? score[b] : 0.f;
  }
  // top-k over the visible blocks: best first, ties to the smaller id; written ascending, -1 padded
  const int64_t k = std::min(pb.topk, n_vis);
  std::iota(order, order + n_vis, 0);
  std::partial_sort(order, order + k, order + n_vis, [&](int32_t a, int32_t b) {
    return score[a] > score[b] || (score[a] == score[b] && a < b);
  });
  std::sort(order, order + k);
  int32_t* dst = pb.ids + row * pb.s_ids + group * pb.topk;
  for (int64_t j = 0; j < pb.topk; ++j) dst[j] = j < k ? order[j] : -1;
}

// The token oracle's second pass over a task's keys, once its rows' statistics are final (no split rows): every
// key's probability under each query vector, exp(z - lse), reduced over the group's heads (max or sum) straight into
// R [N, G, max_len]. It scores the keys again instead of writing every head's logits in the first pass: a prefill
// chunk's logits (12 heads x 2,048 rows x 8k keys, 805 MB) cost more to write and read back than the dot products.
// For `max`, exp is monotone: R = exp(max over heads of (z - lse)), as `token_select` computes it from logits.
template <int DIM>
void reduce_pass(const Problem& pb, const Task& tk, int64_t nq, const float* qs, float* kt, float* s, const float* m,
                 const float* l, const float* lim) {
  const int64_t per_group = pb.heads / pb.groups;
  const bool direct = nq <= DIRECT_MAX;
  std::vector<float> lse(nq);
  for (int64_t i = 0; i < nq; ++i) lse[i] = m[i] + std::log(l[i]);
  const float* kp[OKEYS];
  for (int64_t k0 = tk.begin; k0 < tk.keys; k0 += OKEYS) {
    const int64_t count = std::min(OKEYS, tk.keys - k0);
    tile_keys(pb, tk, k0, count, kp);
    if (!direct) transpose_keys<DIM, OKEYS>(kp, count, kt);
    for (int64_t c0 = 0; c0 < nq; c0 += QCHUNK) {
      const int64_t c1 = std::min(nq, c0 + QCHUNK);
      int64_t j0, j1;  // no window: the band runs from the tile's first key to the chunk's last position
      if (!score_chunk<DIM>(qs, lim, nullptr, c0, c1, k0, direct, kp, count, kt, s, j0, j1)) continue;
      for (int64_t i = c0; i < c1; ++i) {
        const int64_t visible = std::min<int64_t>(count, static_cast<int64_t>(lim[i]) - k0 + 1);
        if (visible <= 0) continue;
        const float* si = s + (i - c0) * OKEYS;
        const int64_t p = i % per_group;  // a row's heads come in order, the first one writes
        float* r = pb.reduced + (tk.row(i / per_group) * pb.groups + tk.group) * pb.max_len + k0;
        const float c = lse[i];
        if (pb.reduce_sum) {
          int64_t j = 0;
          for (; j + 8 <= visible; j += 8) {
            const v8 e = exp8(load8(si + j) - splat(c));
            store8(r + j, p == 0 ? e : load8(r + j) + e);
          }
          for (; j < visible; ++j) {
            const float e = exp8(splat(si[j] - c))[0];
            r[j] = p == 0 ? e : r[j] + e;
          }
        } else {
          for (int64_t j = 0; j < visible; ++j) r[j] = p == 0 ? si[j] - c : std::max(r[j], si[j] - c);
        }
      }
    }
  }
  if (pb.reduce_sum) return;
  for (int64_t r = 0; r < tk.rows; ++r) {  // max: the probabilities of the reduced logits
    const int64_t row = tk.row(r), len = pb.pos[row] + 1;
    float* x = pb.reduced + (row * pb.groups + tk.group) * pb.max_len;
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) store8(x + j, exp8(load8(x + j)));
    for (; j < len; ++j) x[j] = exp8(splat(x[j]))[0];
  }
}

template <int DIM>
void run_task(const Problem& pb, const Task& tk, Partials& parts, std::vector<float>& buf) {
  const int64_t per_group = pb.heads / pb.groups, nq = tk.rows * per_group;
  const int64_t nb = (tk.keys + pb.block - 1) / pb.block;
  const bool direct = nq <= DIRECT_MAX;
  // scratch: queries, transposed keys, a chunk's scores, accumulators, running max / sum, block maxima, limits
  const size_t need = nq * DIM + DIM * OKEYS + QCHUNK * OKEYS + nq * DIM + 2 * nq + nq * nb + 2 * nq;
  if (buf.size() < need) buf.resize(need);
  float* qs = buf.data();
  float* kt = qs + nq * DIM;
  float* s = kt + DIM * OKEYS;
  float* acc = s + QCHUNK * OKEYS;
  float* m = acc + nq * DIM;
  float* l = m + nq;
  float* u = l + nq;
  float* lim = u + nq * nb;  // each query vector's position, as a float index bound
  float* low = lim + nq;     // its first key: 0, or its window's first position
  const float* kp[OKEYS];
  const float* vp[OKEYS];
  int64_t run_at[OKEYS + 1], run_b[OKEYS];
  float* acc_of[QCHUNK];  // the query vectors of a chunk that a tile of keys concerns: accumulators and weights
  const float* w_of[QCHUNK];
  for (int64_t r = 0; r < tk.rows; ++r) {
    const int64_t row = tk.row(r);
    for (int64_t p = 0; p < per_group; ++p) {
      const float* src = pb.q + row * pb.s_q + (tk.group * per_group + p) * DIM;
      float* dst = qs + (r * per_group + p) * DIM;
      for (int d = 0; d < DIM; ++d) dst[d] = src[d] * pb.scale;
      lim[r * per_group + p] = static_cast<float>(pb.pos[row]);
      const int64_t first = pb.window > 0 ? std::max<int64_t>(0, pb.pos[row] - pb.window + 1) : 0;
      low[r * per_group + p] = static_cast<float>(first);
    }
  }
  std::fill(acc, acc + nq * DIM, 0.f);
  std::fill(m, m + nq, NEG_INF);
  std::fill(l, l + nq, 0.f);
  std::fill(u, u + nq * nb, NEG_INF);
  const int32_t* pages = pb.bt + pb.reqs[tk.row(0)] * pb.s_bt;  // a shared prefix: the same pages for all rows
  const float* base = pb.kv + tk.group * pb.s_group;
  for (int64_t k0 = tk.begin; k0 < tk.keys; k0 += OKEYS) {
    const int64_t count = std::min(OKEYS, tk.keys - k0);
    // Keys, values and blocks of the tile, with two divisions per tile instead of two per key (and one per key
    // and query vector for the blocks). `tile_keys` walks the pages alone; this walk also finds the tile's values
    // and block runs in the same pass (two passes: 497 and 506 ms against 470 and 413 on a 2,048-row 8k prefill chunk).
    int64_t nruns = 0;  // the tile's runs of keys in one block: keys [run_at[x], run_at[x + 1]) are in block run_b[x]
    for (int64_t j = 0, pg = k0 / pb.page, off = k0 - pg * pb.page, b = k0 / pb.block, boff = k0 - b * pb.block;
         j < count; ++j) {
      kp[j] = base + pages[pg] * pb.s_page + off * pb.s_tok;
      vp[j] = kp[j] + DIM;
      if (j == 0 || boff == 0) run_at[nruns] = j, run_b[nruns++] = b;
      if (++off == pb.page) off = 0, ++pg;
      if (++boff == pb.block) boff = 0, ++b;
    }
    run_at[nruns] = count;
    if (!direct) transpose_keys<DIM, OKEYS>(kp, count, kt);
    for (int64_t c0 = 0; c0 < nq; c0 += QCHUNK) {
      const int64_t c1 = std::min(nq, c0 + QCHUNK);
      int64_t j0, j1;  // the chunk's band of the tile: scored, weighed and summed only there
      if (!score_chunk<DIM>(qs, lim, low, c0, c1, k0, direct, kp, count, kt, s, j0, j1)) continue;
      int64_t na = 0;
      for (int64_t i = c0; i < c1; ++i) {
        const int64_t visible = std::min<int64_t>(count, static_cast<int64_t>(lim[i]) - k0 + 1);
        const int64_t before = static_cast<int64_t>(low[i]) - k0;  // keys of the tile before the row's window
        if (visible <= 0 || before >= visible) continue;  // every key of the tile is past or before this row
        float* si = s + (i - c0) * OKEYS;
        float* ui = u + i * nb;
        for (int64_t j = 0; j < before; ++j) si[j] = NEG_INF;
        // Each block's running maximum, a run at a time in a register: one store per run, not a dependent
        // load and store per key (that chain took a third of a prefill tile).
        float mt = m[i];
        if (visible == OKEYS && nruns == 1) {  // most tiles: every key visible, one block
          const float mb = max_tile<OKEYS>(si);
          ui[run_b[0]] = std::max(ui[run_b[0]], mb);
          mt = std::max(mt, mb);
        } else {
          for (int64_t j = visible; j < OKEYS; ++j) si[j] = NEG_INF;
          for (int64_t x = 0; x < nruns && run_at[x] < visible; ++x) {
            float mb = NEG_INF;
            const int64_t stop = run_at[x + 1];
#pragma omp simd reduction(max : mb)
            for (int64_t j = run_at[x]; j < stop; ++j) mb = si[j] > mb ? si[j] : mb;
            ui[run_b[x]] = std::max(ui[run_b[x]], mb);
            mt = std::max(mt, mb);
          }
        }
        if (pb.logits != nullptr) {  // the token oracle ranks keys by their exact logits
          const int64_t r = i / per_group, h = tk.group * per_group + i % per_group;
          std::copy(si, si + visible, pb.logits + (tk.row(r) * pb.heads + h) * pb.max_len + k0);
        }
        // the whole tile at once; exactly 0 past the row's position
        online_rescale<DIM>(mt, exp_tile<OKEYS>(si, mt), m[i], l[i], acc + i * DIM);
        acc_of[na] = acc + i * DIM;
        w_of[na++] = si + j0;
      }
      accumulate_many<DIM>(acc_of, w_of, na, vp + j0, j1 - j0);  // weights are 0 outside each row's keys
    }
  }
  if (pb.reduced != nullptr) reduce_pass<DIM>(pb, tk, nq, qs, kt, s, m, l, lim);
  if (tk.slot0 >= 0) {  // split rows: the state goes to their slots, merged in `finish_split`
    for (int64_t r = 0; r < tk.rows; ++r) {
      float* st = parts.at(tk.slot0 + r, tk.group, tk.part);
      for (int64_t p = 0; p < per_group; ++p, st += parts.stride) {
        const int64_t i = r * per_group + p;
        st[0] = m[i];
        st[1] = l[i];
        std::copy(acc + i * DIM, acc + (i + 1) * DIM, st + 2);
        std::copy(u + i * nb + tk.begin / pb.block, u + (i + 1) * nb, st + 2 + DIM + tk.begin / pb.block);
      }
    }
    return;
  }
  std::vector<float> score(nb);
  std::vector<int32_t> order(nb);
  for (int64_t r = 0; r < tk.rows; ++r)
    finish_row<DIM>(pb, tk.row(r), tk.group, m + r * per_group, l + r * per_group, acc + r * per_group * DIM,
                    u + r * per_group * nb, nb, score.data(), order.data());
}

// A split row's parts merged by log-sum-exp (block maxima by max), then its outputs and top-k.
template <int DIM>
void finish_split(const Problem& pb, Partials& parts, int64_t slot, int64_t group) {
  const int64_t per_group = pb.heads / pb.groups, nb = parts.nb;
  std::vector<float> m(per_group), l(per_group, 0.f), acc(per_group * DIM, 0.f), u(per_group * nb, NEG_INF),
      score(nb);
  std::vector<int32_t> order(nb);
  for (int64_t p = 0; p < per_group; ++p) {
    float mx = NEG_INF;
    for (int64_t x = 0; x < parts.parts; ++x) mx = std::max(mx, parts.at(slot, group, x)[p * parts.stride]);
    m[p] = mx;  // finite: the prefix's first part holds keys
    for (int64_t x = 0; x < parts.parts; ++x) {
      const float* a = parts.at(slot, group, x) + p * parts.stride;
      const float f = std::exp(a[0] - mx);  // 0 for an empty part
      l[p] += a[1] * f;
      for (int d = 0; d < DIM; ++d) acc[p * DIM + d] += a[2 + d] * f;
      for (int64_t b = 0; b < nb; ++b) u[p * nb + b] = std::max(u[p * nb + b], a[2 + DIM + b]);
    }
  }
  finish_row<DIM>(pb, parts.rows[slot], group, m.data(), l.data(), acc.data(), u.data(), nb, score.data(),
                  order.data());
}

template <int DIM>
void run_all(const Problem& pb, const std::vector<Task>& tasks, Partials& parts) {
  const int64_t merges = static_cast<int64_t>(parts.rows.size()) * pb.groups;
  // dynamic scheduling, longest tasks first: prefill tiles differ in length (causal), decode rows too
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < static_cast<int64_t>(tasks.size()); ++t) run_task<DIM>(pb, tasks[t], parts, buf);
#pragma omp for schedule(dynamic, 1)
    for (int64_t x = 0; x < merges; ++x) finish_split<DIM>(pb, parts, x / pb.groups, x % pb.groups);
  }
}

// Both ops' checks, tasks and run (see `oracle_tiled` and `oracle_tiled_reduced` below).
void run_oracle(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& block_table, const at::Tensor& reqs,
                const at::Tensor& pos, int64_t block, int64_t topk, double scale, at::Tensor& out, at::Tensor& ids,
                at::Tensor& scores, at::Tensor& logits, at::Tensor& lse, at::Tensor& reduced, bool reduce_sum,
                int64_t window = 0, const float* sinks = nullptr, const at::Tensor& gate = {},
                bool accumulate = false) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q: expected [N, H, D] float32 with contiguous heads");
  TORCH_CHECK(kv.dim() == 4 && kv.scalar_type() == at::kFloat && kv.stride(3) == 1,
              "kv: expected [pages, G, page, 2D] float32 with a contiguous last dim");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1,
              "block_table: expected int32 with contiguous rows");
  TORCH_CHECK(reqs.scalar_type() == at::kLong && pos.scalar_type() == at::kLong && reqs.is_contiguous() &&
                  pos.is_contiguous(), "reqs, pos: contiguous int64");
  const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2), groups = kv.size(1);
  TORCH_CHECK(kv.size(3) == 2 * dim && heads % groups == 0, "inconsistent shapes of q and kv");
  TORCH_CHECK(reqs.size(0) == n && pos.size(0) == n, "reqs, pos: one entry per row");
  TORCH_CHECK(block >= 1 && topk >= 0, "block size must be positive, topk non-negative");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == n &&
                  out.size(1) == heads && out.size(2) == dim, "out: expected contiguous [N, H, D] float32");
  TORCH_CHECK(ids.scalar_type() == at::kInt && ids.dim() == 3 && ids.size(0) == n && ids.size(1) == groups &&
                  ids.size(2) == topk && (topk == 0 || (ids.stride(2) == 1 && ids.stride(1) == topk)),
              "ids: expected [N, G, topk] int32 with contiguous (G, topk) dims");
  const bool has_scores = scores.numel() > 0;
  if (has_scores)
    TORCH_CHECK(scores.scalar_type() == at::kFloat && scores.is_contiguous() && scores.size(0) == n &&
                    scores.size(1) == groups, "scores: expected contiguous [N, G, NB] float32");
  const bool has_logits = logits.numel() > 0;
  if (has_logits) {
    TORCH_CHECK(logits.scalar_type() == at::kFloat && logits.is_contiguous() && logits.dim() == 3 &&
                    logits.size(0) == n && logits.size(1) == heads, "logits: expected contiguous [N, H, L] float32");
    TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.is_contiguous() && lse.numel() == n * heads,
                "lse: expected contiguous [N, H] float32");
    const int64_t* ps = pos.data_ptr<int64_t>();
    TORCH_CHECK(n == 0 || *std::max_element(ps, ps + n) < logits.size(2),
                "logits: a row's position is past the last column");
  }
  const bool has_reduced = reduced.numel() > 0;
  if (has_reduced) {
    TORCH_CHECK(!has_logits, "reduced: not with logits");
    TORCH_CHECK(reduced.scalar_type() == at::kFloat && reduced.is_contiguous() && reduced.dim() == 3 &&
                    reduced.size(0) == n && reduced.size(1) == groups,
                "reduced: expected contiguous [N, G, L] float32");
    const int64_t* ps = pos.data_ptr<int64_t>();
    TORCH_CHECK(n == 0 || *std::max_element(ps, ps + n) < reduced.size(2),
                "reduced: a row's position is past the last column");
  }
  const Problem pb{q.data_ptr<float>(), kv.data_ptr<float>(), block_table.data_ptr<int32_t>(),
                   reqs.data_ptr<int64_t>(), pos.data_ptr<int64_t>(), out.data_ptr<float>(), ids.data_ptr<int32_t>(),
                   has_scores ? scores.data_ptr<float>() : nullptr, has_logits ? logits.data_ptr<float>() : nullptr,
                   has_logits ? lse.data_ptr<float>() : nullptr, has_reduced ? reduced.data_ptr<float>() : nullptr,
                   reduce_sum, heads, groups, kv.size(2), block, topk, has_scores ? scores.size(2) : 0,
                   has_logits ? logits.size(2) : (has_reduced ? reduced.size(2) : 0), kv.stride(0), kv.stride(1),
                   kv.stride(2), block_table.stride(0), q.stride(0), ids.stride(0), static_cast<float>(scale),
                   window, sinks, gate_of(gate, accumulate, n, heads, dim)};
  // tiles of consecutive rows of one request (a request's rows are contiguous in a vLLM batch)
  const int64_t* rq = pb.reqs;
  const int64_t* ps = pb.pos;
  const int64_t page = pb.page;
  std::vector<Task> tasks;
  std::vector<int64_t> singles;  // rows alone in their tile (decode rows): candidates for a shared prefix
  const int64_t tile = window > 0 ? WINDOW_TILE_ROWS : tile_rows(n, groups, has_logits);
  for (int64_t r0 = 0; r0 < n;) {
    int64_t r1 = r0 + 1, last = ps[r0];
    while (r1 < n && r1 - r0 < tile && rq[r1] == rq[r0]) last = std::max(last, ps[r1++]);
    if (window > 0) {  // a window walks its keys alone: no shared prefix, no split
      int64_t first = last;
      for (int64_t r = r0; r < r1; ++r) first = std::min(first, std::max<int64_t>(0, ps[r] - window + 1));
      for (int64_t g = 0; g < groups; ++g) tasks.push_back({r0, r1 - r0, g, first, last + 1, nullptr, -1, 0});
      r0 = r1;
      continue;
    }
    // (the second pass needs each row's final statistics in its own task: no split rows with `reduced`)
    if (r1 - r0 == 1 && ps[r0] + 1 >= SHARED_MIN_KEYS && !has_reduced) {
      singles.push_back(r0);
    } else {
      for (int64_t g = 0; g < groups; ++g) tasks.push_back({r0, r1 - r0, g, 0, last + 1, nullptr, -1, 0});
    }
    r0 = r1;
  }
  // Shared prefixes (see `prefix_clusters`): a cluster's rows get consecutive slots; the prefix is walked once
  // per tile of its rows, each row's own tail alone (none when its keys end with the prefix). The tasks point
  // into parts.rows, so it is reserved up front and never moves.
  Partials parts;
  parts.rows.reserve(singles.size());
  int64_t nb_split = 0;
  const std::vector<PrefixCluster> clusters = prefix_clusters(singles, pb.bt, pb.s_bt, rq, ps, page);
  // The keys each cluster walks together: a shared prefix's pages, or a lone row's whole context.
  std::vector<int64_t> walked(clusters.size());
  int64_t walks = static_cast<int64_t>(tasks.size());  // long tasks of the step: prefill tiles and these walks
  for (size_t x = 0; x < clusters.size(); ++x) {
    const PrefixCluster& c = clusters[x];
    walked[x] = c.rows < 2 ? ps[singles[c.first]] + 1 : c.pages * page;
    walks += ((c.rows + tile - 1) / tile) * groups;
  }
  // How many parts each walk is cut into: enough for two tasks per thread (a lone decode row of a long context is
  // one task per KV group as well), none shorter than PREFIX_PART_MIN_KEYS. The tail is the part after the most
  // any cluster has.
  const int64_t want = 2 * std::max(1, at::get_num_threads());
  std::vector<int64_t> cuts(clusters.size(), 1);
  int64_t tail = 1;
  for (size_t x = 0; x < clusters.size(); ++x) {
    cuts[x] = std::clamp<int64_t>((want + walks - 1) / walks, 1,
                                  std::clamp<int64_t>(walked[x] / PREFIX_PART_MIN_KEYS, 1, MAX_PREFIX_PARTS));
    tail = std::max(tail, cuts[x]);
  }
  for (size_t x = 0; x < clusters.size(); ++x) {
    const PrefixCluster& c = clusters[x];
    if (c.rows < 2 && cuts[x] == 1) {
      const int64_t row = singles[c.first];
      for (int64_t g = 0; g < groups; ++g) tasks.push_back({row, 1, g, 0, ps[row] + 1, nullptr, -1, 0});
      continue;
    }
    const int64_t slot0 = static_cast<int64_t>(parts.rows.size()), slot1 = slot0 + c.rows, keys = walked[x];
    parts.rows.insert(parts.rows.end(), singles.begin() + c.first, singles.begin() + c.first + c.rows);
    // parts of whole key tiles, so that no tile is cut
    const int64_t span = ((keys + cuts[x] - 1) / cuts[x] + OKEYS - 1) / OKEYS * OKEYS;
    for (int64_t part = 0; part * span < keys; ++part)
      for (int64_t s0 = slot0; s0 < slot1; s0 += tile) {
        const int64_t rows = std::min(tile, slot1 - s0);
        for (int64_t g = 0; g < groups; ++g)
          tasks.push_back({-1, rows, g, part * span, std::min(keys, (part + 1) * span), parts.rows.data() + s0, s0,
                           part});
      }
    for (int64_t s = slot0; s < slot1; ++s) {
      const int64_t row = parts.rows[s];
      nb_split = std::max(nb_split, ps[row] / block + 1);
      if (ps[row] + 1 > keys)
        for (int64_t g = 0; g < groups; ++g) tasks.push_back({row, 1, g, keys, ps[row] + 1, nullptr, s, tail});
    }
  }
  parts.init(groups, heads / groups, dim, nb_split, tail + 1);
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) {
    return (a.keys - a.begin) * a.rows > (b.keys - b.begin) * b.rows;
  });
  switch (dim) {
#define HYSPARSE_DIM(D) \
  case D: run_all<D>(pb, tasks, parts); break;
    HYSPARSE_TILE_DIMS(HYSPARSE_DIM)
#undef HYSPARSE_DIM
    default: TORCH_CHECK(false, "oracle_tiled: head dim ", dim, " not compiled (see supported_dims)");
  }
}

// q [N, H, D] (rows with a contiguous last dim), kv [pages, G, page, 2D] float32 (K then V);
// reqs, pos [N] int64 (each row's request and position). Writes out [N, H, D] (contiguous float32),
// ids [N, G, topk] int32 (contiguous last two dims; e.g. a view of the index buffer) and, when
// `scores` is not empty, the block scores [N, G, n_scores] (0 past each row's visible blocks). When `logits`
// is not empty: the logits [N, H, max_len] (-inf past each row's position) and lse [N, H] as well, for the
// token oracle's selection (topk 0 and one block then make the rest nearly free).
void oracle_tiled(at::Tensor q, at::Tensor kv, at::Tensor block_table, at::Tensor reqs, at::Tensor pos, int64_t block,
                  int64_t topk, double scale, at::Tensor out, at::Tensor ids, at::Tensor scores, at::Tensor logits,
                  at::Tensor lse) {
  at::Tensor none = at::empty({0}, q.options());
  run_oracle(q, kv, block_table, reqs, pos, block, topk, scale, out, ids, scores, logits, lse, none, false);
}

// The token oracle's attention and reduced probabilities R [N, G, L] (the group's heads' exp(z - lse), max or sum;
// written for keys j <= each row's position) in two passes over each task's keys: out [N, H, D] as above.
void oracle_tiled_reduced(at::Tensor q, at::Tensor kv, at::Tensor block_table, at::Tensor reqs, at::Tensor pos,
                          double scale, bool reduce_sum, at::Tensor out, at::Tensor reduced) {
  TORCH_CHECK(reduced.dim() == 3 && reduced.size(2) > 0, "reduced: expected [N, G, L] with L > 0");
  at::Tensor ids = at::empty({q.size(0), kv.size(1), 0}, q.options().dtype(at::kInt));
  const at::TensorOptions f32 = q.options();
  at::Tensor scores = at::empty({0}, f32), logits = at::empty({0}, f32), lse = at::empty({0}, f32);
  run_oracle(q, kv, block_table, reqs, pos, reduced.size(2), 0, scale, out, ids, scores, logits, lse, reduced,
             reduce_sum);
}

// Sliding-window sink attention (HySparse's SWA branch): each row over its last `window` positions
// [pos - window + 1, pos] of its request's pages, sinks [H] float32 (or empty) joining every row's softmax; out as
// `oracle_tiled`'s (contiguous), no selection; gate and accumulate as `paged_sparse`'s (`cpu_gate.h`).
void window_tiled(at::Tensor q, at::Tensor kv, at::Tensor block_table, at::Tensor reqs, at::Tensor pos, int64_t window,
                  double scale, at::Tensor sinks, at::Tensor gate, bool accumulate, at::Tensor out) {
  TORCH_CHECK(window >= 1, "window_tiled: window must be positive");
  const bool has_sinks = sinks.numel() > 0;
  if (has_sinks) {
    TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.numel() == q.size(1), "sinks: expected [H] float32");
    sinks = sinks.contiguous();
  }
  at::Tensor ids = at::empty({q.size(0), kv.size(1), 0}, q.options().dtype(at::kInt));
  const at::TensorOptions f32 = q.options();
  at::Tensor scores = at::empty({0}, f32), logits = at::empty({0}, f32), lse = at::empty({0}, f32);
  at::Tensor reduced = at::empty({0}, f32);
  // one block spanning every position: one run per key tile, one block maximum per query vector (unused)
  run_oracle(q, kv, block_table, reqs, pos, std::numeric_limits<int32_t>::max(), 0, scale, out, ids, scores, logits,
             lse, reduced, false, window, has_sinks ? sinks.data_ptr<float>() : nullptr, gate, accumulate);
}

}  // namespace

#define HYSPARSE_DIM(D) D,
static std::vector<int64_t> supported_dims() { return {HYSPARSE_TILE_DIMS(HYSPARSE_DIM)}; }
#undef HYSPARSE_DIM

TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  // Oracle attention of every row over its request's pages, one tiled pass, top-k blocks of Eq. 3.
  m.def("oracle_tiled(Tensor q, Tensor kv, Tensor block_table, Tensor reqs, Tensor pos, int block, int topk, "
        "float scale, Tensor(a!) out, Tensor(b!) ids, Tensor(c!) scores, Tensor(d!) logits, Tensor(e!) lse) -> ()");
  // The token oracle's attention and reduced probabilities R, two passes per task (no per-head logits).
  m.def("oracle_tiled_reduced(Tensor q, Tensor kv, Tensor block_table, Tensor reqs, Tensor pos, float scale, "
        "bool reduce_sum, Tensor(a!) out, Tensor(b!) reduced) -> ()");
  // Sliding-window sink attention of every row over its last `window` positions, one tiled pass.
  m.def("window_tiled(Tensor q, Tensor kv, Tensor block_table, Tensor reqs, Tensor pos, int window, float scale, "
        "Tensor sinks, Tensor gate, bool accumulate, Tensor(a!) out) -> ()");
  // The head dims the switch above compiles.
  m.def("supported_dims() -> int[]", &supported_dims);
}

TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) {
  m.impl("oracle_tiled", &oracle_tiled);
  m.impl("oracle_tiled_reduced", &oracle_tiled_reduced);
  m.impl("window_tiled", &window_tiled);
}
