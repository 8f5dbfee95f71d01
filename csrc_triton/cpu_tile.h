// SPDX-License-Identifier: Apache-2.0
// The tile steps the C++ CPU kernels share: 8-float vectors, scores of a tile of keys for a set of query
// vectors (directly, or through a transposed [DIM, KEYS] copy of the keys so that one FMA scores 8 keys),
// and the weighted sum of a tile's values. DIM is a compile-time head dim, a multiple of 8.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

typedef float v8 __attribute__((vector_size(32)));
constexpr int64_t KEYS = 32;       // keys per tile (4 vectors of 8); the helpers below take others (KT)
constexpr int64_t TILE_ROWS = 16;  // rows per prefill task
constexpr int64_t DIRECT_MAX = 4;  // tasks with at most this many query vectors dot keys directly
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

inline v8 load8(const float* p) {
  v8 x;
  __builtin_memcpy(&x, p, sizeof(x));
  return x;
}
inline void store8(float* p, v8 x) { __builtin_memcpy(p, &x, sizeof(x)); }
inline v8 splat(float x) { return v8{x, x, x, x, x, x, x, x}; }
inline float hsum(v8 x) {
  return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}
// The same for any of the vector types (v8, and v16 where the CPU has AVX-512).
template <typename V>
inline V loadv(const float* p) {
  V x;
  __builtin_memcpy(&x, p, sizeof(x));
  return x;
}
template <typename V>
inline void storev(float* p, V x) {
  __builtin_memcpy(p, &x, sizeof(x));
}
template <typename V>
inline V splatv(float x) {
  return V{} + x;
}

#ifdef __AVX2__
#include <immintrin.h>
#endif

// exp of 8 floats, -inf (and anything below -87.3) -> exactly 0. GCC only calls glibc's vector expf under
// -ffinite-math-only, which the -inf masks rule out, so a scalar expf per key was the largest single cost of a
// decode row. Cody-Waite reduction x = n ln2 + r (explicit FMAs, which -ffast-math does not reassociate) and
// Cephes' degree-6 polynomial: within 2 ulp of expf on [-87.3, 88.3].
inline v8 exp8(v8 x) {
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 in = reinterpret_cast<__m256&>(x);
  const __m256 xc = _mm256_min_ps(_mm256_max_ps(in, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), xc);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
  y = _mm256_and_ps(y, _mm256_cmp_ps(in, _mm256_set1_ps(-87.3f), _CMP_GE_OQ));  // -inf, NaN-free masks -> 0
  return reinterpret_cast<v8&>(y);
#else
  v8 y;
  for (int i = 0; i < 8; ++i) y[i] = std::exp(x[i]);
  return y;
#endif
}

// [sum(a[0]), ..., sum(a[7])]: eight horizontal sums at once, as pairwise adds of shuffled halves (the hadd tree)
// rather than one reduction per vector.
inline v8 hsum8(const v8* a) {
  const auto hadd = [](v8 x, v8 y) {  // [x0+x1, x2+x3, y0+y1, y2+y3, x4+x5, x6+x7, y4+y5, y6+y7]
    return __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
  };
  const v8 u0 = hadd(hadd(a[0], a[1]), hadd(a[2], a[3]));  // [a0..a3 low halves' sums | high halves' sums]
  const v8 u1 = hadd(hadd(a[4], a[5]), hadd(a[6], a[7]));
  return __builtin_shufflevector(u0, u1, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(u0, u1, 4, 5, 6, 7, 12, 13, 14, 15);
}

// Scores of 8 keys for one query vector q (NV vectors V in registers): per key a vector of partial sums (eight
// independent FMA chains), folded to 8 floats, then `hsum8`.
template <int NV, typename V>
inline v8 score8(const V* q, const float* const* kp) {
  constexpr int W = sizeof(V) / sizeof(float);
  v8 part[8];
  for (int x = 0; x < 8; ++x) {
    V a = q[0] * loadv<V>(kp[x]);
    for (int c = 1; c < NV; ++c) a += q[c] * loadv<V>(kp[x] + W * c);
    if constexpr (W == 16) {
      part[x] = __builtin_shufflevector(a, a, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15);
    } else {
      part[x] = a;
    }
  }
  return hsum8(part);
}

// Scores of `count` keys (< KT), pointers `kp`, for `nq` query vectors `qs` [nq, DIM] -> s [nq, KT]; for the
// few query vectors of a decode tile, where a transposed copy of the keys would not pay for itself. Eight keys
// at a time per query vector (its vectors held in registers), the rest one at a time.
template <int DIM, typename V = v8, int64_t KT = KEYS>
void score_direct_v(const float* qs, int64_t nq, const float* const* kp, int64_t count, float* s) {
  constexpr int W = sizeof(V) / sizeof(float), NV = DIM / W;
  const int64_t full = count / 8 * 8;
  for (int64_t i = 0; i < nq; ++i) {
    V q[NV];
    for (int c = 0; c < NV; ++c) q[c] = loadv<V>(qs + i * DIM + W * c);
    for (int64_t j = 0; j < full; j += 8) store8(s + i * KT + j, score8<NV, V>(q, kp + j));
    for (int64_t j = full; j < count; ++j) {
      V a = q[0] * loadv<V>(kp[j]);
      for (int c = 1; c < NV; ++c) a += q[c] * loadv<V>(kp[j] + W * c);
      float t = 0.f;
      for (int x = 0; x < W; ++x) t += a[x];
      s[i * KT + j] = t;
    }
  }
}

// NQ query vectors' scores of a transposed tile kt [DIM, KT]: W keys per FMA (W floats a vector V), NQ x KT / W
// accumulators.
// NK: the vectors of keys scored per call (all KT keys by default); a narrower call scores the keys from kt[0]
// and writes them from s[0], both still KT apart per row (the caller offsets both pointers).
template <int DIM, int NQ, typename V = v8, int64_t KT = KEYS, int NK = KT / (sizeof(V) / sizeof(float))>
inline void score_n(const float* qs, const float* kt, float* s) {
  constexpr int W = sizeof(V) / sizeof(float);
  V a[NQ][NK];
  for (int q = 0; q < NQ; ++q)
    for (int c = 0; c < NK; ++c) a[q][c] = splatv<V>(0.f);
  for (int d = 0; d < DIM; ++d) {
#ifdef __AVX512F__
    // 32 registers hold the NQ broadcasts and each key vector once. Written as below, GCC reloaded every key
    // vector as a memory operand of each of its NQ FMAs (16 loads per 16 FMAs on AVX-512, which bound the loop):
    // the empty asm pins it in a register. The oracle's 2,048-row prefill chunk at 8k: 314 -> 255 ms, AMD EPYC
    // with AVX-512 (benchmarks/results/experiments/avx512_2026-12-07.md). AVX2's 16 registers do not fit it (the
    // same chunk 331 -> 428 ms): there, the loop below.
    V x[NQ];
    for (int q = 0; q < NQ; ++q) x[q] = splatv<V>(qs[q * DIM + d]);
    for (int c = 0; c < NK; ++c) {
      V k = loadv<V>(kt + d * KT + c * W);
      asm("" : "+v"(k));
      for (int q = 0; q < NQ; ++q) a[q][c] += x[q] * k;
    }
#else
    V k[NK];
    for (int c = 0; c < NK; ++c) k[c] = loadv<V>(kt + d * KT + c * W);
    for (int q = 0; q < NQ; ++q) {
      const V x = splatv<V>(qs[q * DIM + d]);
      for (int c = 0; c < NK; ++c) a[q][c] += x * k[c];
    }
#endif
  }
  for (int q = 0; q < NQ; ++q)
    for (int c = 0; c < NK; ++c) storev<V>(s + q * KT + c * W, a[q][c]);
}

#ifdef __AVX512F__
// 16-float vectors where the CPU has AVX-512: twice the work per FMA of the prefill tiles' inner loops.
typedef float v16 __attribute__((vector_size(64)));

// `exp8` on 16 floats: the same reduction and polynomial, with the scale by 2^n as one `vscalefps` (no
// exponent-bit arithmetic, hence no clamp of the input; an overflow gives +inf as expf does).
inline v16 exp16(v16 x) {
  const __m512 in = reinterpret_cast<__m512&>(x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(in, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), in);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  // anything below -87.3 (-inf, for which the polynomial gives NaN) and NaN -> exactly 0, as `exp8`
  const __mmask16 keep = _mm512_cmp_ps_mask(in, _mm512_set1_ps(-87.3f), _CMP_GE_OQ);
  const __m512 out = _mm512_maskz_scalef_ps(keep, p, n);
  return reinterpret_cast<const v16&>(out);
}

// exp of a tile's KT scores in place (s[j] - mt); returns their sum. Exactly 0 where s[j] is -inf.
template <int64_t KT = KEYS>
inline float exp_tile(float* s, float mt) {
  v16 total = splatv<v16>(0.f);
  for (int64_t j = 0; j < KT; j += 16) {
    const v16 w = exp16(loadv<v16>(s + j) - mt);
    storev<v16>(s + j, w);
    total += w;
  }
  return _mm512_reduce_add_ps(reinterpret_cast<__m512&>(total));
}

// The maximum of a tile's KT scores.
template <int64_t KT = KEYS>
inline float max_tile(const float* s) {
  __m512 a = _mm512_max_ps(_mm512_loadu_ps(s), _mm512_loadu_ps(s + 16));
  for (int64_t j = 32; j < KT; j += 16) a = _mm512_max_ps(a, _mm512_loadu_ps(s + j));
  return _mm512_reduce_max_ps(a);
}
#else
template <int64_t KT = KEYS>
inline float max_tile(const float* s) {
  v8 a = load8(s);
  for (int64_t j = 8; j < KT; j += 8) {
    const v8 b = load8(s + j);
    a = a > b ? a : b;
  }
  float m = a[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, a[i]);
  return m;
}

template <int64_t KT = KEYS>
inline float exp_tile(float* s, float mt) {
  v8 total = splat(0.f);
  for (int64_t j = 0; j < KT; j += 8) {
    const v8 w = exp8(load8(s + j) - splat(mt));
    store8(s + j, w);
    total += w;
  }
  return hsum(total);
}
#endif

#ifdef __AVX512F__
// One butterfly stage of a 16 x 16 transpose: rows x (index i, bit B of i clear) and y (i + B) swap bit B of the row
// index with bit B of the lane. After the four stages (B = 8, 4, 2, 1) row i holds what was column i.
template <int B>
inline void butterfly(v16& x, v16& y) {
  v16 lo, hi;
  if constexpr (B == 8) {
    lo = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    hi = __builtin_shufflevector(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  } else if constexpr (B == 4) {
    lo = __builtin_shufflevector(x, y, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    hi = __builtin_shufflevector(x, y, 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  } else if constexpr (B == 2) {
    lo = __builtin_shufflevector(x, y, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    hi = __builtin_shufflevector(x, y, 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  } else {
    lo = __builtin_shufflevector(x, y, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
    hi = __builtin_shufflevector(x, y, 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  }
  x = lo, y = hi;
}

template <int B>
inline void butterfly_stage(v16* r) {
  for (int i = 0; i < 16; ++i)
    if ((i & B) == 0) butterfly<B>(r[i], r[i + B]);
}
#endif

// kt [DIM, KT] = the tile's keys transposed: kt[d * KT + j] = kp[j][d] for j < count, 0 past it. Element by element
// this was two memory operations per float, which outweighed the scoring for the few query vectors of a decode row
// on a shared prefix; with AVX-512, 16 x 16 blocks go through registers (16 loads, 64 shuffles, 16 stores), with
// AVX2 8 x 8 blocks (8 loads, 24 shuffles, 8 stores; the block-sparse kernel's 2,048 prefill rows at 8k over
// random blocks took 2-11% less in alternating calls on the 2-core AMD EPYC, decode rows no change).
template <int DIM, int64_t KT = KEYS>
inline void transpose_keys(const float* const* kp, int64_t count, float* kt) {
#ifdef __AVX512F__
  if constexpr (DIM % 16 == 0 && KT % 16 == 0) {
    for (int64_t j0 = 0; j0 < KT; j0 += 16) {
      for (int d0 = 0; d0 < DIM; d0 += 16) {
        v16 r[16];
        for (int j = 0; j < 16; ++j) r[j] = j0 + j < count ? loadv<v16>(kp[j0 + j] + d0) : splatv<v16>(0.f);
        butterfly_stage<8>(r);
        butterfly_stage<4>(r);
        butterfly_stage<2>(r);
        butterfly_stage<1>(r);
        for (int d = 0; d < 16; ++d) storev<v16>(kt + (d0 + d) * KT + j0, r[d]);
      }
    }
    return;
  }
#elif defined(__AVX2__)
  if constexpr (DIM % 8 == 0 && KT % 8 == 0) {
    for (int64_t j0 = 0; j0 < KT; j0 += 8) {
      for (int d0 = 0; d0 < DIM; d0 += 8) {
        __m256 r[8];
        for (int j = 0; j < 8; ++j) r[j] = j0 + j < count ? _mm256_loadu_ps(kp[j0 + j] + d0) : _mm256_setzero_ps();
        __m256 t[8], u[8];
        for (int j = 0; j < 8; j += 2) {  // pairs of keys interleaved: t[j] dims 0,1 | 4,5, t[j + 1] dims 2,3 | 6,7
          t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
          t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
        }
        for (int h = 0; h < 8; h += 4) {  // four keys per dim within each 128-bit half
          u[h] = _mm256_shuffle_ps(t[h], t[h + 2], _MM_SHUFFLE(1, 0, 1, 0));
          u[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], _MM_SHUFFLE(3, 2, 3, 2));
          u[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], _MM_SHUFFLE(1, 0, 1, 0));
          u[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], _MM_SHUFFLE(3, 2, 3, 2));
        }
        for (int d = 0; d < 4; ++d) {  // keys 0-3 and 4-7 joined: dims d (low halves) and d + 4 (high halves)
          _mm256_storeu_ps(kt + (d0 + d) * KT + j0, _mm256_permute2f128_ps(u[d], u[d + 4], 0x20));
          _mm256_storeu_ps(kt + (d0 + d + 4) * KT + j0, _mm256_permute2f128_ps(u[d], u[d + 4], 0x31));
        }
      }
    }
    return;
  }
#endif
  for (int64_t j = 0; j < KT; ++j)
    for (int d = 0; d < DIM; ++d) kt[d * KT + j] = j < count ? kp[j][d] : 0.f;
}

// `score_direct_v` in 16-float vectors where the CPU has AVX-512 (half the FMAs per key), else 8-float ones.
template <int DIM, int64_t KT = KEYS>
void score_direct(const float* qs, int64_t nq, const float* const* kp, int64_t count, float* s) {
#ifdef __AVX512F__
  if constexpr (DIM % 16 == 0) return score_direct_v<DIM, v16, KT>(qs, nq, kp, count, s);
#endif
  score_direct_v<DIM, v8, KT>(qs, nq, kp, count, s);
}

// Same result as `score_direct` through a transposed tile kt [DIM, KT]: 8 (32-key tiles) or 4 query vectors at a
// time in 16-float vectors where the CPU has AVX-512 (16 accumulators either way, of 32 registers). AVX2 has 16
// registers: 6 query vectors x 16 keys (12 accumulators, 2 key vectors, a broadcast), then 2 x 32 keys. A whole
// 64-key tile per pair of query vectors held 16 accumulators and 8 key vectors, spilled to the stack: with that
// and `accumulate_many`'s four at a time, the token oracle's attention on 2,048 prefill rows at 8k took 628 ms,
// now 458 (2-core AMD EPYC, benchmarks/results/attention_micro_2026-12-06_1319_avx2_before.md, _1322_avx2_after).
template <int DIM, int64_t KT = KEYS>
void score_tiled(const float* qs, int64_t nq, const float* kt, float* s) {
  int64_t i = 0;
#ifdef __AVX512F__
  if constexpr (KT == 32)
    for (; i + 8 <= nq; i += 8) score_n<DIM, 8, v16, KT>(qs + i * DIM, kt, s + i * KT);
  for (; i + 4 <= nq; i += 4) score_n<DIM, 4, v16, KT>(qs + i * DIM, kt, s + i * KT);
  for (; i + 2 <= nq; i += 2) score_n<DIM, 2, v8, KT>(qs + i * DIM, kt, s + i * KT);
  if (i < nq) score_n<DIM, 1, v8, KT>(qs + i * DIM, kt, s + i * KT);
#else
  static_assert(KT % 32 == 0, "AVX2 tiles: a multiple of 32 keys");
  for (; i + 6 <= nq; i += 6)
    for (int64_t c = 0; c < KT; c += 16) score_n<DIM, 6, v8, KT, 2>(qs + i * DIM, kt + c, s + i * KT + c);
  for (; i + 2 <= nq; i += 2)
    for (int64_t c = 0; c < KT; c += 32) score_n<DIM, 2, v8, KT, 4>(qs + i * DIM, kt + c, s + i * KT + c);
  if (i < nq)
    for (int64_t c = 0; c < KT; c += 32) score_n<DIM, 1, v8, KT, 4>(qs + i * DIM, kt + c, s + i * KT + c);
#endif
}

// `score_tiled` on NC of the tile's columns (a multiple of 16): kt and s point at the first, rows still KT apart.
template <int DIM, int64_t KT, int NC>
void score_tiled_cols(const float* qs, int64_t nq, const float* kt, float* s) {
  static_assert(NC % 16 == 0 && NC <= KT, "whole 16-key vectors of the tile");
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 4 <= nq; i += 4) score_n<DIM, 4, v16, KT, NC / 16>(qs + i * DIM, kt, s + i * KT);
  for (; i < nq; ++i) score_n<DIM, 1, v16, KT, NC / 16>(qs + i * DIM, kt, s + i * KT);
#else
  for (; i + 6 <= nq; i += 6)
    for (int64_t c = 0; c < NC; c += 16) score_n<DIM, 6, v8, KT, 2>(qs + i * DIM, kt + c, s + i * KT + c);
  for (; i < nq; ++i)
    for (int64_t c = 0; c < NC; c += 16) score_n<DIM, 1, v8, KT, 2>(qs + i * DIM, kt + c, s + i * KT + c);
#endif
}

// The scores of the tile's keys [j0, j1) only (multiples of 16; the rest of s untouched): the keys a chunk of
// sliding-window rows can attend are a band of the tile.
template <int DIM, int64_t KT>
void score_tiled_range(const float* qs, int64_t nq, const float* kt, float* s, int64_t j0, int64_t j1) {
  static_assert(KT == 64, "a 64-key tile: 1-4 vectors of 16 keys");
  switch ((j1 - j0) / 16) {
    case 1: return score_tiled_cols<DIM, KT, 16>(qs, nq, kt + j0, s + j0);
    case 2: return score_tiled_cols<DIM, KT, 32>(qs, nq, kt + j0, s + j0);
    case 3: return score_tiled_cols<DIM, KT, 48>(qs, nq, kt + j0, s + j0);
    default: return score_tiled<DIM, KT>(qs, nq, kt, s);
  }
}

// acc[q] [DIM] += sum_j p[q][j] * V_j for NQ query vectors at once over the same `count` keys: each V vector is
// loaded once for all of them (one query at a time loads a V vector per FMA, which bounds a prefill tile).
// V: v8, or v16 (DIM a multiple of 16) where the CPU has AVX-512; 4 vectors of dims at a time.
template <int DIM, int NQ, typename V = v8>
inline void accumulate_n(float* const* acc, const float* const* p, const float* const* vp, int64_t count) {
  constexpr int W = sizeof(V) / sizeof(float);
  for (int d0 = 0; d0 < DIM; d0 += 4 * W) {
    const int nv = std::min(4, (DIM - d0) / W);
    V a[NQ][4];
    for (int q = 0; q < NQ; ++q)
      for (int c = 0; c < 4; ++c) a[q][c] = c < nv ? loadv<V>(acc[q] + d0 + W * c) : splatv<V>(0.f);
    for (int64_t j = 0; j < count; ++j) {
      V v[4];
      for (int c = 0; c < 4; ++c) v[c] = c < nv ? loadv<V>(vp[j] + d0 + W * c) : splatv<V>(0.f);
      for (int q = 0; q < NQ; ++q) {
        const V w = splatv<V>(p[q][j]);
        for (int c = 0; c < 4; ++c)
          if (c < nv) a[q][c] += w * v[c];
      }
    }
    for (int q = 0; q < NQ; ++q)
      for (int c = 0; c < nv; ++c) storev<V>(acc[q] + d0 + W * c, a[q][c]);
  }
}

// `accumulate_n` over any number of query vectors, 4 at a time (in 16-float vectors where AVX-512 has them).
template <int DIM>
inline void accumulate_many(float* const* acc, const float* const* p, int64_t nq, const float* const* vp,
                            int64_t count) {
  int64_t i = 0;
#ifdef __AVX512F__
  if constexpr (DIM % 16 == 0) {
    for (; i + 4 <= nq; i += 4) accumulate_n<DIM, 4, v16>(acc + i, p + i, vp, count);
    switch (nq - i) {  // decode tiles: one row's 1-3 query vectors of a group
      case 3: accumulate_n<DIM, 3, v16>(acc + i, p + i, vp, count); return;
      case 2: accumulate_n<DIM, 2, v16>(acc + i, p + i, vp, count); return;
      case 1: accumulate_n<DIM, 1, v16>(acc + i, p + i, vp, count); return;
      default: return;
    }
  }
#endif
  // Two at a time, not four: four query vectors' 16 accumulators plus 4 value vectors do not fit AVX2's 16
  // registers (see `score_tiled`; in ad-hoc timings of that chunk, four at a time cost about a tenth more).
  for (; i + 2 <= nq; i += 2) accumulate_n<DIM, 2>(acc + i, p + i, vp, count);
  if (i < nq) accumulate_n<DIM, 1>(acc + i, p + i, vp, count);
}

// The online-softmax bookkeeping of a query vector before its weighted values are added: the running sum l
// and accumulator acc [DIM] rescaled from the old max m to the new one mt, plus the tile's `sum`.
// Nothing to rescale (no scalar exp) while the max holds, as it does for most tiles once a row has seen a few.
template <int DIM>
inline void online_rescale(float mt, float sum, float& m, float& l, float* acc) {
  if (mt > m) {
    const float rescale = std::exp(m - mt);  // 0 while nothing was seen (m = -inf)
    l *= rescale;
    m = mt;
    for (int d = 0; d < DIM; ++d) acc[d] *= rescale;
  }
  l += sum;
}

// A shared prefix is walked once for all its rows only when it holds at least this many keys (below that, the
// extra bookkeeping costs more than the keys it saves).
constexpr int64_t SHARED_MIN_KEYS = 32;

struct PrefixCluster {
  int64_t first, rows, pages;
};

// Rows on a shared prefix (decode rows of requests that vLLM's prefix cache gave the same leading pages):
// `rows` (single-row tasks' rows) are reordered in place so that each cluster's rows are consecutive, and the
// clusters come back as (first index into `rows`, rows, shared pages). Rows are sorted by their full pages
// (those before the row's position: vLLM shares only full pages, and the entries past a request's pages are
// not its own), so rows on one prefix are neighbours; a cluster takes the next row while the pages it shares
// with the cluster's first row hold SHARED_MIN_KEYS keys and at least half of the cluster's prefix so far. A
// cluster of one row shares nothing.
inline std::vector<PrefixCluster> prefix_clusters(std::vector<int64_t>& rows, const int32_t* bt, int64_t s_bt,
                                                  const int64_t* reqs, const int64_t* pos, int64_t page) {
  const auto full_pages = [&](int64_t row) { return (pos[row] + 1) / page; };
  const auto table = [&](int64_t row) { return bt + reqs[row] * s_bt; };
  std::sort(rows.begin(), rows.end(), [&](int64_t a, int64_t b) {
    const int32_t *ta = table(a), *tb = table(b);
    return std::lexicographical_compare(ta, ta + full_pages(a), tb, tb + full_pages(b)) ||
           (std::equal(ta, ta + full_pages(a), tb, tb + full_pages(b)) && a < b);
  });
  std::vector<PrefixCluster> clusters;
  for (size_t x = 0; x < rows.size();) {
    const int32_t* tl = table(rows[x]);
    int64_t shared = full_pages(rows[x]);
    size_t y = x + 1;
    for (; y < rows.size(); ++y) {
      const int32_t* ty = table(rows[y]);
      const int64_t common = std::mismatch(tl, tl + std::min(shared, full_pages(rows[y])), ty).first - tl;
      if (common * page < SHARED_MIN_KEYS || 2 * common < shared) break;
      shared = common;
    }
    clusters.push_back({static_cast<int64_t>(x), static_cast<int64_t>(y - x), y - x >= 2 ? shared : 0});
    x = y;
  }
  return clusters;
}

// The head dims the tiled kernels compile, for their switches and for Python (`supported_dims`).
#define HYSPARSE_TILE_DIMS(X) X(16) X(32) X(48) X(64) X(80) X(96) X(112) X(128) X(160) X(192) X(256)

}  // namespace
