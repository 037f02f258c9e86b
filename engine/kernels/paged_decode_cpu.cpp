// Decode attention read straight from the paged KV cache (CPU; float32 queries, a float32 or bf16
// cache, read as float32).
//
// A torch version must first gather every sequence's blocks into a contiguous copy: it reads the
// KV, writes a copy and reads that again, and on a 2-core machine those copies took most of a
// decode step. This kernel follows the block table in place and reads each K and V row once.
// One task per (sequence, kv head) keeps the G query heads of a GQA group together, so every
// K/V row that is loaded serves all of them. The rows of a prompt chunk (one block list, context
// lengths one apart) go in tiles of up to kTile rows that share each K and V row loaded, each row
// computed exactly as alone (attend_rows). paged_decode_ex adds a sliding window (no block wholly
// before it is read), Gemma 2's logit soft-capping and gpt-oss's attention sinks.
//
// The headers are the few this file uses, not <torch/extension.h>: that one pulls in all of
// torch's C++ API, and parsing it was about two thirds of the build's time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>  // pybind11, with its casters for at::Tensor

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#ifdef __AVX512F__
extern "C" __m512 _ZGVeN16v_expf(__m512);   // glibc libmvec: expf in 16 lanes
#else
extern "C" __m256 _ZGVdN8v_expf(__m256);    // and in 8 (AVX2)
#endif

namespace {

// 16 floats: one AVX-512 register with -march=native on such CPUs, two AVX2 ones elsewhere.
// Plain loops compiled to a serial chain of scalar FMAs (latency bound, ~4 GB/s); explicit
// vectors with independent accumulators keep the loop bound by memory instead.
typedef float v16 __attribute__((vector_size(64)));

inline v16 load16(const float* p) {
  v16 x;
  __builtin_memcpy(&x, p, sizeof(x));
  return x;
}

inline void store16(float* p, v16 x) { __builtin_memcpy(p, &x, sizeof(x)); }

// 16 bf16 values widened to float32 (a bf16 is a float32's upper half)
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

inline v16 load16(const at::BFloat16* p) {
  v16 x;
#ifdef __AVX512F__
  const __m512i w = _mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
  __builtin_memcpy(&x, &w, sizeof(x));
#else
  u16x16 h;
  __builtin_memcpy(&h, p, sizeof(h));
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  __builtin_memcpy(&x, &w, sizeof(x));
#endif
  return x;
}

// The horizontal sums below add a vector's 16 lanes in one fixed tree, the one GCC's
// _mm512_reduce_add_ps uses, written out for both widths: an AVX2 build gives the same bits as
// an AVX-512 one (tests/integration/test_kernel_isa_bits.py builds both and compares). The tree:
// lanes i and i + 8 first, then i and i + 4 of those, then i and i + 2, then the last two.
inline __m256 lo8(v16 x) {
  __m256 r;
  __builtin_memcpy(&r, &x, 32);
  return r;
}

inline __m256 hi8(v16 x) {
  __m256 r;
  __builtin_memcpy(&r, reinterpret_cast<const char*>(&x) + 32, 32);
  return r;
}

inline float hsum_halves(__m256 lo, __m256 hi) {
  const __m256 t3 = _mm256_add_ps(hi, lo);
  const __m128 t6 = _mm_add_ps(_mm256_extractf128_ps(t3, 1), _mm256_castps256_ps128(t3));
  const __m128 t8 = _mm_add_ps(t6, _mm_shuffle_ps(t6, t6, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(t8) + _mm_cvtss_f32(_mm_shuffle_ps(t8, t8, 1));
}

inline float hsum(v16 x) { return hsum_halves(lo8(x), hi8(x)); }

#ifndef __AVX512F__
// hsum4 below, on the halves of its four vectors (a_u: lanes 0-7 of x_u, b_u: lanes 8-15): the
// same per-128-bit-lane steps on each half (128-bit lanes 0-1, then 2-3), then the halves added
inline void hsum4_halves(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 b0, __m256 b1,
                         __m256 b2, __m256 b3, float* out, float sc) {
  auto lanes = [](__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 ab = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
    const __m256 cd = _mm256_add_ps(_mm256_unpacklo_ps(c, d), _mm256_unpackhi_ps(c, d));
    return _mm256_add_ps(
        _mm256_castpd_ps(_mm256_unpacklo_pd(_mm256_castps_pd(ab), _mm256_castps_pd(cd))),
        _mm256_castpd_ps(_mm256_unpackhi_pd(_mm256_castps_pd(ab), _mm256_castps_pd(cd))));
  };
  const __m256 r = _mm256_add_ps(lanes(a0, a1, a2, a3), lanes(b0, b1, b2, b3));
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps(r, 1));
  _mm_storeu_ps(out, _mm_mul_ps(s, _mm_set1_ps(sc)));
}
#endif

// out[u] = sum of the lanes of x_u, times sc, for four vectors at once: per 128-bit lane L of
// each, (x[4L] + x[4L+2]) + (x[4L+1] + x[4L+3]); then lanes (0 + 2) + (1 + 3). The AVX2 path
// runs the same adds on the two halves.
inline void hsum4(v16 x0, v16 x1, v16 x2, v16 x3, float* out, float sc) {
#ifdef __AVX512F__
  __m512 a, b, c, d;
  __builtin_memcpy(&a, &x0, 64);
  __builtin_memcpy(&b, &x1, 64);
  __builtin_memcpy(&c, &x2, 64);
  __builtin_memcpy(&d, &x3, 64);
  // pairs: lanes of ab hold a/b partial sums interleaved, cd likewise
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  // each 128-bit lane now [a b c d] partial sums
  const __m512 abcd = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(ab), _mm512_castps_pd(cd))));
  // the four 128-bit lanes summed
  __m512 r = _mm512_add_ps(abcd, _mm512_shuffle_f32x4(abcd, abcd, 0x4E));
  r = _mm512_add_ps(r, _mm512_shuffle_f32x4(r, r, 0xB1));
  const __m128 s = _mm_mul_ps(_mm512_castps512_ps128(r), _mm_set1_ps(sc));
  _mm_storeu_ps(out, s);
#else
  hsum4_halves(lo8(x0), lo8(x1), lo8(x2), lo8(x3), hi8(x0), hi8(x1), hi8(x2), hi8(x3), out, sc);
#endif
}

// D is a multiple of 16 (checked by the caller); b is the KV side: float32 or bf16
template <typename KV>
inline float dot(const float* __restrict a, const KV* __restrict b, int64_t D) {
  v16 acc0 = {}, acc1 = {};
  int64_t i = 0;
  for (; i + 32 <= D; i += 32) {
    acc0 += load16(a + i) * load16(b + i);
    acc1 += load16(a + i + 16) * load16(b + i + 16);
  }
  for (; i < D; i += 16) acc0 += load16(a + i) * load16(b + i);
  return hsum(acc0 + acc1);
}

template <typename KV>
inline void axpy(float* __restrict acc, float p, const KV* __restrict v, int64_t D) {
  for (int64_t i = 0; i < D; i += 16) store16(acc + i, load16(acc + i) + p * load16(v + i));
}


constexpr float kNoSink = -std::numeric_limits<float>::infinity();

// s[t] = exp(s[t] - max(s)) in place for t < L; returns their sum (a softmax before the division).
// A head's sink logit (gpt-oss; kNoSink: none) joins the maximum and the sum as one more score
// whose value row is zero, so the division leaves the keys their share of the mass alone.
// The same bits from an AVX-512 build and an AVX2 one: glibc's vector expf gives the same values
// in 16 lanes and in 8 (checked for every float in [-104, 0]), the sum is kept in 16 lanes either
// way and added up by hsum's tree, and the tail is scalar in both.
inline float exp_shifted(float* s, int64_t L, float sink = kNoSink) {
  // The maximum in 16 lanes, then across them (one max after another was a chain of L
  // dependent instructions: a sixth of a prompt chunk's attention). A maximum is exact in any
  // order; only a zero's sign may differ, which no s[t] - m below can tell.
  float m = s[0];
  int64_t t = 1;
  if (L >= 17) {
#ifdef __AVX512F__
    __m512 vm = _mm512_loadu_ps(s + 1);
    for (t = 17; t + 16 <= L; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + t));
    m = std::max(m, _mm512_reduce_max_ps(vm));
#else
    __m256 ml = _mm256_loadu_ps(s + 1), mh = _mm256_loadu_ps(s + 9);
    for (t = 17; t + 16 <= L; t += 16) {
      ml = _mm256_max_ps(ml, _mm256_loadu_ps(s + t));
      mh = _mm256_max_ps(mh, _mm256_loadu_ps(s + t + 8));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_max_ps(ml, mh));
    for (int i = 0; i < 8; ++i) m = std::max(m, lanes[i]);
#endif
  }
  for (; t < L; ++t) m = std::max(m, s[t]);
  m = std::max(m, sink);
  float sum = 0.f;
  t = 0;
  // glibc's vector expf (libmvec); scalar expf was a third of the kernel. Called by name: its
  // declarations need -ffast-math, which would also flip flush-to-zero for the whole process.
#ifdef __AVX512F__
  const __m512 vm = _mm512_set1_ps(m);
  __m512 vsum = _mm512_setzero_ps();
  for (; t + 16 <= L; t += 16) {
    const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_loadu_ps(s + t), vm));
    _mm512_storeu_ps(s + t, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (t > 0)
    sum = hsum_halves(_mm512_castps512_ps256(vsum),
                      _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(vsum), 1)));
#else
  const __m256 vm = _mm256_set1_ps(m);
  __m256 sl = _mm256_setzero_ps(), sh = sl;   // lanes 0-7 and 8-15 of each 16
  for (; t + 16 <= L; t += 16) {
    const __m256 el = _ZGVdN8v_expf(_mm256_sub_ps(_mm256_loadu_ps(s + t), vm));
    const __m256 eh = _ZGVdN8v_expf(_mm256_sub_ps(_mm256_loadu_ps(s + t + 8), vm));
    _mm256_storeu_ps(s + t, el);
    _mm256_storeu_ps(s + t + 8, eh);
    sl = _mm256_add_ps(sl, el);
    sh = _mm256_add_ps(sh, eh);
  }
  if (t > 0) sum = hsum_halves(sl, sh);
#endif
  for (; t < L; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  if (sink != kNoSink) sum += std::exp(sink - m);
  return sum;
}

// Scores of `rows` heads over L tokens: Gemma 2's soft-capping (cap > 0: s = cap * tanh(s / cap)),
// then the first `skip` tokens (the part of a sliding window's first block before the window)
// masked out. Kept out of the score loops, which run unchanged for every model.
inline void cap_and_skip(float* s, int64_t rows, int64_t L, int64_t skip, float cap) {
  if (cap > 0.f)
    for (int64_t i = 0; i < rows * L; ++i) s[i] = cap * std::tanh(s[i] / cap);
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t t = 0; t < skip; ++t) s[j * L + t] = -std::numeric_limits<float>::infinity();
}

template <typename KV>
inline void prefetch_span(const KV* p, int64_t n, int hint) {
  const char* c = reinterpret_cast<const char*>(p);
  const int64_t bytes = n * static_cast<int64_t>(sizeof(KV));
  for (int64_t o = 0; o < bytes; o += 64) {
    if (hint == 0) _mm_prefetch(c + o, _MM_HINT_T0);
    else _mm_prefetch(c + o, _MM_HINT_T1);
  }
}

// The cache row of token t of a sequence whose blocks are `row`: block sizes are powers of two
// (engine/config.py; checked by paged_decode_ex), so a shift and a mask, not a division per token.
inline int64_t slot_of(const int64_t* __restrict row, int64_t t, int64_t bs) {
  const int sh = __builtin_ctzll(static_cast<unsigned long long>(bs));
  return (row[t >> sh] << sh) + (t & (bs - 1));
}

constexpr int64_t PF = 8;   // tokens ahead that K rows are prefetched (4 to 32 measured the same)

// The next task's K and V blocks (every kv head's rows), prefetched into L2 a few cache lines at
// a time while this task computes: a sequence's blocks lie scattered over the cache, and memory
// delivers scattered 6 KiB blocks at about half the rate of one long stream unless many are
// requested well ahead (2 threads, AMD EPYC, 2026-11-30: 17 GB/s read in block order against
// 28 GB/s with each block requested four blocks ahead). The per-token prefetches below run only
// PF tokens ahead, too close for that, and a burst of the whole next sequence's lines at once
// measured no better than none; a steady trickle from every group of four tokens did: 32
// sequences of bf16 KV over 30 layers, blocks scattered, 192 tokens 10.8-11.2 -> 10.0-10.1 ms,
// 1,024 tokens 47-50 -> 42-45 ms (blocks in order: no change). Only addresses the next task
// itself reads are touched, and a prefetch changes no result.
// Built in where it helps (engine/kernels/__init__.py: AMD's EPYC); on the Intel Xeon with AMX
// the hardware prefetchers do better alone, in order or scattered, and it slowed decode
// attention by a fifth (docs/experiments/engine-decode-step.md, "The AMX Xeon, a second
// look").
#ifndef PDSERVE_KV_AHEAD
#define PDSERVE_KV_AHEAD 1
#endif
constexpr bool kAhead = PDSERVE_KV_AHEAD != 0;

struct Ahead {
  const char* k = nullptr;          // the layer's K half, as bytes
  const char* v = nullptr;          // and its V half
  const int64_t* row = nullptr;     // the next task's block list
  int64_t blocks = 0;               // the blocks it reads
  int64_t bytes = 0;                // one block's K (as its V), every kv head
  int64_t lines = 1;                // cache lines of those bytes, at least one
  int64_t pos = 0;                  // the next line to prefetch: K then V of each block in turn
  int64_t per_step = 0;             // lines a step() requests

  void set(const void* kbase, const void* vbase, const int64_t* block_list, int64_t n,
           int64_t block_bytes) {
    k = static_cast<const char*>(kbase);
    v = static_cast<const char*>(vbase);
    row = block_list;
    blocks = n;
    bytes = block_bytes;
    lines = std::max<int64_t>(1, (block_bytes + 63) / 64);
  }

  inline void step() {
    const int64_t end = blocks * 2 * lines;
    for (int64_t i = 0; i < per_step && pos < end; ++i, ++pos) {
      const int64_t b = pos / (2 * lines), w = pos % (2 * lines);
      const char* base = w < lines ? k : v;
      _mm_prefetch(base + row[b] * bytes + std::min<int64_t>((w % lines) * 64, bytes - 1),
                   _MM_HINT_T1);
    }
  }
};

// One kv head of one sequence with its G query heads, for the common shapes (DV = D / 16 vectors
// per head; see fast_kernel below). The queries and the output accumulators live in registers for the
// whole context: every K and V vector loaded serves all G heads, and the output is written once
// instead of read and written per token. While the scores are computed, K rows PF tokens ahead
// and the V rows of the same tokens are prefetched: the KV of a 30-layer batch is far larger than
// the caches, and the hardware prefetchers stop at every 4 KiB page of a block.
// Scores go to scores[g * L + t], the output to out[g * D + i].
#ifdef __AVX512F__
template <typename KV, int DV, int G>
void attend_head(const float* __restrict q, const KV* __restrict kp, const KV* __restrict vp,
                 const int64_t* __restrict row, int64_t L, int64_t bs, int64_t Hkv, int64_t h,
                 float sc, int64_t skip, float cap, const float* __restrict sinks,
                 float* __restrict scores, float* __restrict out, Ahead* ahead) {
  constexpr int64_t D = DV * 16;
  auto at = [&](const KV* base, int64_t t) { return base + (slot_of(row, t, bs) * Hkv + h) * D; };
  v16 qr[G][DV];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < DV; ++i) qr[g][i] = load16(q + g * D + i * 16);
  int64_t t = 0;
  for (; t + 4 <= L; t += 4) {
    if (ahead != nullptr) ahead->step();
    const KV* k[4];
    for (int u = 0; u < 4; ++u) {
      k[u] = at(kp, t + u);
      if (t + PF + u < L) prefetch_span(at(kp, t + PF + u), D, 0);
      prefetch_span(at(vp, t + u), D, 1);
    }
    v16 a[G][4] = {};
    for (int i = 0; i < DV; ++i) {
      const v16 k0 = load16(k[0] + i * 16), k1 = load16(k[1] + i * 16);
      const v16 k2 = load16(k[2] + i * 16), k3 = load16(k[3] + i * 16);
      for (int g = 0; g < G; ++g) {
        a[g][0] += qr[g][i] * k0;
        a[g][1] += qr[g][i] * k1;
        a[g][2] += qr[g][i] * k2;
        a[g][3] += qr[g][i] * k3;
      }
    }
    for (int g = 0; g < G; ++g) hsum4(a[g][0], a[g][1], a[g][2], a[g][3], scores + g * L + t, sc);
  }
  for (; t < L; ++t) {
    const KV* k = at(kp, t);
    prefetch_span(at(vp, t), D, 1);
    for (int g = 0; g < G; ++g) {
      v16 a = {};
      for (int i = 0; i < DV; ++i) a += qr[g][i] * load16(k + i * 16);
      scores[g * L + t] = hsum(a) * sc;
    }
  }
  cap_and_skip(scores, G, L, skip, cap);
  float inv[G];   // the softmax's 1 / sum, applied once to the output
  for (int g = 0; g < G; ++g)
    inv[g] = 1.f / exp_shifted(scores + g * L, L, sinks != nullptr ? sinks[g] : kNoSink);
  v16 acc[G][DV] = {};
  for (int64_t t = skip; t < L; ++t) {   // (skipped tokens' V rows are not read)
    if (ahead != nullptr && (t & 3) == 0) ahead->step();
    const KV* v = at(vp, t);
    v16 vv[DV];
    for (int i = 0; i < DV; ++i) vv[i] = load16(v + i * 16);
    for (int g = 0; g < G; ++g) {
      const float p = scores[g * L + t];
      for (int i = 0; i < DV; ++i) acc[g][i] += p * vv[i];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < DV; ++i) store16(out + g * D + i * 16, acc[g][i] * inv[g]);
}

#endif  // __AVX512F__ (attend_head)

// Rows that attend together. A prompt chunk (or a decode's guesses checked together) is a run of
// rows over one block list whose context lengths go up by one: row r sees L0 + r tokens. Run one
// at a time, each row loads every K and V row of its context again (from L2, or from L3 and
// memory once a long context outgrows L2), converts it from bf16 again, and computes its address
// again. attend_rows takes up to kTile rows of a run for one kv head: each group of four K rows is
// loaded once for all of them, and the V rows once for every RP rows. Each row's arithmetic is
// exactly attend_head's for that row alone (the same products, summed per lane in the same order,
// the same horizontal sums: hsum4 over the row's groups of four tokens, hsum over its last L % 4,
// the same softmax and the same order of V updates), so a row's bits do not depend on its tile,
// on how its prompt was cut into chunks, or on what else ran in the step.
constexpr int64_t kTile = 8;

#ifdef __AVX512F__
// rows whose V updates run together in registers: their accumulators (RP * G * DV vectors) and
// one V row (DV) within the 32 vector registers
template <int DV, int G>
constexpr int rows_per_pass() {
  constexpr int r = 24 / (G * DV);
  return r < 1 ? 1 : r > 4 ? 4 : r;
}

// The V pass of rows r0 .. r0 + RP - 1 of a tile (see attend_rows for the arguments): acc per row
// as attend_head's, token by token from 0.
template <typename KV, int DV, int G, int RP>
inline void v_pass(const KV* __restrict vp, const int64_t* __restrict row, int64_t L0, int64_t r0,
                   int64_t bs, int64_t Hkv, int64_t h, const float* __restrict scores, int64_t Ls,
                   const float* __restrict inv, float* __restrict out, int64_t os) {
  constexpr int64_t D = DV * 16;
  v16 acc[RP][G][DV] = {};
  const int64_t first = L0 + r0;   // the shortest row's length: every row sees t < first
  for (int64_t t = 0; t < first + RP - 1; ++t) {
    const KV* v = vp + (slot_of(row, t, bs) * Hkv + h) * D;
    v16 vv[DV];
    for (int i = 0; i < DV; ++i) vv[i] = load16(v + i * 16);
    for (int j = 0; j < RP; ++j) {
      if (t >= first + j) continue;   // row r0 + j sees first + j tokens
      const float* s = scores + (r0 + j) * G * Ls + t;
      for (int g = 0; g < G; ++g) {
        const float p = s[g * Ls];
        for (int i = 0; i < DV; ++i) acc[j][g][i] += p * vv[i];
      }
    }
  }
  for (int j = 0; j < RP; ++j)
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < DV; ++i)
        store16(out + (r0 + j) * os + g * D + i * 16, acc[j][g][i] * inv[(r0 + j) * G + g]);
}

// Rows 0 .. R-1 (R <= kTile) of a run, kv head h with its G query heads: row r's queries at
// q + r * os, its context L0 + r tokens of the block list `row`, its output at out + r * os.
// scores: R * G * Ls floats (Ls >= L0 + R - 1), row r's head g at (r * G + g) * Ls.
template <typename KV, int DV, int G>
void attend_rows(const float* __restrict q, const KV* __restrict kp, const KV* __restrict vp,
                 const int64_t* __restrict row, int64_t L0, int64_t R, int64_t bs, int64_t Hkv,
                 int64_t h, float sc, const float* __restrict sinks, float* __restrict scores,
                 int64_t Ls, float* __restrict out, int64_t os) {
  constexpr int64_t D = DV * 16;
  const int64_t Lmax = L0 + R - 1;
  for (int64_t t = 0; t < Lmax; t += 4) {
    const int64_t nt = std::min<int64_t>(4, Lmax - t);
    v16 k[4][DV];
    for (int u = 0; u < 4; ++u) {
      const int64_t tu = t + (u < nt ? u : 0);   // (a row past the end is never used)
      const KV* kr = kp + (slot_of(row, tu, bs) * Hkv + h) * D;
      for (int i = 0; i < DV; ++i) k[u][i] = load16(kr + i * 16);
    }
    for (int64_t r = std::max<int64_t>(0, t + 1 - L0); r < R; ++r) {   // the rows that see t
      const int64_t L = L0 + r;
      const float* qr = q + r * os;
      float* s = scores + r * G * Ls + t;
      if (t + 4 <= L) {   // attend_head's groups of four
        for (int g = 0; g < G; ++g) {
          v16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
          for (int i = 0; i < DV; ++i) {
            const v16 qv = load16(qr + g * D + i * 16);
            a0 += qv * k[0][i];
            a1 += qv * k[1][i];
            a2 += qv * k[2][i];
            a3 += qv * k[3][i];
          }
          hsum4(a0, a1, a2, a3, s + g * Ls, sc);
        }
      } else {   // its last L % 4 tokens, one at a time
        for (int64_t u = 0; u < L - t; ++u)
          for (int g = 0; g < G; ++g) {
            v16 a = {};
            for (int i = 0; i < DV; ++i) a += load16(qr + g * D + i * 16) * k[u][i];
            s[g * Ls + u] = hsum(a) * sc;
          }
      }
    }
  }
  float inv[kTile * G];
  for (int64_t r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g)
      inv[r * G + g] = 1.f / exp_shifted(scores + (r * G + g) * Ls, L0 + r,
                                         sinks != nullptr ? sinks[g] : kNoSink);
  constexpr int RP = rows_per_pass<DV, G>();
  int64_t r = 0;
  for (; r + RP <= R; r += RP) v_pass<KV, DV, G, RP>(vp, row, L0, r, bs, Hkv, h, scores, Ls, inv, out, os);
  for (; r < R; ++r) v_pass<KV, DV, G, 1>(vp, row, L0, r, bs, Hkv, h, scores, Ls, inv, out, os);
}

#endif  // __AVX512F__ (v_pass, attend_rows)

#ifndef __AVX512F__
// The AVX2 forms of attend_head and attend_rows: the same arithmetic lane for lane (each score's
// 16 lanes summed over i in order, the same hsum4/hsum trees, each output lane summed over t in
// order from zero), so the same bits as the AVX-512 build, laid out for 16 vector registers of
// 8 floats. Kept whole in registers, the AVX-512 layout (all G heads' queries and accumulators)
// would need 48 of them and spilled on every token (7-10x slower). Here the scores are computed
// one head at a time from K rows kept in L1 (bf16 rows widened once into a float copy), and the
// V pass runs kVChunk tokens at a time, one head (and row) after another, their accumulators
// kept in memory between chunks and the chunk's V rows in L1.
// out[0 .. n) = x[0 .. n) * f (n a multiple of 8; in place allowed)
inline void scale8(float* out, const float* x, float f, int64_t n) {
  const __m256 fv = _mm256_set1_ps(f);
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), fv));
}

constexpr int64_t kVChunk = 64;   // tokens whose V rows one pass of the accumulators covers

// A K or V row as float32: the cache's own row, or a bf16 row widened into `tmp`
inline const float* row_f32(const float* src, float*, int64_t) { return src; }

inline const float* row_f32(const at::BFloat16* src, float* tmp, int64_t D) {
  for (int64_t i = 0; i < D; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(tmp + i),
                        _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  return tmp;
}

// One head's scores against four K rows (float32), as attend_head's groups of four give them:
// out[0 .. 4)
template <int DV>
inline void scores4(const float* __restrict qg, const float* const* k, float* out, float sc) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  for (int i = 0; i < DV; ++i) {
    const __m256 ql = _mm256_loadu_ps(qg + i * 16), qh = _mm256_loadu_ps(qg + i * 16 + 8);
    a0 = _mm256_fmadd_ps(ql, _mm256_loadu_ps(k[0] + i * 16), a0);
    b0 = _mm256_fmadd_ps(qh, _mm256_loadu_ps(k[0] + i * 16 + 8), b0);
    a1 = _mm256_fmadd_ps(ql, _mm256_loadu_ps(k[1] + i * 16), a1);
    b1 = _mm256_fmadd_ps(qh, _mm256_loadu_ps(k[1] + i * 16 + 8), b1);
    a2 = _mm256_fmadd_ps(ql, _mm256_loadu_ps(k[2] + i * 16), a2);
    b2 = _mm256_fmadd_ps(qh, _mm256_loadu_ps(k[2] + i * 16 + 8), b2);
    a3 = _mm256_fmadd_ps(ql, _mm256_loadu_ps(k[3] + i * 16), a3);
    b3 = _mm256_fmadd_ps(qh, _mm256_loadu_ps(k[3] + i * 16 + 8), b3);
  }
  hsum4_halves(a0, a1, a2, a3, b0, b1, b2, b3, out, sc);
}

// One head's score against one K row, as attend_head's last L % 4 tokens give it
template <int DV>
inline float score1(const float* __restrict qg, const float* __restrict k, float sc) {
  __m256 lo = _mm256_setzero_ps(), hi = lo;
  for (int i = 0; i < DV; ++i) {
    lo = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i * 16), _mm256_loadu_ps(k + i * 16), lo);
    hi = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i * 16 + 8), _mm256_loadu_ps(k + i * 16 + 8), hi);
  }
  return hsum_halves(lo, hi) * sc;
}

// acc[0 .. D) += p[t] * v[t] for the chunk's rows t in [0, n), in order (one head's accumulators
// of one row, loaded and stored once a chunk)
template <int DV>
inline void v_rows(float* __restrict acc, const float* __restrict p, const float* const* v,
                   int64_t n) {
  constexpr int V = 2 * DV;
  __m256 a[V];
  for (int j = 0; j < V; ++j) a[j] = _mm256_loadu_ps(acc + j * 8);
  for (int64_t t = 0; t < n; ++t) {
    const __m256 pt = _mm256_set1_ps(p[t]);
    for (int j = 0; j < V; ++j) a[j] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(v[t] + j * 8), a[j]);
  }
  for (int j = 0; j < V; ++j) _mm256_storeu_ps(acc + j * 8, a[j]);
}

// A chunk's V rows as float32 pointers (into the cache, or widened into `tmp`)
template <typename KV, typename At>
inline void v_chunk(At at, const KV* vp, int64_t t0, int64_t n, int64_t D, float* tmp,
                    const float** rows, Ahead* ahead = nullptr) {
  for (int64_t t = 0; t < n; ++t) {
    if (ahead != nullptr && (t & 3) == 0) ahead->step();
    if (t + PF < n) prefetch_span(at(vp, t0 + t + PF), D, 0);
    rows[t] = row_f32(at(vp, t0 + t), tmp + t * D, D);
  }
}

template <typename KV, int DV, int G>
void attend_head(const float* __restrict q, const KV* __restrict kp, const KV* __restrict vp,
                 const int64_t* __restrict row, int64_t L, int64_t bs, int64_t Hkv, int64_t h,
                 float sc, int64_t skip, float cap, const float* __restrict sinks,
                 float* __restrict scores, float* __restrict out, Ahead* ahead) {
  constexpr int64_t D = DV * 16;
  auto at = [&](const KV* base, int64_t t) { return base + (slot_of(row, t, bs) * Hkv + h) * D; };
  alignas(32) float kt[4 * D];
  int64_t t = 0;
  for (; t + 4 <= L; t += 4) {
    if (ahead != nullptr) ahead->step();
    const float* k[4];
    for (int u = 0; u < 4; ++u) {
      if (t + PF + u < L) prefetch_span(at(kp, t + PF + u), D, 0);
      k[u] = row_f32(at(kp, t + u), kt + u * D, D);
    }
    for (int g = 0; g < G; ++g) scores4<DV>(q + g * D, k, scores + g * L + t, sc);
  }
  for (; t < L; ++t) {
    const float* k = row_f32(at(kp, t), kt, D);
    for (int g = 0; g < G; ++g) scores[g * L + t] = score1<DV>(q + g * D, k, sc);
  }
  cap_and_skip(scores, G, L, skip, cap);
  float inv[G];   // the softmax's 1 / sum, applied once to the output
  for (int g = 0; g < G; ++g)
    inv[g] = 1.f / exp_shifted(scores + g * L, L, sinks != nullptr ? sinks[g] : kNoSink);
  alignas(32) float acc[G * D] = {};
  alignas(32) float vt[kVChunk * D];
  const float* v[kVChunk];
  for (int64_t t0 = skip; t0 < L; t0 += kVChunk) {   // (skipped tokens' V rows are not read)
    const int64_t n = std::min<int64_t>(kVChunk, L - t0);
    v_chunk(at, vp, t0, n, D, vt, v, ahead);
    for (int g = 0; g < G; ++g) v_rows<DV>(acc + g * D, scores + g * L + t0, v, n);
  }
  for (int g = 0; g < G; ++g) scale8(out + g * D, acc + g * D, inv[g], D);
}

// attend_rows's AVX2 form (see the AVX-512 one for the arguments): row r of the tile sees
// L0 + r tokens; `scores` as there; its accumulators live in `out` until the end.
template <typename KV, int DV, int G>
void attend_rows(const float* __restrict q, const KV* __restrict kp, const KV* __restrict vp,
                 const int64_t* __restrict row, int64_t L0, int64_t R, int64_t bs, int64_t Hkv,
                 int64_t h, float sc, const float* __restrict sinks, float* __restrict scores,
                 int64_t Ls, float* __restrict out, int64_t os) {
  constexpr int64_t D = DV * 16;
  auto at = [&](const KV* base, int64_t t) { return base + (slot_of(row, t, bs) * Hkv + h) * D; };
  const int64_t Lmax = L0 + R - 1;
  alignas(32) float kt[4 * D];
  for (int64_t t = 0; t < Lmax; t += 4) {
    const int64_t nt = std::min<int64_t>(4, Lmax - t);
    const float* k[4];
    for (int u = 0; u < 4; ++u) {
      const int64_t tu = t + (u < nt ? u : 0);   // (a row past the end is never used)
      k[u] = row_f32(at(kp, tu), kt + u * D, D);
    }
    for (int64_t r = std::max<int64_t>(0, t + 1 - L0); r < R; ++r) {   // the rows that see t
      const int64_t L = L0 + r;
      const float* qr = q + r * os;
      float* s = scores + r * G * Ls + t;
      if (t + 4 <= L) {   // attend_head's groups of four
        for (int g = 0; g < G; ++g) scores4<DV>(qr + g * D, k, s + g * Ls, sc);
      } else {   // its last L % 4 tokens, one at a time
        for (int64_t u = 0; u < L - t; ++u)
          for (int g = 0; g < G; ++g) s[g * Ls + u] = score1<DV>(qr + g * D, k[u], sc);
      }
    }
  }
  float inv[kTile * G];
  for (int64_t r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g)
      inv[r * G + g] = 1.f / exp_shifted(scores + (r * G + g) * Ls, L0 + r,
                                         sinks != nullptr ? sinks[g] : kNoSink);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t i = 0; i < G * D; ++i) out[r * os + i] = 0.f;
  alignas(32) float vt[kVChunk * D];
  const float* v[kVChunk];
  for (int64_t t0 = 0; t0 < Lmax; t0 += kVChunk) {
    const int64_t n = std::min<int64_t>(kVChunk, Lmax - t0);
    v_chunk(at, vp, t0, n, D, vt, v);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t m = std::min<int64_t>(n, L0 + r - t0);   // the chunk's tokens row r sees
      if (m <= 0) continue;
      for (int g = 0; g < G; ++g)
        v_rows<DV>(out + r * os + g * D, scores + (r * G + g) * Ls + t0, v, m);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) scale8(out + r * os + g * D, out + r * os + g * D, inv[r * G + g], D);
}
#endif  // !__AVX512F__

// One task: kv heads [h0, h1) of one sequence, each with its G query heads, against its L context
// tokens. A whole sequence per task (the usual case) streams each token's K and V rows of all
// heads once, contiguously; splitting by head is only for batches smaller than the thread count.
// A plain function with everything passed by value: inside the OpenMP region a lambda reads its
// captures through a pointer, which cost a 4x slowdown here.
template <typename KV>
void attend(const float* __restrict q, const KV* __restrict kp, const KV* __restrict vp,
            const int64_t* __restrict row, int64_t L, int64_t bs, int64_t Hkv, int64_t h0,
            int64_t h1, int64_t G, int64_t D, float sc, int64_t skip, float cap,
            const float* __restrict sinks, float* __restrict scores, float* __restrict acc,
            float* __restrict out) {
  const int64_t nh = (h1 - h0) * G;   // query heads in this task; q and out start at head h0 * G
  int64_t t = 0;
  // four tokens at a time: their partial sums are reduced together (hsum4), a quarter of the
  // shuffles four separate horizontal sums take
  for (; t + 4 <= L; t += 4) {
    const KV* k[4];
    for (int u = 0; u < 4; ++u) k[u] = kp + (slot_of(row, t + u, bs) * Hkv + h0) * D;
    for (int64_t j = 0; j < nh; ++j) {
      const float* qj = q + j * D;
      const int64_t off = (j / G) * D;
      v16 a0 = {}, a1 = {}, a2 = {}, a3 = {};
      for (int64_t i = 0; i < D; i += 16) {
        const v16 qv = load16(qj + i);
        a0 += qv * load16(k[0] + off + i);
        a1 += qv * load16(k[1] + off + i);
        a2 += qv * load16(k[2] + off + i);
        a3 += qv * load16(k[3] + off + i);
      }
      hsum4(a0, a1, a2, a3, scores + j * L + t, sc);
    }
  }
  for (; t < L; ++t) {
    const KV* k = kp + (slot_of(row, t, bs) * Hkv + h0) * D;
    for (int64_t j = 0; j < nh; ++j) scores[j * L + t] = dot(q + j * D, k + (j / G) * D, D) * sc;
  }
  cap_and_skip(scores, nh, L, skip, cap);
  for (int64_t j = 0; j < nh; ++j) {
    float* s = scores + j * L;
    const float inv = 1.f / exp_shifted(s, L, sinks != nullptr ? sinks[j] : kNoSink);
    for (int64_t t = 0; t < L; ++t) s[t] *= inv;
  }
  std::fill(acc, acc + nh * D, 0.f);
  for (int64_t t = skip; t < L; ++t) {   // (skipped tokens' V rows are not read)
    const KV* v = vp + (slot_of(row, t, bs) * Hkv + h0) * D;
    for (int64_t j = 0; j < nh; ++j) axpy(acc + j * D, scores[j * L + t], v + (j / G) * D, D);
  }
  std::copy(acc, acc + nh * D, out);
}

template <typename KV>
using HeadFn = void (*)(const float*, const KV*, const KV*, const int64_t*, int64_t, int64_t,
                        int64_t, int64_t, float, int64_t, float, const float*, float*, float*,
                        Ahead*);

// The (head_dim, group) shapes with a register-resident kernel; others take attend().
template <typename KV, int DV>
HeadFn<KV> fast_for_group(int64_t G) {
  switch (G) {
    case 1: return attend_head<KV, DV, 1>;
    case 2: return attend_head<KV, DV, 2>;
    case 3: return attend_head<KV, DV, 3>;
    case 4: return attend_head<KV, DV, 4>;
    case 8: return attend_head<KV, DV, 8>;
    default: return nullptr;
  }
}

template <typename KV>
HeadFn<KV> fast_kernel(int64_t D, int64_t G) {
  switch (D) {
    case 16: return fast_for_group<KV, 1>(G);
    case 32: return fast_for_group<KV, 2>(G);
    case 64: return fast_for_group<KV, 4>(G);
    case 128: return fast_for_group<KV, 8>(G);
    default: return nullptr;
  }
}

template <typename KV>
using RowsFn = void (*)(const float*, const KV*, const KV*, const int64_t*, int64_t, int64_t,
                        int64_t, int64_t, int64_t, float, const float*, float*, int64_t, float*,
                        int64_t);

// attend_rows for the shapes attend_head has (fast_kernel), else nullptr
template <typename KV, int DV>
RowsFn<KV> rows_for_group(int64_t G) {
  switch (G) {
    case 1: return attend_rows<KV, DV, 1>;
    case 2: return attend_rows<KV, DV, 2>;
    case 3: return attend_rows<KV, DV, 3>;
    case 4: return attend_rows<KV, DV, 4>;
    case 8: return attend_rows<KV, DV, 8>;
    default: return nullptr;
  }
}

template <typename KV>
RowsFn<KV> rows_kernel(int64_t D, int64_t G) {
  switch (D) {
    case 16: return rows_for_group<KV, 1>(G);
    case 32: return rows_for_group<KV, 2>(G);
    case 64: return rows_for_group<KV, 4>(G);
    case 128: return rows_for_group<KV, 8>(G);
    default: return nullptr;
  }
}

// Cuts the N rows into tasks' tiles: up to kTile consecutive rows of one run (row n + 1 sees one
// token more than row n, over the same blocks as far as row n reads) when `tiled`, else one row
// each. Returns (first row, rows) per tile.
inline std::vector<std::pair<int64_t, int64_t>> tiles_of(const int64_t* bt, const int64_t* cl,
                                                         int64_t N, int64_t max_blocks, int64_t bs,
                                                         bool tiled) {
  std::vector<std::pair<int64_t, int64_t>> tiles;
  tiles.reserve(N);
  for (int64_t n = 0; n < N;) {
    int64_t r = 1;
    while (tiled && r < kTile && n + r < N && cl[n + r] == cl[n + r - 1] + 1 &&
           std::equal(bt + (n + r - 1) * max_blocks,
                      bt + (n + r - 1) * max_blocks + (cl[n + r - 1] + bs - 1) / bs,
                      bt + (n + r) * max_blocks))
      ++r;
    tiles.emplace_back(n, r);
    n += r;
  }
  return tiles;
}

template <typename KV>
void run(const at::Tensor& q, const KV* kp, const KV* vp, const at::Tensor& block_tables,
         const int64_t* cl, at::Tensor& out, int64_t N, int64_t Hq, int64_t D, int64_t bs,
         int64_t Hkv, double scale, int64_t window, double cap, const float* sk) {
  const int64_t G = Hq / Hkv, max_blocks = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale), fcap = static_cast<float>(cap);
  const int64_t max_len = max_blocks * bs;
  const HeadFn<KV> fast = fast_kernel<KV>(D, G);
  // runs of rows attend in tiles (attend_rows) where nothing is windowed or capped
  const RowsFn<KV> rows = window == 0 && cap == 0.0 ? rows_kernel<KV>(D, G) : nullptr;
  const auto tiles = tiles_of(bt, cl, N, max_blocks, bs, rows != nullptr);
  const int64_t T = static_cast<int64_t>(tiles.size());
  bool tiled = false;   // some tile has more than one row
  for (const auto& tile : tiles) tiled |= tile.second > 1;

  // a task per tile (a sequence, or a run's rows) when there are enough of them to keep every
  // thread busy, else per kv head too
  const int64_t split = T >= at::get_num_threads() ? 1 : Hkv;
  const int64_t hpt = Hkv / split;   // kv heads per task
  const auto* tp = tiles.data();
  at::parallel_for(0, T * split, 1, [=](int64_t begin, int64_t end) {
    // scratch, written before it is read: not zeroed (at a long context, zeroing a tile's
    // scores per call was megabytes a decode step)
    std::unique_ptr<float[]> scores(new float[std::max(hpt, tiled ? kTile : 0) * G * max_len]),
        acc(new float[hpt * G * D]);
    for (int64_t task = begin; task < end; ++task) {
      // tiles from both ends in turn: a prompt chunk's rows attend to ever longer contexts, and
      // parallel_for hands each thread a contiguous range of tasks, so in row order the last
      // thread would get the longest rows; tile i and tile T-1-i together cost about the same
      const int64_t t = task / split;
      const auto [n, R] = tp[(t % 2 == 0) ? t / 2 : T - 1 - t / 2];
      const int64_t h0 = (task % split) * hpt;
      if (R > 1) {   // (rows != nullptr: no window, no cap)
        const int64_t* row = bt + (n + R - 1) * max_blocks;   // the longest row's list
        for (int64_t h = h0; h < h0 + hpt; ++h)
          rows(qp + (n * Hq + h * G) * D, kp, vp, row, cl[n], R, bs, Hkv, h, sc,
               sk != nullptr ? sk + h * G : nullptr, scores.get(), max_len,
               op + (n * Hq + h * G) * D, Hq * D);
        continue;
      }
      // A sliding window: the query (position cl - 1) sees positions cl - window .. cl - 1
      // only. Blocks wholly before the window are never read (they may already hold another
      // sequence's KV); the window's first block is read from its start, its positions before
      // the window masked out (`skip`).
      const int64_t t0 = window > 0 ? std::max<int64_t>(0, cl[n] - window) : 0;
      const int64_t first = t0 / bs, skip = t0 - first * bs, len = cl[n] - first * bs;
      const int64_t* row = bt + n * max_blocks + first;
      if (fast != nullptr) {
        // a task per sequence (all its kv heads) on a plain model: the thread's next task's
        // blocks stream in while this one computes (Ahead)
        Ahead ahead, *next = nullptr;
        if (kAhead && split == 1 && window == 0 && task + 1 < end) {
          const int64_t tn = task + 1;
          const auto [nn, RR] = tp[(tn % 2 == 0) ? tn / 2 : T - 1 - tn / 2];
          const int64_t last = nn + RR - 1;   // a tile's longest row reads every block the tile reads
          ahead.set(kp, vp, bt + last * max_blocks, (cl[last] + bs - 1) / bs,
                    bs * Hkv * D * static_cast<int64_t>(sizeof(KV)));
          // this task makes about Hkv * len / 2 steps (a group of four tokens of one head's K,
          // then of its V): the next task's lines spread over them, with a quarter to spare
          const int64_t steps = std::max<int64_t>(1, Hkv * len / 2);
          ahead.per_step = std::min<int64_t>(
              32, (5 * ahead.blocks * 2 * ahead.lines + 4 * steps - 1) / (4 * steps));
          next = &ahead;
        }
        for (int64_t h = h0; h < h0 + hpt; ++h)
          fast(qp + (n * Hq + h * G) * D, kp, vp, row, len, bs, Hkv, h, sc, skip, fcap,
               sk != nullptr ? sk + h * G : nullptr, scores.get(), op + (n * Hq + h * G) * D,
               next);
      } else {
        attend(qp + (n * Hq + h0 * G) * D, kp, vp, row, len, bs, Hkv, h0, h0 + hpt, G, D, sc,
               skip, fcap, sk != nullptr ? sk + h0 * G : nullptr, scores.get(), acc.get(),
               op + (n * Hq + h0 * G) * D);
      }
    }
  });
}

// window > 0: each query attends its last `window` positions only; softcap > 0: scores become
// softcap * tanh(score / softcap) before the softmax (Gemma 2); sinks: none (an undefined or empty
// tensor) or each query head's sink logit, float32 [Hq] (gpt-oss)
at::Tensor paged_decode_ex(at::Tensor q, at::Tensor layer_kv, at::Tensor block_tables,
                           at::Tensor context_lens, double scale, int64_t window,
                           double logit_cap, at::Tensor sinks) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && (layer_kv.scalar_type() == at::kFloat ||
                                                layer_kv.scalar_type() == at::kBFloat16),
              "paged_decode: q must be float32 and the KV cache float32 or bfloat16");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "paged_decode: block tables and context lengths must be int64");
  TORCH_CHECK(q.is_contiguous() && layer_kv.is_contiguous() && block_tables.is_contiguous() &&
              context_lens.is_contiguous(), "paged_decode: inputs must be contiguous");
  TORCH_CHECK(q.dim() == 3 && layer_kv.dim() == 5 && block_tables.dim() == 2,
              "paged_decode: q [N,Hq,D], layer_kv [2,blocks,block_size,Hkv,D], block_tables [N,max_blocks]");
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t num_blocks = layer_kv.size(1), bs = layer_kv.size(2), Hkv = layer_kv.size(3);
  TORCH_CHECK(layer_kv.size(4) == D && Hq % Hkv == 0, "paged_decode: head shapes do not match");
  TORCH_CHECK(D % 16 == 0, "paged_decode: head_dim must be a multiple of 16");
  TORCH_CHECK(bs >= 1 && (bs & (bs - 1)) == 0, "paged_decode: block_size must be a power of two");
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  for (int64_t n = 0; n < N; ++n)
    TORCH_CHECK(cl[n] >= 1 && cl[n] <= max_blocks * bs, "paged_decode: context length out of range");
  const float* sk = nullptr;
  if (sinks.defined() && sinks.numel() > 0) {
    TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.is_contiguous() &&
                sinks.dim() == 1 && sinks.size(0) == Hq,
                "paged_decode: sinks must be float32, contiguous, one per query head");
    sk = sinks.data_ptr<float>();
  }
  auto out = at::empty_like(q);
  if (layer_kv.scalar_type() == at::kBFloat16) {
    const at::BFloat16* kp = layer_kv.data_ptr<at::BFloat16>();
    run(q, kp, kp + num_blocks * bs * Hkv * D, block_tables, cl, out, N, Hq, D, bs, Hkv, scale,
        window, logit_cap, sk);
  } else {
    const float* kp = layer_kv.data_ptr<float>();
    run(q, kp, kp + num_blocks * bs * Hkv * D, block_tables, cl, out, N, Hq, D, bs, Hkv, scale,
        window, logit_cap, sk);
  }
  return out;
}

at::Tensor paged_decode(at::Tensor q, at::Tensor layer_kv, at::Tensor block_tables,
                        at::Tensor context_lens, double scale) {
  return paged_decode_ex(q, layer_kv, block_tables, context_lens, scale, 0, 0.0, at::Tensor());
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache (float32, CPU)");
  m.def("paged_decode_ex", &paged_decode_ex,
        "paged_decode with a sliding window (0: none), logit soft-capping (0: none) and "
        "attention sinks (an empty tensor: none)");
  // the same function for C++ callers in other modules (fused_cpu.cpp's DecodeStack), which call
  // it without the GIL; the capsule's name is the signature they cast it to
  m.attr("paged_decode_capsule") = py::capsule(
      reinterpret_cast<void*>(&paged_decode),
      "pdserve.paged_decode(Tensor q, Tensor layer_kv, Tensor block_tables, Tensor context_lens, double scale) -> Tensor");
}
