// Fused float32 CPU ops for the layers' small steps (engine/layers), each one call instead of the
// 3-10 torch ops it replaces: at one decode row a torch op costs more in dispatch than in math.
// Built with -ffp-contract=off: no fused multiply-adds, so rotary and the int8 row preparation
// round exactly as the torch expressions they replace (RMSNorm's sum is ordered differently).
//
// The headers are the few this file uses, not <torch/extension.h>: that one pulls in all of
// torch's C++ API, and parsing it was about two thirds of the build's time.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/silu.h>
#include <ATen/TensorOperators.h>
#include <torch/csrc/jit/api/object.h>
#include <torch/csrc/utils/pybind.h>  // pybind11, with its casters for at::Tensor

#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat, name, ": CPU float32 expected");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": [rows, width] with unit last stride expected");
}

void norm_row(const float* in, const float* w, float* out, int64_t n, double eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += in[i] * in[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (in[i] * r);
}

// float32 -> bfloat16 bits, rounded to nearest even as torch's .to(torch.bfloat16) rounds a
// finite value (a NaN becomes a quiet NaN)
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (f != f) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

inline float bf16_value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void to_bf16(const float* in, uint16_t* out, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, in + i, 4);
    const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    out[i] = in[i] != in[i] ? 0x7FC0 : static_cast<uint16_t>(r);
  }
}

}  // namespace

// add_rms_norm for the decode stack's bf16 chain: x may be bfloat16 (a bf16 linear's output, read
// exactly as its float32 conversion) and the normalized rows come out as bfloat16 when out_bf16
// (rounded as .to(torch.bfloat16) rounds them). The same values as add_rms_norm followed and
// preceded by those conversions, without the separate conversion passes.
std::vector<at::Tensor> add_rms_norm_ex(at::Tensor x, c10::optional<at::Tensor> residual,
                                        const at::Tensor& weight, double eps, bool out_bf16) {
  const bool xb = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK(x.device().is_cpu() && (xb || x.scalar_type() == at::kFloat) && x.dim() == 2 &&
                  x.stride(1) == 1,
              "x: CPU float32 or bfloat16 [rows, width] with unit last stride expected");
  if (xb && !residual.has_value()) x = x.to(at::kFloat);  // it becomes the residual
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows, n}, x.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
  at::Tensor src = residual.has_value() ? residual.value() : x;
  check_rows(src, "residual");
  TORCH_CHECK(src.sizes() == x.sizes(), "residual: shape of x expected");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == n,
              "weight: contiguous float32 of the row width expected");
  const int64_t xs = x.stride(0), ss = src.stride(0);
  const bool add = residual.has_value();
  const float* wp = weight.data_ptr<float>();
  float* sp = src.data_ptr<float>();
  const void* xv = x.data_ptr();
  void* ov = out.data_ptr();
  at::parallel_for(0, rows, 16, [&](int64_t a, int64_t b) {
    std::vector<float> tmp(out_bf16 ? n : 0);
    for (int64_t r = a; r < b; ++r) {
      float* s = sp + r * ss;
      if (add && xb) {
        const uint16_t* xr = static_cast<const uint16_t*>(xv) + r * xs;
        for (int64_t i = 0; i < n; ++i) s[i] = bf16_value(xr[i]) + s[i];
      } else if (add) {
        const float* xr = static_cast<const float*>(xv) + r * xs;
        for (int64_t i = 0; i < n; ++i) s[i] = xr[i] + s[i];
      }
      if (out_bf16) {
        norm_row(s, wp, tmp.data(), n, eps);
        to_bf16(tmp.data(), static_cast<uint16_t*>(ov) + r * n, n);
      } else {
        norm_row(s, wp, static_cast<float*>(ov) + r * n, n, eps);
      }
    }
  });
  return {out, src};
}

#ifdef __AVX512F__
extern "C" __m512 _ZGVeN16v_expf(__m512);  // glibc libmvec (linked with -lmvec)
#endif

// The bf16 mode's MLP between its two linears in one pass: gu [rows, 2I] (bf16 or float32; the
// gate's I columns, then the up projection's, as the merged gate_up linear gives them) to
// silu(gate) * up [rows, I] as bf16, the down projection's input, rounded to nearest even as
// .to(torch.bfloat16) rounds. silu(g) = g / (1 + exp(-g)) in float32 with glibc's expf (16 lanes
// a call where the CPU has AVX-512; the same function serves the decode stack and the layers
// one by one, so both give the same bits). Replaces a conversion of gu to float32, torch's silu,
// the product and the product's conversion to bf16: four passes over the widest activations.
at::Tensor silu_mul_bf16(at::Tensor gu) {
  const bool gb = gu.scalar_type() == at::kBFloat16;
  TORCH_CHECK(gu.device().is_cpu() && (gb || gu.scalar_type() == at::kFloat) && gu.dim() == 2 &&
                  gu.size(1) % 2 == 0,
              "gu: CPU float32 or bfloat16 [rows, 2 * intermediate] expected");
  const auto gc = gu.contiguous();
  const int64_t rows = gc.size(0), I = gc.size(1) / 2;
  auto out = at::empty({rows, I}, gc.options().dtype(at::kBFloat16));
  const void* gp = gc.data_ptr();
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, rows, 4, [&](int64_t a, int64_t b) {
    std::vector<float> g(I), u(I);
    for (int64_t r = a; r < b; ++r) {
      if (gb) {
        const uint16_t* row = static_cast<const uint16_t*>(gp) + r * 2 * I;
        for (int64_t i = 0; i < I; ++i) {
          g[i] = bf16_value(row[i]);
          u[i] = bf16_value(row[I + i]);
        }
      } else {
        const float* row = static_cast<const float*>(gp) + r * 2 * I;
        std::memcpy(g.data(), row, I * sizeof(float));
        std::memcpy(u.data(), row + I, I * sizeof(float));
      }
      int64_t i = 0;
#ifdef __AVX512F__
      const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps();
      for (; i + 16 <= I; i += 16) {
        const __m512 gv = _mm512_loadu_ps(g.data() + i);
        const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(zero, gv));
        const __m512 sv = _mm512_div_ps(gv, _mm512_add_ps(one, e));
        _mm512_storeu_ps(g.data() + i, _mm512_mul_ps(sv, _mm512_loadu_ps(u.data() + i)));
      }
#endif
      for (; i < I; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
      to_bf16(g.data(), op + r * I, I);
    }
  });
  return out;
}

// RMSNorm of x's rows; with a residual, residual += x first (in place) and the sum is normalized.
// Returns (normalized, residual or x).
std::vector<at::Tensor> add_rms_norm(at::Tensor x, c10::optional<at::Tensor> residual,
                                     at::Tensor weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows, n}, x.options());
  at::Tensor src = x;
  if (residual.has_value()) {
    src = residual.value();
    check_rows(src, "residual");
    TORCH_CHECK(src.sizes() == x.sizes(), "residual: shape of x expected");
  }
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == n,
              "weight: contiguous float32 of the row width expected");
  const float* xp = x.data_ptr<float>();
  float* sp = src.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), ss = src.stride(0);
  const bool add = residual.has_value();
  at::parallel_for(0, rows, 16, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      float* s = sp + r * ss;
      if (add) {
        const float* xr = xp + r * xs;
        for (int64_t i = 0; i < n; ++i) s[i] = xr[i] + s[i];
      }
      norm_row(s, wp, op + r * n, n, eps);
    }
  });
  return {out, src};
}

// Rotary embedding ("rotate half") applied in place to q [T, Hq, D] and k [T, Hk, D] (views whose
// last two dims are dense), with cos/sin tables [max_pos, D] looked up at positions [T].
void rope_(at::Tensor q, at::Tensor k, at::Tensor positions, at::Tensor cos,
           at::Tensor sin) {
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat,
              "cos/sin: contiguous float32 tables expected");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous(), "positions: int64");
  const int64_t T = positions.size(0), D = cos.size(1), h = D / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && sin.scalar_type() == at::kFloat,
              "cos/sin: [max_pos, head_dim] tables of one shape expected");
  for (int64_t r = 0; r < T; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos.size(0), "positions: beyond the rotary table");
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  for (at::Tensor* t : {&q, &k}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(0) == T && t->size(2) == D
                && t->stride(2) == 1 && t->stride(1) == D, "q/k: [T, heads, head_dim] float32, dense per row");
    const int64_t H = t->size(1), rs = t->stride(0);
    float* base = t->data_ptr<float>();
    at::parallel_for(0, T, 16, [&](int64_t a, int64_t b) {
      std::vector<float> tmp(D);
      for (int64_t r = a; r < b; ++r) {
        const float* c = cp + pos[r] * D;
        const float* s = sp + pos[r] * D;
        for (int64_t hd = 0; hd < H; ++hd) {
          float* x = base + r * rs + hd * D;
          for (int64_t i = 0; i < h; ++i) tmp[i] = x[i] * c[i] + (-x[i + h]) * s[i];
          for (int64_t i = h; i < D; ++i) tmp[i] = x[i] * c[i] + x[i - h] * s[i];
          for (int64_t i = 0; i < D; ++i) x[i] = tmp[i];
        }
      }
    });
  }
}

// The int8 linear's input (engine/layers/quant.py Int8Weight.matmul): each row of x (times
// inv_smooth when given) divided by its largest |value| (at least 1e-6), then one row spanning
// [-1, 1] appended. A span row twice as wide as x's rows is a spread weight's: each row's values
// then go to the even columns, zeros to the odd ones. Returns (prepared [T + 1, W], row maxima
// [T, 1]), W the span row's width.
std::vector<at::Tensor> int8_rows(at::Tensor x, c10::optional<at::Tensor> inv_smooth,
                                  at::Tensor span_row) {
  check_rows(x, "x");
  const int64_t T = x.size(0), K = x.size(1), xs = x.stride(0), W = span_row.numel();
  TORCH_CHECK(span_row.scalar_type() == at::kFloat && span_row.is_contiguous() && (W == K || W == 2 * K),
              "span_row: contiguous float32 of the row width (or twice it) expected");
  const bool spread = W == 2 * K;
  auto out = at::empty({T + 1, W}, x.options());
  auto rmax = at::empty({T, 1}, x.options());
  if (inv_smooth.has_value())
    TORCH_CHECK(inv_smooth->scalar_type() == at::kFloat && inv_smooth->is_contiguous() &&
                inv_smooth->numel() == K, "inv_smooth: contiguous float32 of the row width expected");
  const float* xp = x.data_ptr<float>();
  const float* sm = inv_smooth.has_value() ? inv_smooth.value().data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  float* mp = rmax.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const float* xr = xp + r * xs;
      float* o = op + r * W;
      float m = 0.0f;
      if (sm) {
#pragma omp simd
        for (int64_t i = 0; i < K; ++i) o[i] = xr[i] * sm[i];
      } else {
        std::memcpy(o, xr, K * sizeof(float));
      }
#pragma omp simd reduction(max : m)
      for (int64_t i = 0; i < K; ++i) m = std::max(m, std::fabs(o[i]));
      m = std::max(m, 1e-6f);
      mp[r] = m;
#pragma omp simd
      for (int64_t i = 0; i < K; ++i) o[i] = o[i] / m;
      if (spread) {  // from the end, so that no value is overwritten before it moves
        for (int64_t i = K - 1; i >= 0; --i) {
          o[2 * i] = o[i];
          o[2 * i + 1] = 0.0f;
        }
      }
    }
  });
  std::memcpy(op + T * W, span_row.data_ptr<float>(), W * sizeof(float));
  return {out, rmax};
}

// Each row's argmax, as torch.argmax(x, dim=-1) gives it: the first index of the largest value,
// or of the first NaN. torch's CPU argmax reads a row element by element (~27x slower than a max
// at 32 x 49k logits); here a vectorized max, then a vectorized search for its first index.
at::Tensor argmax_rows(at::Tensor x) {
  check_rows(x, "x");
  const int64_t R = x.size(0), V = x.size(1), xs = x.stride(0);
  TORCH_CHECK(V > 0, "argmax_rows: rows of at least one value expected");
  auto out = at::empty({R}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const float* p = xp + r * xs;
      // 16 lanes of running maxima (GCC vector types: AVX-512 or two AVX2 registers); without
      // -ffast-math the compiler does not vectorize a scalar max reduction by itself
      typedef float f16 __attribute__((vector_size(64)));
      typedef int i16 __attribute__((vector_size(64)));
      f16 mv;
      i16 nanv = {};
      for (int l = 0; l < 16; ++l) mv[l] = -INFINITY;
      int64_t i = 0;
      for (; i + 16 <= V; i += 16) {
        f16 v;
        std::memcpy(&v, p + i, sizeof(v));
        mv = v > mv ? v : mv;
        nanv |= v != v;
      }
      float m = -INFINITY;
      int nan = 0;
      for (int l = 0; l < 16; ++l) {
        m = std::max(m, mv[l]);
        nan |= nanv[l];
      }
      for (; i < V; ++i) {
        m = std::max(m, p[i]);
        nan |= p[i] != p[i];
      }
      i = 0;
      if (nan) {
        while (p[i] == p[i]) ++i;
      } else {
        for (; i + 64 <= V; i += 64) {
          int hit = 0;
#pragma omp simd reduction(| : hit)
          for (int64_t j = i; j < i + 64; ++j) hit |= p[j] == m;
          if (hit) break;
        }
        while (p[i] != m) ++i;   // m is in the row: found at or after i
      }
      op[r] = i;
    }
  });
  return out;
}


// The indices of each row's k largest values, in no particular order (torch.topk(k, sorted=False)'s
// set; of equal values the earlier index is kept, and a NaN is never chosen). The screened LM head
// (engine/layers/quant.py) takes a few candidates per row out of the whole vocabulary: a scan that
// compares 16 values at a time with the row's k-th best so far, and looks closer only where one
// beats it (after the first few hundred values, seldom), instead of torch's selection over a copy
// of each row.
at::Tensor topk_rows(at::Tensor x, int64_t k) {
  check_rows(x, "x");
  const int64_t R = x.size(0), V = x.size(1), xs = x.stride(0);
  TORCH_CHECK(k >= 1 && k <= 64 && k <= V, "topk_rows: k in [1, min(64, row width)] expected, got ", k);
  auto out = at::empty({R, k}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 8, [&](int64_t a, int64_t b) {
    float bv[64];
    int64_t bi[64];
    for (int64_t r = a; r < b; ++r) {
      const float* p = xp + r * xs;
      int n = 0;         // candidates held (< k only until k non-NaN values were seen)
      int low = 0;       // the held candidate that goes first: the smallest, the later of equals
      float thr = -INFINITY;
      auto offer = [&](int64_t i) {
        const float v = p[i];
        if (!(v > thr) && n == k) return;   // (NaN: never)
        if (v != v) return;
        if (n < k) {
          bv[n] = v;
          bi[n] = i;
          ++n;
        } else {
          bv[low] = v;
          bi[low] = i;
        }
        if (n < k) return;   // thr stays -inf: every value is taken until k are held
        low = 0;
        for (int j = 1; j < k; ++j)
          if (bv[j] < bv[low] || (bv[j] == bv[low] && bi[j] > bi[low])) low = j;
        thr = bv[low];
      };
      int64_t i = 0;
      for (; i < V && n < k; ++i) offer(i);   // the first k values (NaNs skipped)
#ifdef __AVX512F__
      for (; i + 64 <= V; i += 64) {
        const __m512 t = _mm512_set1_ps(thr);
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(p + i), t, _CMP_GT_OQ) |
                              _mm512_cmp_ps_mask(_mm512_loadu_ps(p + i + 16), t, _CMP_GT_OQ) |
                              _mm512_cmp_ps_mask(_mm512_loadu_ps(p + i + 32), t, _CMP_GT_OQ) |
                              _mm512_cmp_ps_mask(_mm512_loadu_ps(p + i + 48), t, _CMP_GT_OQ);
        if (hit)
          for (int64_t j = i; j < i + 64; ++j) offer(j);
      }
#endif
      for (; i < V; ++i) offer(i);
      for (int j = 0; j < n; ++j) op[r * k + j] = bi[j];
      // a row of fewer than k non-NaN values: its NaNs' indices fill the rest, in order
      for (int64_t q = 0; n < k && q < V; ++q)
        if (p[q] != p[q]) op[r * k + n++] = q;
    }
  });
  return out;
}

// ---- 4-bit weight blocks in oneDNN's bf16 arithmetic (engine/layers/quant.py, Q4Blocks) ----
//
// A weight that a GGUF file stored as Q4_0 or Q4_1 is, once dequantized, exactly d * q + m per
// block of 32 input features (q in 0..15, d and m float16 values). q4_blocks finds those blocks
// again and keeps them for 16 output features at a time: per block of 32 inputs, the 16 outputs'
// d (float16), then their m, then for each pair of inputs (2p, 2p + 1) 16 bytes, byte j holding
// output j's q of input 2p in its low nibble and of input 2p + 1 in its high one: 320 bytes for
// 512 weights. q4_linear rebuilds the weights in registers and computes what the bf16 mode's
// oneDNN product computes, bit for bit: weights and activations rounded to bf16 (nearest even),
// each output's products summed in float32 pair after pair in input order (the odd input's
// product first, as AVX512-BF16's dot-product instruction adds them) in parts of `part` inputs,
// each part from zero (oneDNN's blocks of the inputs), the parts added in order, the sum rounded
// to bf16. engine/layers/quant.py measures `part` on oneDNN and checks the bits before use. A
// step of few rows reads 0.625 bytes a weight instead of bf16's 2; a row's result depends only
// on that row, whatever the number of rows or threads.
// A negative part asks for the tiles' order instead, oneDNN's on a CPU with AMX (its brgemm
// kernel's TDPBF16PS, measured there: quant.py onednn_part): each block of 32 inputs summed from
// zero in two chains, the even inputs' products in order and the odd inputs' in order, the two
// chains' sums added, and that block's sum added to the part's running sum, in parts of -part
// inputs as above. The products are exact in float32, so each chain step is one fused
// multiply-add.
namespace {

constexpr int64_t kBlock = 32;         // input features a block covers
constexpr int64_t kGroup = 16;         // output features kept together
constexpr int64_t kGroupBytes = 320;   // 16 d, 16 m (float16), 16 pairs x 16 bytes of nibbles
constexpr int64_t kGroupBytes8 = 32 + kBlock * kGroup;   // 8-bit blocks' (q8_blocks)
constexpr int kMaxRows = 8;            // rows one pass over a group's weights serves

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// 16 float32 values rounded to bf16 (nearest even), back as float32.
inline __m512 bf16_round(__m512 v) {
  const __m512i h = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}

// One block of 32 inputs in the tiles' order (above): the even and the odd inputs' products in
// two chains from zero, their sum added to acc. xb: the block's activations (bf16 bits), rows K
// apart; blk: the group's block; d, m: its 16 outputs' d and m.
template <int R>
inline void tiles_block(const uint16_t* xb, int64_t K, const uint8_t* blk, __m512 d, __m512 m,
                        __m512* acc) {
  const __m512i low = _mm512_set1_epi32(0x0F);
  __m512 ev[R], od[R];
  for (int r = 0; r < R; ++r) ev[r] = od[r] = _mm512_setzero_ps();
  for (int p = 0; p < kBlock / 2; ++p) {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 64 + p * 16)));
    const __m512 we = bf16_round(_mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, low)), d), m));
    const __m512 wo = bf16_round(_mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d), m));
    for (int r = 0; r < R; ++r) {
      const uint16_t* xr = xb + r * K + 2 * p;
      ev[r] = _mm512_fmadd_ps(_mm512_set1_ps(bf16_value(xr[0])), we, ev[r]);
      od[r] = _mm512_fmadd_ps(_mm512_set1_ps(bf16_value(xr[1])), wo, od[r]);
    }
  }
  for (int r = 0; r < R; ++r) acc[r] = _mm512_add_ps(acc[r], _mm512_add_ps(ev[r], od[r]));
}

// x: the rows' activations as bf16 bits [R, K]; w: the groups' blocks; part_b: the blocks a part
// of the sum covers. y: bf16 bits [R, out], ys apart.
template <int R, bool Tiles>
void groups_pass(const uint16_t* x, int64_t K, const uint8_t* w, int64_t nb, int64_t part_b,
                 int64_t g0, int64_t g1, uint16_t* y, int64_t ys) {
  const __m512i low = _mm512_set1_epi32(0x0F);
  // words [even 0..15, odd 0..15] of cvtne2ps to [even 0, odd 0, even 1, odd 1, ...]
  alignas(64) static const int16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i inter = _mm512_load_si512(kInterleave);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gw = w + g * nb * kGroupBytes;
    __m512 acc[R], total[R];
    for (int r = 0; r < R; ++r) acc[r] = total[r] = _mm512_setzero_ps();
    for (int64_t b = 0, end = part_b; b < nb; ++b) {
      if (b == end) {
        end += part_b;  // a part ends: added to the parts before it
        for (int r = 0; r < R; ++r) {
          total[r] = b == part_b ? acc[r] : _mm512_add_ps(total[r], acc[r]);
          acc[r] = _mm512_setzero_ps();
        }
      }
      const uint8_t* blk = gw + b * kGroupBytes;
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
      const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
      const uint16_t* xb = x + b * kBlock;
      if constexpr (Tiles) {
        tiles_block<R>(xb, K, blk, d, m, acc);
        continue;
      }
      for (int p = 0; p < kBlock / 2; ++p) {
        const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 64 + p * 16)));
        const __m512 we = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, low)), d), m);
        const __m512 wo = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d), m);
        const __m512bh wp = (__m512bh)_mm512_permutexvar_epi16(inter, (__m512i)_mm512_cvtne2ps_pbh(wo, we));
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, xb + r * K + 2 * p, 4);
          acc[r] = _mm512_dpbf16_ps(acc[r], wp, (__m512bh)_mm512_set1_epi32(pair));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512 sum = nb > part_b ? _mm512_add_ps(total[r], acc[r]) : acc[r];
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ys + g * kGroup),
                          (__m256i)_mm512_cvtneps_pbh(sum));
    }
  }
}
#else
// The same arithmetic one value at a time (CPUs without AVX512-BF16, where quantization="auto"
// does not offer the bf16 mode; builds without AVX-512 in tests).
template <int R, bool Tiles>
void groups_pass(const uint16_t* x, int64_t K, const uint8_t* w, int64_t nb, int64_t part_b,
                 int64_t g0, int64_t g1, uint16_t* y, int64_t ys) {
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gw = w + g * nb * kGroupBytes;
    for (int64_t j = 0; j < kGroup; ++j) {
      float acc[R] = {}, total[R] = {};
      for (int64_t b = 0, end = part_b; b < nb; ++b) {
        if (b == end) {
          end += part_b;
          for (int r = 0; r < R; ++r) {
            total[r] = b == part_b ? acc[r] : total[r] + acc[r];
            acc[r] = 0.0f;
          }
        }
        const uint8_t* blk = gw + b * kGroupBytes;
        const float d = half_at(blk + 2 * j), m = half_at(blk + 32 + 2 * j);
        float ev[R] = {}, od[R] = {};  // the tiles' two chains of this block
        for (int p = 0; p < kBlock / 2; ++p) {
          const uint8_t q = blk[64 + p * 16 + j];
          const float we = bf16_value(bf16_bits(static_cast<float>(q & 0x0F) * d + m));
          const float wo = bf16_value(bf16_bits(static_cast<float>(q >> 4) * d + m));
          for (int r = 0; r < R; ++r) {
            const uint16_t* xr = x + r * K + b * kBlock + 2 * p;
            if (Tiles) {  // exact products: one rounding each sum
              ev[r] += we * bf16_value(xr[0]);
              od[r] += wo * bf16_value(xr[1]);
            } else {
              acc[r] += wo * bf16_value(xr[1]);
              acc[r] += we * bf16_value(xr[0]);
            }
          }
        }
        if (Tiles) {
          for (int r = 0; r < R; ++r) acc[r] += ev[r] + od[r];
        }
      }
      for (int r = 0; r < R; ++r) {
        y[r * ys + g * kGroup + j] = bf16_bits(nb > part_b ? total[r] + acc[r] : acc[r]);
      }
    }
  }
}
#endif

template <bool Tiles>
void groups_any(int rows, const uint16_t* x, int64_t K, const uint8_t* w, int64_t nb,
                int64_t part_b, int64_t g0, int64_t g1, uint16_t* y, int64_t ys) {
  switch (rows) {
    case 1: return groups_pass<1, Tiles>(x, K, w, nb, part_b, g0, g1, y, ys);
    case 2: return groups_pass<2, Tiles>(x, K, w, nb, part_b, g0, g1, y, ys);
    case 3: return groups_pass<3, Tiles>(x, K, w, nb, part_b, g0, g1, y, ys);
    case 4: return groups_pass<4, Tiles>(x, K, w, nb, part_b, g0, g1, y, ys);
    case 5: return groups_pass<5, Tiles>(x, K, w, nb, part_b, g0, g1, y, ys);
    case 6: return groups_pass<6, Tiles>(x, K, w, nb, part_b, g0, g1, y, ys);
    case 7: return groups_pass<7, Tiles>(x, K, w, nb, part_b, g0, g1, y, ys);
    default: return groups_pass<8, Tiles>(x, K, w, nb, part_b, g0, g1, y, ys);
  }
}

// One block in the form d * q + m (d, m float16 values, q in 0..15) that rebuilds its 32 weights
// bit for bit: its d, m and q; false if this (d, m) does not.
bool try_block(const float* v, float d, float m, c10::Half* dm, uint8_t* qs) {
  const c10::Half dh(d), mh(m);
  const float df = static_cast<float>(dh), mf = static_cast<float>(mh);
  if (mf != m) return false;
  // (v - m) / d by its reciprocal, with no early exit, so the loop vectorizes: a q off by the
  // reciprocal's rounding fails the exact check like any other
  const float inv = df != 0.0f ? 1.0f / df : 0.0f;
  float q[kBlock];
  bool exact = true;
  for (int64_t j = 0; j < kBlock; ++j) {
    q[j] = std::min(15.0f, std::max(0.0f, std::nearbyint((v[j] - mf) * inv)));
    exact &= q[j] * df + mf == v[j];  // d * q is exact
  }
  if (!exact) return false;
  dm[0] = dh;
  dm[1] = mh;
  for (int64_t j = 0; j < kBlock; ++j) qs[j] = static_cast<uint8_t>(q[j]);
  return true;
}

}  // namespace

// The blocks of a float32 weight [out, in] (out a multiple of 16, in of 32): for each output n
// and block of 32 inputs, `fit(v, o, j)` takes its 32 weights v and writes them as output j of
// their group into the group's block at o (group_bytes long), or returns false if they are not
// exactly such a block; then the whole weight is refused (None), with no block read after it.
template <typename Fit>
c10::optional<at::Tensor> find_blocks(const at::Tensor& w, int64_t group_bytes, Fit fit) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 2 &&
                  w.is_contiguous() && w.size(1) % kBlock == 0 && w.size(0) % kGroup == 0,
              "w: contiguous CPU float32 [out, in] with out a multiple of 16, in of 32 expected");
  const int64_t out = w.size(0), nb = w.size(1) / kBlock;
  auto blocks = at::empty({out / kGroup, nb * group_bytes}, w.options().dtype(at::kByte));
  const float* wp = w.data_ptr<float>();
  uint8_t* bp = blocks.data_ptr<uint8_t>();
  std::atomic<bool> exact{true};
  at::parallel_for(0, out * nb, 256, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b && exact.load(std::memory_order_relaxed); ++i) {
      const int64_t n = i / nb, blk = i % nb;
      if (!fit(wp + i * kBlock, bp + ((n / kGroup) * nb + blk) * group_bytes, n % kGroup)) {
        exact = false;
        break;
      }
    }
  });
  if (!exact) return c10::nullopt;
  return blocks;
}

// The 4-bit blocks of a float32 weight [out, in] (out a multiple of 16, in of 32) in the layout
// above, or None if one block is not exactly d * q + m. Q4_1 stores m as the block's minimum and
// d as its span over 15; Q4_0 stores d * (q - 8) with q = 0 at the block's largest magnitude, the
// same form with m that value and d = -m / 8. Each block is kept in the first form that rebuilds it.
c10::optional<at::Tensor> q4_blocks(at::Tensor w) {
  return find_blocks(w, kGroupBytes, [](const float* v, uint8_t* o, int64_t j) {
    float lo = v[0], hi = v[0], ext = v[0];
    for (int64_t k = 1; k < kBlock; ++k) {
      lo = std::min(lo, v[k]);
      hi = std::max(hi, v[k]);
      if (std::fabs(v[k]) > std::fabs(ext)) ext = v[k];
    }
    if (!(std::isfinite(lo) && std::isfinite(hi))) return false;
    c10::Half dm[2];
    uint8_t qs[kBlock];
    if (!try_block(v, (hi - lo) / 15.0f, lo, dm, qs) && !try_block(v, -ext / 8.0f, ext, dm, qs))
      return false;
    std::memcpy(o + 2 * j, &dm[0].x, 2);
    std::memcpy(o + 32 + 2 * j, &dm[1].x, 2);
    for (int64_t p = 0; p < kBlock / 2; ++p)
      o[64 + p * 16 + j] = static_cast<uint8_t>(qs[2 * p] | (qs[2 * p + 1] << 4));
    return true;
  });
}

// x [rows, in] (float32 or bfloat16) times the blocks of a weight [out / 16, in / 32 * 320]
// (uint8) in oneDNN's bf16 arithmetic (above), in parts of `part` inputs (a multiple of 32; a
// negative one: the tiles' order in parts of -part): [rows, out] bfloat16.
at::Tensor q4_linear(at::Tensor x, at::Tensor blocks, int64_t part) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x: CPU float32 or bfloat16 [rows, in] expected");
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte &&
                  blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks: contiguous uint8 [out / 16, in / 32 * 320] expected");
  const int64_t rows = x.size(0), in = x.size(1), groups = blocks.size(0), out = groups * kGroup;
  TORCH_CHECK(in % kBlock == 0 && blocks.size(1) == in / kBlock * kGroupBytes,
              "blocks: ", in / kBlock * kGroupBytes, " bytes a group expected for ", in, " inputs");
  TORCH_CHECK(part != 0 && part % kBlock == 0, "part: a nonzero multiple of 32 expected");
  const bool tiles = part < 0;
  part = tiles ? -part : part;
  auto y = at::empty({rows, out}, x.options().dtype(at::kBFloat16));
  if (rows == 0 || out == 0) return y;
  // the activations as bf16, rounded as .to(torch.bfloat16) rounds them
  std::vector<uint16_t> xr(static_cast<size_t>(rows * in));
  const auto xc = x.contiguous();
  if (xc.scalar_type() == at::kFloat) {
    to_bf16(xc.data_ptr<float>(), xr.data(), rows * in);
  } else {
    std::memcpy(xr.data(), xc.data_ptr<at::BFloat16>(), static_cast<size_t>(rows * in) * 2);
  }
  const uint16_t* xp = xr.data();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t nb = in / kBlock, part_b = part / kBlock;
  // Each thread takes a range of output groups; every row chunk of kMaxRows reuses the group's
  // weights while they are in cache.
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
      const int r = static_cast<int>(std::min<int64_t>(kMaxRows, rows - r0));
      if (tiles) {
        groups_any<true>(r, xp + r0 * in, in, wp, nb, part_b, g0, g1, yp + r0 * out, out);
      } else {
        groups_any<false>(r, xp + r0 * in, in, wp, nb, part_b, g0, g1, yp + r0 * out, out);
      }
    }
  });
  return y;
}


// ---- bf16 weights packed for our own product in oneDNN's bf16 arithmetic (steps of more rows) ----
//
// oneDNN's bf16 linear at 32 rows ran SmolLM2's decoder linears at 204-257 GFLOPS on the
// AVX-512 BF16 EPYC, where this loop of AVX512-BF16 dot products runs them at 347-420 (its large
// GEMMs: 410). It computes the same bits as q4_linear above (so as oneDNN: quant.py checks them
// before use): each output's products summed pair after pair in input order, in parts of `part`
// inputs, the parts added in order, the sum rounded to bf16. bf16_pack lays a weight [out, in]
// out as [out / 16, in / 2, 16, 2] bf16 (16 outputs' pair of inputs in one 64-byte load);
// bf16_linear takes 48 outputs at a time (24 accumulators of 8 rows) and every 8 rows of the
// step, each thread its own outputs. Built only where the compiler targets AVX512-BF16;
// elsewhere bf16_linear_fast() is false and quant.py keeps oneDNN.
namespace {
constexpr int kBpRows = 8;     // rows a pass over a tile's weights serves
constexpr int kBpGroups = 3;   // 16-output groups a tile takes (3 x 8 accumulators)

// Each thread takes whole tiles of kBpGroups output groups, and every kBpRows rows of the step
// reuse a tile's weights while they are in cache: f(first group, groups in the tile, first row,
// rows) for each such pass.
template <typename F>
void for_each_pass(int64_t rows, int64_t groups, F&& f) {
  const int64_t tiles = (groups + kBpGroups - 1) / kBpGroups;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t * kBpGroups, cb = std::min<int64_t>(kBpGroups, groups - g);
      for (int64_t r0 = 0; r0 < rows; r0 += kBpRows)
        f(g, cb, r0, static_cast<int>(std::min<int64_t>(kBpRows, rows - r0)));
    }
  });
}

// f(std::integral_constant<int, r>) for a row count r in 1..kBpRows: the kernels' templates take
// the rows of a pass as a constant
template <typename F>
inline void with_rows(int r, F&& f) {
  switch (r) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

#if defined(__AVX512F__)
// A pass's accumulators at the end of a part of the sums: added to the parts before it (the
// first part is kept as it is), then cleared for the next part.
template <int R, int CB>
inline void end_part(__m512 (&acc)[R][CB], float (&total)[R][CB][16], bool first) {
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CB; ++c) {
      _mm512_store_ps(total[r][c], first ? acc[r][c] : _mm512_add_ps(_mm512_load_ps(total[r][c]), acc[r][c]));
      acc[r][c] = _mm512_setzero_ps();
    }
}

// output (r, c) of a pass: the parts before the last one plus the last (parts: there were some)
template <int R, int CB>
inline __m512 pass_sum(const __m512 (&acc)[R][CB], const float (&total)[R][CB][16], int r, int c, bool parts) {
  return parts ? _mm512_add_ps(_mm512_load_ps(total[r][c]), acc[r][c]) : acc[r][c];
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
template <int R, int CB>
void bf16_tile(const uint16_t* x, int64_t K, const uint16_t* w, int64_t K2, int64_t part_p,
               uint16_t* y, int64_t ys) {
  __m512 acc[R][CB];
  alignas(64) float total[R][CB][16];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_setzero_ps();
  // a loop per part: the inner loop neither divides nor branches (a division every input to find
  // the parts' ends made it 2x slower), so the accumulators stay in registers
  for (int64_t p0 = 0; p0 < K2; p0 += part_p) {
    if (p0 > 0) end_part(acc, total, p0 == part_p);
    for (int64_t p = p0, p1 = std::min(K2, p0 + part_p); p < p1; ++p) {
      __m512i b[CB];
      for (int c = 0; c < CB; ++c) b[c] = _mm512_loadu_si512(w + (c * K2 + p) * 32);
      for (int r = 0; r < R; ++r) {
        int32_t pair;
        std::memcpy(&pair, x + r * K + 2 * p, 4);
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], (__m512bh)b[c], a);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CB; ++c) {
      const __m512 sum = pass_sum(acc, total, r, c, K2 > part_p);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ys + c * 16), (__m256i)_mm512_cvtneps_pbh(sum));
    }
}

#endif
}  // namespace

bool bf16_linear_fast() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

// w [out, in] (float32 or bfloat16; out a multiple of 16, in of 2) as bf16 rounded as
// .to(torch.bfloat16) rounds it, laid out [out / 16, in / 2, 16, 2]: uint16 [out / 16, in * 16].
at::Tensor bf16_pack(at::Tensor w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.size(0) % 16 == 0 && w.size(1) % 2 == 0,
              "bf16_pack: a CPU weight [out, in], out a multiple of 16 and in of 2, expected");
  const auto wb = w.to(at::kBFloat16).contiguous();
  const int64_t out = w.size(0), in = w.size(1);
  auto packed = at::empty({out / 16, in * 16}, w.options().dtype(at::kShort));
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wb.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<int16_t>());
  at::parallel_for(0, out / 16, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t p = 0; p < in / 2; ++p)
        for (int64_t j = 0; j < 16; ++j) {
          const uint16_t* row = src + (g * 16 + j) * in;
          uint16_t* d = dst + g * in * 16 + p * 32 + j * 2;
          d[0] = row[2 * p];
          d[1] = row[2 * p + 1];
        }
  });
  return packed;
}

// x [rows, in] (float32 or bfloat16) times a bf16_pack'ed weight in oneDNN's bf16 arithmetic,
// in parts of `part` inputs (even): [rows, out] bfloat16.
at::Tensor bf16_linear(at::Tensor x, at::Tensor packed, int64_t part) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "bf16_linear: x CPU float32 or bfloat16 [rows, in] expected");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kShort && packed.dim() == 2 &&
                  packed.is_contiguous() && packed.size(1) == x.size(1) * 16,
              "bf16_linear: packed int16 [out / 16, in * 16] (bf16_pack) expected");
  TORCH_CHECK(part > 0 && part % 2 == 0, "bf16_linear: part must be positive and even");
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const int64_t rows = x.size(0), in = x.size(1), groups = packed.size(0), out = groups * 16;
  auto y = at::empty({rows, out}, x.options().dtype(at::kBFloat16));
  if (rows == 0 || out == 0) return y;
  std::vector<uint16_t> xr;
  const uint16_t* xp;
  const auto xc = x.contiguous();
  if (xc.scalar_type() == at::kFloat) {
    xr.resize(static_cast<size_t>(rows * in));
    to_bf16(xc.data_ptr<float>(), xr.data(), rows * in);
    xp = xr.data();
  } else {
    xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  }
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<int16_t>());
  uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t K2 = in / 2, part_p = std::min(part / 2, K2);
  for_each_pass(rows, groups, [&](int64_t g, int64_t cb, int64_t r0, int r) {
    const uint16_t *wt = wp + g * in * 16, *xt = xp + r0 * in;
    uint16_t* yt = yp + r0 * out + g * 16;
    with_rows(r, [&](auto R) {
      constexpr int kR = decltype(R)::value;
      if (cb == 3) bf16_tile<kR, 3>(xt, in, wt, K2, part_p, yt, out);
      else if (cb == 2) bf16_tile<kR, 2>(xt, in, wt, K2, part_p, yt, out);
      else bf16_tile<kR, 1>(xt, in, wt, K2, part_p, yt, out);
    });
  });
  return y;
#else
  TORCH_CHECK(false, "bf16_linear: built without AVX512-BF16 (bf16_linear_fast() is false)");
#endif
}


// ---- bf16 weights on AMX's tile units, in oneDNN's order (the Intel Xeon kind) ----
//
// oneDNN's bf16 linear streamed SmolLM2's decoder weights at 15 GB/s at 32 rows on the AMX Xeon,
// where the memory gives 24. amx_linear multiplies with the same instruction (TDPBF16PS) in the
// same order as oneDNN does for steps of up to 32 rows: for each 16 x 16 block of outputs, one
// tile of float32 sums that every 32 inputs' tile product adds to, in input order, rounded to
// bf16 at the end (quant.py amx_product checks these bits against oneDNN's before a layer takes
// it). Steps of more rows run as chunks of 32 over each 32 outputs' weights while they are in
// cache, so a row's bits do not depend on the step's size (oneDNN's do past 32 rows). amx_pack
// lays a weight [out, in] out as bf16 [out / 32, in / 32, 2, 16, 16, 2]: for each 32 outputs and
// 32 inputs, two tiles of 16 outputs' input pairs. One thread pool, as every kernel here; each
// thread configures its tiles when it starts a part of the outputs and releases them after.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
namespace {
constexpr int64_t kAmxRows = 32;   // rows a chunk serves: two 16-row tiles
constexpr int64_t kAmxOut = 32;    // outputs a pass serves: two 16-output tiles
constexpr int64_t kAmxTile = 512;  // bf16 values in a weight tile (16 input pairs x 16 outputs)
constexpr int64_t kAmxRowBlock = 512;  // rows whose inputs stay in L2 (a step's rows in blocks)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: the sums of (row tile, output tile) (0, 0), (0, 1), (1, 0), (1, 1); 4, 5: the two
// row tiles' inputs (m0 and m1 rows, m1 >= 1 even when unused); 6, 7: the two weight tiles.
void configure_tiles(int m0, int m1) {
  TileConfig c;
  const int rows[8] = {m0, m0, m1, m1, m0, m1, 16, 16};
  for (int t = 0; t < 8; ++t) {
    c.rows[t] = static_cast<uint8_t>(rows[t]);
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

void store_chunk(void* y, int64_t ys, int64_t rows, int m1, bool f32, float (&c)[4][256]);

// One chunk of rows (m0 + m1 <= 32) times 32 outputs' weights, block kb's two weight tiles at
// tiles_at(kb) (in input order); y: bf16 bits, ys apart, or with `f32` the float32 sums.
template <typename TilesAt>
void tile_chunk(const uint16_t* x, int64_t K, TilesAt&& tiles_at, int m1, void* y, int64_t ys,
                int64_t rows, bool f32, float (&c)[4][256]) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < K / 32; ++kb) {
    const uint16_t* wt = tiles_at(kb);
    _tile_loadd(4, x + kb * 32, K * 2);
    _tile_loadd(6, wt, 64);
    _tile_loadd(7, wt + kAmxTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (m1 > 0) {
      _tile_loadd(5, x + 16 * K + kb * 32, K * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  store_chunk(y, ys, rows, m1, f32, c);
}

// tile_chunk on weights in amx_pack's layout at w
void amx_chunk(const uint16_t* x, int64_t K, const uint16_t* w, int m1, void* y, int64_t ys,
               int64_t rows, bool f32, float (&c)[4][256]) {
  auto at = [w](int64_t kb) {
    _mm_prefetch(reinterpret_cast<const char*>(w + (kb + 4) * 2 * kAmxTile), _MM_HINT_T0);
    return w + kb * 2 * kAmxTile;
  };
  tile_chunk(x, K, at, m1, y, ys, rows, f32, c);
}

// The chunk's sums (tiles 0-3) to y: bf16 bits, ys apart, or with `f32` the float32 sums.
void store_chunk(void* y, int64_t ys, int64_t rows, int m1, bool f32, float (&c)[4][256]) {
  _tile_stored(0, c[0], 64);
  _tile_stored(1, c[1], 64);
  if (m1 > 0) {
    _tile_stored(2, c[2], 64);
    _tile_stored(3, c[3], 64);
  }
  for (int64_t r = 0; r < rows; ++r)
    for (int h = 0; h < 2; ++h) {
      const __m512 sums = _mm512_loadu_ps(c[(r < 16 ? 0 : 2) + h] + (r % 16) * 16);
      if (f32) {
        _mm512_storeu_ps(static_cast<float*>(y) + r * ys + h * 16, sums);
      } else {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(y) + r * ys + h * 16),
                            (__m256i)_mm512_cvtneps_pbh(sums));
      }
    }
}

bool amx_permitted() {
  // Linux hands a process the tiles' state only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM
  // for XFEATURE_XTILEDATA); oneDNN asks the same way, and asking twice is harmless.
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}
}  // namespace
#endif

bool amx_bf16_ready() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx_permitted();
#else
  return false;
#endif
}

// w [out, in] (float32 or bfloat16; out and in multiples of 32) as bf16 rounded as
// .to(torch.bfloat16) rounds it, in amx_linear's layout: bfloat16 [out / 32, in * 32].
at::Tensor amx_pack(at::Tensor w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.size(0) % 32 == 0 && w.size(1) % 32 == 0,
              "amx_pack: a CPU weight [out, in], out and in multiples of 32, expected");
  const auto wb = w.to(at::kBFloat16).contiguous();
  const int64_t out = w.size(0), in = w.size(1), kbs = in / 32;
  auto packed = at::empty({out / 32, in * 32}, w.options().dtype(at::kBFloat16));
  const uint16_t* src = reinterpret_cast<const uint16_t*>(wb.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>());
  at::parallel_for(0, out / 32, 1, [&](int64_t n0, int64_t n1) {
    for (int64_t nt = n0; nt < n1; ++nt)
      for (int64_t kb = 0; kb < kbs; ++kb)
        for (int64_t h = 0; h < 2; ++h)
          for (int64_t p = 0; p < 16; ++p)
            for (int64_t n = 0; n < 16; ++n) {
              const uint16_t* row = src + (nt * 32 + h * 16 + n) * in + kb * 32 + p * 2;
              uint16_t* d = dst + (((nt * kbs + kb) * 2 + h) * 16 + p) * 32 + n * 2;
              d[0] = row[0];
              d[1] = row[1];
            }
  });
  return packed;
}

// x [rows, in] (float32 or bfloat16) times an amx_pack'ed weight: [rows, out] bfloat16 (oneDNN's
// output), or with float_out the float32 sums before that rounding (the head's screen).
at::Tensor amx_linear(at::Tensor x, at::Tensor packed, bool float_out = false) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "amx_linear: x CPU float32 or bfloat16 [rows, in] expected");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kBFloat16 &&
                  packed.dim() == 2 && packed.is_contiguous() && packed.size(1) == x.size(1) * 32,
              "amx_linear: packed bfloat16 [out / 32, in * 32] (amx_pack) expected");
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  TORCH_CHECK(amx_permitted(), "amx_linear: the kernel did not grant this process AMX's tiles");
  const int64_t rows = x.size(0), in = x.size(1), tiles = packed.size(0), out = tiles * kAmxOut;
  auto y = at::empty({rows, out}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (rows == 0 || out == 0) return y;
  const auto xb = x.scalar_type() == at::kBFloat16 ? x.contiguous() : x.to(at::kBFloat16).contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  char* yp = static_cast<char*>(y.data_ptr());
  const int64_t esz = y.element_size();
  // blocks of rows whose inputs stay in L2 while every 32 outputs' weights pass over them
  for (int64_t b0 = 0; b0 < rows; b0 += kAmxRowBlock) {
    const int64_t b1 = std::min(rows, b0 + kAmxRowBlock);
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      alignas(64) float c[4][256];
      int configured = -1;  // the chunk size the tiles are configured for
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t r0 = b0; r0 < b1; r0 += kAmxRows) {
          const int n = static_cast<int>(std::min(kAmxRows, b1 - r0)), m1 = std::max(0, n - 16);
          if (n != configured) {
            configure_tiles(std::min(n, 16), std::max(m1, 1));
            configured = n;
          }
          amx_chunk(xp + r0 * in, in, wp + t * in * kAmxOut, m1,
                    yp + (r0 * out + t * kAmxOut) * esz, out, n, float_out, c);
        }
      if (configured != -1) _tile_release();
    });
  }
  return y;
#else
  TORCH_CHECK(false, "amx_linear: built without AMX (amx_bf16_ready() is false)");
#endif
}

// ---- 4-bit blocks on AMX's tiles (the Intel Xeon kind) ----
//
// amx_linear's product of a weight that is exactly 4-bit blocks (Q4Blocks), bit for bit, read
// at 0.625 bytes a weight instead of bf16's 2. amx_q4_pack rearranges q4_blocks' layout so that
// rebuilding a tile row takes few instructions: per 32 outputs, per block of 32 inputs, per half
// of 16 outputs, the 16 outputs' d and m (float16) and then, for each pair of inputs p, 16 bytes
// whose byte j holds in its low nibble the q of output j / 2 (of the half) at input 2p + j % 2,
// and in its high nibble that of output 8 + j / 2: the two nibbles of 16 bytes become the 32 bf16
// values of the tile row in order (the even and odd input of each output side by side, as
// TDPBF16PS takes them). Each weight is rebuilt as d * q + m in float32 (one fused multiply-add:
// d * q is exact, so this is q4_linear's rebuild) and rounded to bf16 as amx_pack rounds it, into
// a tile in amx_pack's layout that the tile products then take as amx_linear takes the packing:
// the same sums in the same order. Rebuilt right before use, once per step, SmolLM2's decoder
// linears run 1.6-1.8x faster than amx_linear at 1-32 rows and 1.1-1.4x at 33-100 (2 threads,
// the AMX Xeon, 2026-12-04); rebuilt from q4_blocks' own layout (an interleave per tile row)
// into a buffer in L2 before use, they were no faster than amx_linear. 8-bit blocks
// (q8_blocks) are taken in their own layout (Q8Amx below, amx_q8_linear).
constexpr int64_t kQ4AmxHalf = 64 + 16 * 16;   // one half's d, m and 16 rows of nibbles

at::Tensor amx_q4_pack(at::Tensor blocks) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous() && blocks.size(0) % 2 == 0 &&
                  blocks.size(1) % kGroupBytes == 0,
              "amx_q4_pack: q4_blocks' uint8 [out / 16, in / 32 * 320], out a multiple of 32, "
              "expected");
  const int64_t tiles = blocks.size(0) / 2, nb = blocks.size(1) / kGroupBytes;
  auto packed = at::empty({tiles, nb * 2 * kQ4AmxHalf}, blocks.options());
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t kb = 0; kb < nb; ++kb)
        for (int64_t h = 0; h < 2; ++h) {
          const uint8_t* blk = src + ((2 * t + h) * nb + kb) * kGroupBytes;
          uint8_t* o = dst + (t * nb * 2 + kb * 2 + h) * kQ4AmxHalf;
          std::memcpy(o, blk, 64);   // d, m
          // q of output n at input 2p + e: q4_blocks keeps it in byte 64 + p * 16 + n,
          // the low nibble for e = 0
          auto q = [&](int64_t n, int64_t p, int64_t e) {
            const uint8_t b = blk[64 + p * 16 + n];
            return e == 0 ? b & 0x0F : b >> 4;
          };
          for (int64_t p = 0; p < 16; ++p)
            for (int64_t j = 0; j < 16; ++j)
              o[64 + p * 16 + j] = static_cast<uint8_t>(q(j / 2, p, j % 2) | (q(8 + j / 2, p, j % 2) << 4));
        }
  });
  return packed;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
namespace {
// The two kinds of blocks the tiles take: where each half (16 outputs) of a tile's 32 outputs
// keeps its blocks (`half`: block 0 of half hh, the next ones `step` bytes apart), and how a
// block is rebuilt into a tile of amx_pack's layout at dst (`rebuild`). The bf16 rounding is
// amx_pack's (nearest even) of the exact float32 weight.
const __m512i kLoOut = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
const __m512i kHiOut = _mm512_add_epi32(kLoOut, _mm512_set1_epi32(8));

inline void prefetch_ahead(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(p + o), _MM_HINT_T0);
}

struct Q4Amx {   // amx_q4_pack's layout (above)
  static constexpr int64_t step = 2 * kQ4AmxHalf;
  static const uint8_t* half(const uint8_t* wp, int64_t hh, int64_t nb) {
    return wp + (hh / 2) * nb * step + (hh % 2) * kQ4AmxHalf;
  }
  static void rebuild(const uint8_t* half, uint16_t* dst) {
    const __m512i low = _mm512_set1_epi32(0x0F);
    prefetch_ahead(half + 4 * step, kQ4AmxHalf);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half)));
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half + 32)));
    const __m512 d0 = _mm512_permutexvar_ps(kLoOut, d), d1 = _mm512_permutexvar_ps(kHiOut, d);
    const __m512 m0 = _mm512_permutexvar_ps(kLoOut, m), m1 = _mm512_permutexvar_ps(kHiOut, m);
    for (int p = 0; p < kBlock / 2; ++p) {
      const __m512i q = _mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(half + 64 + p * 16)));
      const __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, low)), d0, m0);
      const __m512 b = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d1, m1);
      _mm512_store_si512(dst + p * 32, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
};

struct Q8Amx {   // q8_blocks' own layout: each group of 16 outputs is a half, d * q exact
  static constexpr int64_t step = kGroupBytes8;
  static const uint8_t* half(const uint8_t* wp, int64_t hh, int64_t nb) { return wp + hh * nb * step; }
  static void rebuild(const uint8_t* half, uint16_t* dst) {
    prefetch_ahead(half + 4 * step, kGroupBytes8);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(half)));
    const __m512 d0 = _mm512_permutexvar_ps(kLoOut, d), d1 = _mm512_permutexvar_ps(kHiOut, d);
    for (int p = 0; p < kBlock / 2; ++p) {
      // inputs 2p and 2p + 1, 16 outputs' q each; interleaved: each output's pair side by side
      const __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(half + 32 + 2 * p * 16));
      const __m128i o = _mm_loadu_si128(reinterpret_cast<const __m128i*>(half + 32 + (2 * p + 1) * 16));
      const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(e, o)));
      const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi8(e, o)));
      _mm512_store_si512(dst + p * 32,
                         (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(b, d1), _mm512_mul_ps(a, d0)));
    }
  }
};

// amx_chunk for one chunk of rows (m0 + m1 <= 32) on 32 outputs kept as blocks (h0, h1: their
// halves' first blocks): each block's two weight tiles rebuilt right before their products, the
// same products in the same order; into two tiles in turn at w (`ring`, in L1) or, for the
// chunks after it to take, block kb's at w + kb * 2 tiles (amx_pack's layout).
template <typename Dec>
void blocks_chunk(const uint16_t* x, int64_t K, const uint8_t* h0, const uint8_t* h1, uint16_t* w,
                  bool ring, int m1, void* y, int64_t ys, int64_t rows, bool f32,
                  float (&c)[4][256]) {
  auto at = [=](int64_t kb) {
    uint16_t* wt = w + (ring ? kb & 1 : kb) * 2 * kAmxTile;
    Dec::rebuild(h0 + kb * Dec::step, wt);
    Dec::rebuild(h1 + kb * Dec::step, wt + kAmxTile);
    return static_cast<const uint16_t*>(wt);
  };
  tile_chunk(x, K, at, m1, y, ys, rows, f32, c);
}

}  // namespace
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
namespace {
// x [rows, in] times `tiles` * 32 outputs kept as Dec's blocks at wp: amx_linear's result. In
// blocks of kAmxRowBlock rows; for each 32 outputs, the row block's first chunk of 32 rows
// rebuilds the weights as it multiplies them (blocks_chunk): into two tiles in turn in L1 where
// that chunk is all (a decode step), else into a buffer of the thread's (amx_pack's layout, in
// L2) that the other chunks multiply as amx_linear multiplies the packing (amx_chunk), so each
// weight is rebuilt once per row block. (Narrow passes of one 16-output tile over up to five
// row tiles, rebuilding in L1 for up to 80 rows, measured the same as this within the noise.)
template <typename Dec>
at::Tensor blocks_linear(const at::Tensor& x, const uint8_t* wp, int64_t tiles, bool float_out) {
  const int64_t rows = x.size(0), in = x.size(1), out = tiles * kAmxOut, nb = in / kBlock;
  auto y = at::empty({rows, out}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (rows == 0 || out == 0) return y;
  const auto xb = x.scalar_type() == at::kBFloat16 ? x.contiguous() : x.to(at::kBFloat16).contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xb.data_ptr<at::BFloat16>());
  char* yp = static_cast<char*>(y.data_ptr());
  const int64_t esz = y.element_size();
  for (int64_t b0 = 0; b0 < rows; b0 += kAmxRowBlock) {
    const int64_t b1 = std::min(rows, b0 + kAmxRowBlock);
    const bool ring = b1 - b0 <= kAmxRows;   // one chunk: nothing to keep for another
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      alignas(64) float c[4][256];
      std::unique_ptr<uint16_t[]> buf(new uint16_t[(ring ? 4 * kAmxTile : in * kAmxOut) + 32]);
      uint16_t* w = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(buf.get()) + 63) & ~uintptr_t(63));
      int configured = -1;
      for (int64_t t = t0; t < t1; ++t) {
        {
          const int n = static_cast<int>(std::min(kAmxRows, b1 - b0)), m1 = std::max(0, n - 16);
          if (n != configured) {
            configure_tiles(std::min(n, 16), std::max(m1, 1));
            configured = n;
          }
          blocks_chunk<Dec>(xp + b0 * in, in, Dec::half(wp, 2 * t, nb),
                            Dec::half(wp, 2 * t + 1, nb), w, ring, m1,
                            yp + (b0 * out + t * kAmxOut) * esz, out, n, float_out, c);
        }
        for (int64_t r0 = b0 + kAmxRows; r0 < b1; r0 += kAmxRows) {
          const int n = static_cast<int>(std::min(kAmxRows, b1 - r0)), m1 = std::max(0, n - 16);
          if (n != configured) {
            configure_tiles(std::min(n, 16), std::max(m1, 1));
            configured = n;
          }
          amx_chunk(xp + r0 * in, in, w, m1, yp + (r0 * out + t * kAmxOut) * esz, out, n,
                    float_out, c);
        }
      }
      if (configured != -1) _tile_release();
    });
  }
  return y;
}
}  // namespace
#endif

// x [rows, in] (float32 or bfloat16) times an amx_q4_pack'ed weight: [rows, out] bfloat16, or
// with float_out the float32 sums, as amx_linear gives them (blocks_linear).
at::Tensor amx_q4_linear(at::Tensor x, at::Tensor packed, bool float_out = false) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "amx_q4_linear: x CPU float32 or bfloat16 [rows, in] expected");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte &&
                  packed.dim() == 2 && packed.is_contiguous() && x.size(1) % kBlock == 0 &&
                  packed.size(1) == x.size(1) / kBlock * 2 * kQ4AmxHalf,
              "amx_q4_linear: packed uint8 [out / 32, in / 32 * 640] (amx_q4_pack) expected");
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  TORCH_CHECK(amx_permitted(), "amx_q4_linear: the kernel did not grant this process AMX's tiles");
  return blocks_linear<Q4Amx>(x, packed.data_ptr<uint8_t>(), packed.size(0), float_out);
#else
  TORCH_CHECK(false, "amx_q4_linear: built without AMX (amx_bf16_ready() is false)");
#endif
}

// x [rows, in] (float32 or bfloat16) times a weight kept as its 8-bit blocks (q8_blocks' layout,
// as int8 [out / 16, in / 32 * 544], out a multiple of 32) on the tiles: amx_linear's result on
// that weight, bf16 or with float_out its float32 sums (blocks_linear), at 1.0625 bytes a weight.
at::Tensor amx_q8_linear(at::Tensor x, at::Tensor blocks, bool float_out = false) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "amx_q8_linear: x CPU float32 or bfloat16 [rows, in] expected");
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kChar &&
                  blocks.dim() == 2 && blocks.is_contiguous() && blocks.size(0) % 2 == 0 &&
                  x.size(1) % kBlock == 0 && blocks.size(1) == x.size(1) / kBlock * kGroupBytes8,
              "amx_q8_linear: blocks int8 [out / 16, in / 32 * 544] (q8_blocks), out a multiple "
              "of 32, expected");
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  TORCH_CHECK(amx_permitted(), "amx_q8_linear: the kernel did not grant this process AMX's tiles");
  return blocks_linear<Q8Amx>(x, reinterpret_cast<const uint8_t*>(blocks.data_ptr<int8_t>()),
                              blocks.size(0) / 2, float_out);
#else
  TORCH_CHECK(false, "amx_q8_linear: built without AMX (amx_bf16_ready() is false)");
#endif
}


// ---- float32 weights packed for our own product in oneDNN's float32 arithmetic ----
//
// The float32 mode's counterpart of bf16_linear: oneDNN's float32 linear ran 126-132 GFLOPS at 32
// rows with the weights in cache on the AVX-512 EPYC, against 176 for its large GEMMs. f32_linear
// sums as oneDNN's float32 product does (q4_linear_f32 above: one chain of fused multiply-adds per
// output in input order, in parts of `part` inputs, the parts added in order), 8 rows x 48 outputs
// a pass over weights f32_pack'ed [out / 16, in, 16]. AVX-512 builds only (f32_linear_fast());
// quant.py's own_f32 checks its bits against oneDNN's before a layer takes it.
namespace {
#if defined(__AVX512F__)
template <int R, int CB>
void f32_tile(const float* x, int64_t K, const float* w, int64_t part, float* y, int64_t ys) {
  __m512 acc[R][CB];
  alignas(64) float total[R][CB][16];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k0 = 0; k0 < K; k0 += part) {  // a loop per part, as in bf16_tile
    if (k0 > 0) end_part(acc, total, k0 == part);
    for (int64_t k = k0, k1 = std::min(K, k0 + part); k < k1; ++k) {
      __m512 b[CB];
      for (int c = 0; c < CB; ++c) b[c] = _mm512_loadu_ps(w + (c * K + k) * 16);
      for (int r = 0; r < R; ++r) {
        const __m512 a = _mm512_set1_ps(x[r * K + k]);
        for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_fmadd_ps(a, b[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CB; ++c)
      _mm512_storeu_ps(y + r * ys + c * 16, pass_sum(acc, total, r, c, K > part));
}

#endif
}  // namespace

bool f32_linear_fast() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// w [out, in] float32 (out a multiple of 16) laid out [out / 16, in, 16]: float32 [out / 16, in * 16].
at::Tensor f32_pack(at::Tensor w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 && w.size(0) % 16 == 0 && w.scalar_type() == at::kFloat,
              "f32_pack: a CPU float32 weight [out, in], out a multiple of 16, expected");
  const auto wc = w.contiguous();
  const int64_t out = w.size(0), in = w.size(1);
  auto packed = at::empty({out / 16, in * 16}, w.options());
  const float* src = wc.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, out / 16, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t j = 0; j < 16; ++j)
        for (int64_t k = 0; k < in; ++k) dst[g * in * 16 + k * 16 + j] = src[(g * 16 + j) * in + k];
  });
  return packed;
}

// x [rows, in] float32 times an f32_pack'ed weight in oneDNN's float32 arithmetic, in parts of
// `part` inputs: [rows, out] float32.
at::Tensor f32_linear(at::Tensor x, at::Tensor packed, int64_t part) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat,
              "f32_linear: x CPU float32 [rows, in] expected");
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kFloat && packed.dim() == 2 &&
                  packed.is_contiguous() && packed.size(1) == x.size(1) * 16,
              "f32_linear: packed float32 [out / 16, in * 16] (f32_pack) expected");
  TORCH_CHECK(part > 0, "f32_linear: part must be positive");
#if defined(__AVX512F__)
  const int64_t rows = x.size(0), in = x.size(1), groups = packed.size(0), out = groups * 16;
  auto y = at::empty({rows, out}, x.options());
  if (rows == 0 || out == 0) return y;
  const auto xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t pt = std::min(part, in);
  for_each_pass(rows, groups, [&](int64_t g, int64_t cb, int64_t r0, int r) {
    const float *wt = wp + g * in * 16, *xt = xp + r0 * in;
    float* yt = yp + r0 * out + g * 16;
    with_rows(r, [&](auto R) {
      constexpr int kR = decltype(R)::value;
      if (cb == 3) f32_tile<kR, 3>(xt, in, wt, pt, yt, out);
      else if (cb == 2) f32_tile<kR, 2>(xt, in, wt, pt, yt, out);
      else f32_tile<kR, 1>(xt, in, wt, pt, yt, out);
    });
  });
  return y;
#else
  TORCH_CHECK(false, "f32_linear: built without AVX-512 (f32_linear_fast() is false)");
#endif
}


// ---- weight blocks in oneDNN's float32 arithmetic (the float32 mode's steps of few rows) ----
//
// oneDNN's float32 linear sums each output's products as one chain of fused multiply-adds in
// input order, in parts of `part` inputs (each part from zero, the parts added in order; measured
// by quant.py's onednn_part, which also checks the bits). q4_linear_f32 and q8_linear_f32 rebuild
// the weights of 16 outputs at a time from their blocks (the float32 weight's exact bits: the
// finders checked that) and run the same chains, so a row's result is oneDNN's whatever the rows
// beside it, at 0.625 (4-bit) or 1.0625 (8-bit) bytes a weight instead of 4. The two differ only
// in how a block gives the weights of a pair of inputs (the decoders below).
//
// 8-bit blocks (GGUF's Q8_0, which the embedded SmolLM2's token embedding, its tied LM head, is):
// a weight is d * q per block of 32 inputs, q in -128..127, d a float16 value. q8_blocks keeps
// them for 16 outputs at a time: per block of 32 inputs, the 16 outputs' d (float16), then for
// each input 16 bytes, byte j output j's q: 544 bytes for 512 weights.
// (kGroupBytes8, with the 4-bit blocks' constants above)

namespace {

#if defined(__AVX512F__)
constexpr int kRowsF32 = 8;   // rows a pass serves: their accumulators stay in registers
typedef __m512 vw;            // the 16 outputs' weights of one input
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kRowsF32 = 4;
struct vw {                   // (two halves of 8)
  __m256 h[2];
};
#else
constexpr int kRowsF32 = 4;
typedef float vw[kGroup];
#endif

// A decoder gives, for a block, the weights of inputs 2p and 2p + 1 (we, wo) of its 16 outputs.
struct Q4Decoder {
  static constexpr int64_t kBytes = kGroupBytes;
#if defined(__AVX512F__)
  __m512 d, m;
  explicit Q4Decoder(const uint8_t* blk)
      : d(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)))),
        m(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)))) {}
  void pair(const uint8_t* blk, int p, vw& we, vw& wo) const {
    const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 64 + p * 16)));
    we = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(0x0F))), d), m);
    wo = _mm512_add_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), d), m);
  }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  __m256 d[2], m[2];
  explicit Q4Decoder(const uint8_t* blk) {
    for (int h = 0; h < 2; ++h) {
      d[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * h)));
      m[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 32 + 16 * h)));
    }
  }
  void pair(const uint8_t* blk, int p, vw& we, vw& wo) const {
    for (int h = 0; h < 2; ++h) {
      const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 64 + p * 16 + 8 * h)));
      we.h[h] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(0x0F))), d[h]), m[h]);
      wo.h[h] = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q, 4)), d[h]), m[h]);
    }
  }
#else
  float d[kGroup], m[kGroup];
  explicit Q4Decoder(const uint8_t* blk) {
    for (int j = 0; j < kGroup; ++j) {
      d[j] = half_at(blk + 2 * j);
      m[j] = half_at(blk + 32 + 2 * j);
    }
  }
  void pair(const uint8_t* blk, int p, vw& we, vw& wo) const {
    for (int j = 0; j < kGroup; ++j) {
      const uint8_t q = blk[64 + p * 16 + j];
      we[j] = static_cast<float>(q & 0x0F) * d[j] + m[j];
      wo[j] = static_cast<float>(q >> 4) * d[j] + m[j];
    }
  }
#endif
};

struct Q8Decoder {
  static constexpr int64_t kBytes = kGroupBytes8;
#if defined(__AVX512F__)
  __m512 d;
  explicit Q8Decoder(const uint8_t* blk)
      : d(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)))) {}
  static __m512 row(const uint8_t* q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  }
  void pair(const uint8_t* blk, int p, vw& we, vw& wo) const {
    we = _mm512_mul_ps(row(blk + 32 + 2 * p * 16), d);
    wo = _mm512_mul_ps(row(blk + 32 + (2 * p + 1) * 16), d);
  }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  __m256 d[2];
  explicit Q8Decoder(const uint8_t* blk) {
    for (int h = 0; h < 2; ++h)
      d[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 16 * h)));
  }
  static __m256 row(const uint8_t* q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
  }
  void pair(const uint8_t* blk, int p, vw& we, vw& wo) const {
    for (int h = 0; h < 2; ++h) {
      we.h[h] = _mm256_mul_ps(row(blk + 32 + 2 * p * 16 + 8 * h), d[h]);
      wo.h[h] = _mm256_mul_ps(row(blk + 32 + (2 * p + 1) * 16 + 8 * h), d[h]);
    }
  }
#else
  float d[kGroup];
  explicit Q8Decoder(const uint8_t* blk) {
    for (int j = 0; j < kGroup; ++j) d[j] = half_at(blk + 2 * j);
  }
  void pair(const uint8_t* blk, int p, vw& we, vw& wo) const {
    const int8_t* q = reinterpret_cast<const int8_t*>(blk + 32);
    for (int j = 0; j < kGroup; ++j) {
      we[j] = static_cast<float>(q[2 * p * 16 + j]) * d[j];
      wo[j] = static_cast<float>(q[(2 * p + 1) * 16 + j]) * d[j];
    }
  }
#endif
};

// acc += x * w, lane by lane, as one fused multiply-add each
inline void fma_into(vw& acc, float x, const vw& w) {
#if defined(__AVX512F__)
  acc = _mm512_fmadd_ps(_mm512_set1_ps(x), w, acc);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  for (int h = 0; h < 2; ++h) acc.h[h] = _mm256_fmadd_ps(_mm256_set1_ps(x), w.h[h], acc.h[h]);
#else
  for (int j = 0; j < kGroup; ++j) acc[j] = std::fma(x, w[j], acc[j]);
#endif
}

inline void set_zero(vw& v) {
#if defined(__AVX512F__)
  v = _mm512_setzero_ps();
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  v.h[0] = v.h[1] = _mm256_setzero_ps();
#else
  for (int j = 0; j < kGroup; ++j) v[j] = 0.0f;
#endif
}

// total += acc (total = acc when `first`)
inline void add_into(vw& total, const vw& acc, bool first) {
#if defined(__AVX512F__)
  total = first ? acc : _mm512_add_ps(total, acc);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  for (int h = 0; h < 2; ++h) total.h[h] = first ? acc.h[h] : _mm256_add_ps(total.h[h], acc.h[h]);
#else
  for (int j = 0; j < kGroup; ++j) total[j] = first ? acc[j] : total[j] + acc[j];
#endif
}

inline void store16f(float* out, const vw& v) {
#if defined(__AVX512F__)
  _mm512_storeu_ps(out, v);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  _mm256_storeu_ps(out, v.h[0]);
  _mm256_storeu_ps(out + 8, v.h[1]);
#else
  std::memcpy(out, v, sizeof(vw));
#endif
}

template <typename Dec, int R>
void groups_pass_f32(const float* x, int64_t K, const uint8_t* w, int64_t nb, int64_t part_b,
                     int64_t g0, int64_t g1, float* y, int64_t ys) {
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* gw = w + g * nb * Dec::kBytes;
    vw acc[R], total[R];
    for (int r = 0; r < R; ++r) set_zero(acc[r]);
    for (int64_t b = 0, end = part_b; b < nb; ++b) {
      if (b == end) {
        end += part_b;   // a part ends: added to the parts before it
        for (int r = 0; r < R; ++r) {
          add_into(total[r], acc[r], b == part_b);
          set_zero(acc[r]);
        }
      }
      const uint8_t* blk = gw + b * Dec::kBytes;
      const Dec dec(blk);
      const float* xb = x + b * kBlock;
      for (int p = 0; p < kBlock / 2; ++p) {
        vw we, wo;
        dec.pair(blk, p, we, wo);
        for (int r = 0; r < R; ++r) {
          fma_into(acc[r], xb[r * K + 2 * p], we);
          fma_into(acc[r], xb[r * K + 2 * p + 1], wo);
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      if (nb > part_b) add_into(total[r], acc[r], false);
      store16f(y + r * ys + g * kGroup, nb > part_b ? total[r] : acc[r]);
    }
  }
}

// groups_pass_f32 for a pass of one or two rows, two groups at a time: each output is still
// one chain of fused multiply-adds in input order (the same bits), but a row's chain of one group
// waits on each multiply-add's latency, and two groups' chains side by side overlap it. An odd
// last group takes groups_pass_f32.
template <typename Dec, int R>
void groups_pair_f32(const float* x, int64_t K, const uint8_t* w, int64_t nb, int64_t part_b,
                     int64_t g0, int64_t g1, float* y, int64_t ys) {
  int64_t g = g0;
  for (; g + 2 <= g1; g += 2) {
    const uint8_t* gw0 = w + g * nb * Dec::kBytes;
    const uint8_t* gw1 = gw0 + nb * Dec::kBytes;
    vw acc[2][R], total[2][R];
    for (int j = 0; j < 2; ++j)
      for (int r = 0; r < R; ++r) set_zero(acc[j][r]);
    for (int64_t b = 0, end = part_b; b < nb; ++b) {
      if (b == end) {
        end += part_b;  // a part ends: added to the parts before it
        for (int j = 0; j < 2; ++j)
          for (int r = 0; r < R; ++r) {
            add_into(total[j][r], acc[j][r], b == part_b);
            set_zero(acc[j][r]);
          }
      }
      const uint8_t* blk0 = gw0 + b * Dec::kBytes;
      const uint8_t* blk1 = gw1 + b * Dec::kBytes;
      const Dec dec0(blk0), dec1(blk1);
      const float* xb = x + b * kBlock;
      for (int p = 0; p < kBlock / 2; ++p) {
        vw we0, wo0, we1, wo1;
        dec0.pair(blk0, p, we0, wo0);
        dec1.pair(blk1, p, we1, wo1);
        for (int r = 0; r < R; ++r) {
          fma_into(acc[0][r], xb[r * K + 2 * p], we0);
          fma_into(acc[1][r], xb[r * K + 2 * p], we1);
          fma_into(acc[0][r], xb[r * K + 2 * p + 1], wo0);
          fma_into(acc[1][r], xb[r * K + 2 * p + 1], wo1);
        }
      }
    }
    for (int j = 0; j < 2; ++j)
      for (int r = 0; r < R; ++r) {
        if (nb > part_b) add_into(total[j][r], acc[j][r], false);
        store16f(y + r * ys + (g + j) * kGroup, nb > part_b ? total[j][r] : acc[j][r]);
      }
  }
  if (g < g1) groups_pass_f32<Dec, R>(x, K, w, nb, part_b, g, g1, y, ys);
}

template <typename Dec>
void groups_any_f32(int rows, const float* x, int64_t K, const uint8_t* w, int64_t nb,
                    int64_t part_b, int64_t g0, int64_t g1, float* y, int64_t ys) {
  switch (rows) {
    case 1: return groups_pair_f32<Dec, 1>(x, K, w, nb, part_b, g0, g1, y, ys);
    case 2: return groups_pair_f32<Dec, 2>(x, K, w, nb, part_b, g0, g1, y, ys);
    case 3: return groups_pass_f32<Dec, 3>(x, K, w, nb, part_b, g0, g1, y, ys);
#if defined(__AVX512F__)
    case 4: return groups_pass_f32<Dec, 4>(x, K, w, nb, part_b, g0, g1, y, ys);
    case 5: return groups_pass_f32<Dec, 5>(x, K, w, nb, part_b, g0, g1, y, ys);
    case 6: return groups_pass_f32<Dec, 6>(x, K, w, nb, part_b, g0, g1, y, ys);
    case 7: return groups_pass_f32<Dec, 7>(x, K, w, nb, part_b, g0, g1, y, ys);
    default: return groups_pass_f32<Dec, 8>(x, K, w, nb, part_b, g0, g1, y, ys);
#else
    default: return groups_pass_f32<Dec, 4>(x, K, w, nb, part_b, g0, g1, y, ys);
#endif
  }
}

#if defined(__AVX512F__)
// With AVX-512 each pass of groups_pass_f32 holds one group's 8 accumulators a row and decodes
// every block again for each 8 rows, which at 32 rows made the blocks no faster than reading
// float32 weights; decoding a whole group into an L2 buffer first cost as much again in stores.
// For steps of at least kTileMinRows512 rows, each block of kBpGroups groups (32 inputs x 48
// outputs, 6 KiB) is decoded once into L1 and every row of a chunk runs over it, 8 rows at a
// time: 24 accumulators, loaded from and stored back to the chunk's sums (L1) around the block.
// Each output is still one chain of fused multiply-adds in input order, in parts of part_b
// blocks (float32 sums stored and reloaded exactly), so the bits are groups_pass_f32's and
// oneDNN's.
constexpr int64_t kTileMinRows512 = 9;
constexpr int64_t kChunkRows512 = 64;  // rows whose sums stay in L1 (12 KiB, and as much again)
constexpr int64_t kTileOut = kBpGroups * kGroup;

template <int R, int CB>
void block_rows_f32(const float* x, int64_t K, const float* w, float* sums) {
  __m512 acc[R][CB];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_loadu_ps(sums + r * kTileOut + c * 16);
  for (int k = 0; k < kBlock; ++k) {
    __m512 b[CB];
    for (int c = 0; c < CB; ++c) b[c] = _mm512_load_ps(w + (c * kBlock + k) * 16);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * K + k]);
      for (int c = 0; c < CB; ++c) acc[r][c] = _mm512_fmadd_ps(a, b[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CB; ++c) _mm512_storeu_ps(sums + r * kTileOut + c * 16, acc[r][c]);
}

template <int CB>
void block_chunk_f32(int64_t rows, const float* x, int64_t K, const float* w, float* sums) {
  for (int64_t r0 = 0; r0 < rows; r0 += kBpRows)
    with_rows(static_cast<int>(std::min<int64_t>(kBpRows, rows - r0)), [&](auto R) {
      block_rows_f32<decltype(R)::value, CB>(x + r0 * K, K, w, sums + r0 * kTileOut);
    });
}

template <typename Dec>
void blocks_tiles_f32(const float* xp, int64_t rows, int64_t in, const uint8_t* wp,
                      int64_t groups, int64_t part_b, float* yp) {
  const int64_t nb = in / kBlock, out = groups * kGroup, tiles = (groups + kBpGroups - 1) / kBpGroups;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    alignas(64) float wbuf[kBpGroups * kBlock * kGroup];
    std::vector<float> acc(kChunkRows512 * kTileOut), total(kChunkRows512 * kTileOut);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g = t * kBpGroups, cb = std::min<int64_t>(kBpGroups, groups - g);
      for (int64_t c0 = 0; c0 < rows; c0 += kChunkRows512) {
        const int64_t n = std::min(kChunkRows512, rows - c0);
        std::fill(acc.begin(), acc.begin() + n * kTileOut, 0.0f);
        for (int64_t b = 0, end = part_b; b < nb; ++b) {
          if (b == end) {  // a part ends: added to the parts before it
            for (int64_t i = 0; i < n * kTileOut; ++i) {
              total[i] = b == part_b ? acc[i] : total[i] + acc[i];
              acc[i] = 0.0f;
            }
            end += part_b;
          }
          for (int64_t c = 0; c < cb; ++c) {
            const uint8_t* blk = wp + ((g + c) * nb + b) * Dec::kBytes;
            const Dec dec(blk);
            for (int p = 0; p < kBlock / 2; ++p) {
              vw we, wo;
              dec.pair(blk, p, we, wo);
              _mm512_store_ps(wbuf + (c * kBlock + 2 * p) * kGroup, we);
              _mm512_store_ps(wbuf + (c * kBlock + 2 * p + 1) * kGroup, wo);
            }
          }
          const float* xb = xp + c0 * in + b * kBlock;
          if (cb == 3) block_chunk_f32<3>(n, xb, in, wbuf, acc.data());
          else if (cb == 2) block_chunk_f32<2>(n, xb, in, wbuf, acc.data());
          else block_chunk_f32<1>(n, xb, in, wbuf, acc.data());
        }
        for (int64_t r = 0; r < n; ++r)
          for (int64_t j = 0; j < cb * kGroup; ++j) {
            const int64_t i = r * kTileOut + j;
            yp[(c0 + r) * out + g * kGroup + j] = nb > part_b ? total[i] + acc[i] : acc[i];
          }
      }
    }
  });
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// AVX2's 16 vector registers hold the 8 accumulators of groups_pass_f32's 4 rows but little else,
// and each pass of 4 rows decodes every block again. For steps of at least kTileMinRows rows a
// group's weights are decoded once, into a buffer of in x 16 floats (L1 or L2), and the rows run
// over it 6 at a time: 12 accumulators, 2 weight vectors and a broadcast, the classic AVX2 tile.
// Each output's chain of fused multiply-adds is the same (input order, in parts of `part`), so
// the bits are those of groups_pass_f32 and oneDNN's.
constexpr int kTileRows = 6;
constexpr int64_t kTileMinRows = 8;
constexpr int64_t kChunkBytes = 256 * 1024;  // a chunk of rows' inputs, at most (about)

template <typename Dec>
void decode_group(const uint8_t* gw, int64_t nb, float* buf) {
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = gw + b * Dec::kBytes;
    const Dec dec(blk);
    float* out = buf + b * kBlock * kGroup;
    for (int p = 0; p < kBlock / 2; ++p) {
      vw we, wo;
      dec.pair(blk, p, we, wo);
      store16f(out + (2 * p) * kGroup, we);
      store16f(out + (2 * p + 1) * kGroup, wo);
    }
  }
}

template <int R>
void tile_f32(const float* x, int64_t K, const float* w, int64_t part, float* y, int64_t ys) {
  __m256 acc[R][2], total[R][2];
  for (int64_t k0 = 0; k0 < K; k0 += part) {
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const int64_t k1 = std::min(K, k0 + part);
    for (int64_t k = k0; k < k1; ++k) {
      const __m256 b0 = _mm256_loadu_ps(w + k * kGroup), b1 = _mm256_loadu_ps(w + k * kGroup + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(x + r * K + k);
        acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int h = 0; h < 2; ++h)
        total[r][h] = k0 == 0 ? acc[r][h] : _mm256_add_ps(total[r][h], acc[r][h]);
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * ys, total[r][0]);
    _mm256_storeu_ps(y + r * ys + 8, total[r][1]);
  }
}

void tile_any_f32(int rows, const float* x, int64_t K, const float* w, int64_t part, float* y,
                  int64_t ys) {
  switch (rows) {
    case 1: return tile_f32<1>(x, K, w, part, y, ys);
    case 2: return tile_f32<2>(x, K, w, part, y, ys);
    case 3: return tile_f32<3>(x, K, w, part, y, ys);
    case 4: return tile_f32<4>(x, K, w, part, y, ys);
    case 5: return tile_f32<5>(x, K, w, part, y, ys);
    default: return tile_f32<6>(x, K, w, part, y, ys);
  }
}
#endif

// x [rows, in] float32 times a weight's blocks ([out / 16, in / 32 * Dec::kBytes] uint8) in
// oneDNN's float32 arithmetic, in parts of `part` inputs: [rows, out] float32.
template <typename Dec>
at::Tensor blocks_linear_f32(const at::Tensor& x, const at::Tensor& blocks, int64_t part) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.scalar_type() == at::kFloat,
              "x: CPU float32 [rows, in] expected");
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte &&
                  blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks: contiguous uint8 [out / 16, in / 32 * ", Dec::kBytes, "] expected");
  const int64_t rows = x.size(0), in = x.size(1), groups = blocks.size(0), out = groups * kGroup;
  TORCH_CHECK(in % kBlock == 0 && blocks.size(1) == in / kBlock * Dec::kBytes,
              "blocks: ", in / kBlock * Dec::kBytes, " bytes a group expected for ", in, " inputs");
  TORCH_CHECK(part > 0 && part % kBlock == 0, "part: a positive multiple of 32 expected");
  auto y = at::empty({rows, out}, x.options());
  if (rows == 0 || out == 0) return y;
  const auto xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  const uint8_t* wp = blocks.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t nb = in / kBlock, part_b = part / kBlock;
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  if (rows >= kTileMinRows) {
    // rows in chunks whose inputs stay in L2 while every group of the thread runs over them
    const int64_t chunk = std::max<int64_t>(kTileRows, kChunkBytes / (in * 4) / kTileRows * kTileRows);
    at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
      std::vector<float> buf(in * kGroup);
      for (int64_t c0 = 0; c0 < rows; c0 += chunk) {
        const int64_t c1 = std::min(rows, c0 + chunk);
        for (int64_t g = g0; g < g1; ++g) {
          decode_group<Dec>(wp + g * nb * Dec::kBytes, nb, buf.data());
          for (int64_t r0 = c0; r0 < c1; r0 += kTileRows) {
            const int r = static_cast<int>(std::min<int64_t>(kTileRows, c1 - r0));
            tile_any_f32(r, xp + r0 * in, in, buf.data(), part, yp + r0 * out + g * kGroup, out);
          }
        }
      }
    });
    return y;
  }
#endif
#if defined(__AVX512F__)
  if (rows >= kTileMinRows512) {
    blocks_tiles_f32<Dec>(xp, rows, in, wp, groups, part_b, yp);
    return y;
  }
#endif
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t r0 = 0; r0 < rows; r0 += kRowsF32) {
      const int r = static_cast<int>(std::min<int64_t>(kRowsF32, rows - r0));
      groups_any_f32<Dec>(r, xp + r0 * in, in, wp, nb, part_b, g0, g1, yp + r0 * out, out);
    }
  });
  return y;
}

}  // namespace

at::Tensor q4_linear_f32(at::Tensor x, at::Tensor blocks, int64_t part) {
  return blocks_linear_f32<Q4Decoder>(x, blocks, part);
}

at::Tensor q8_linear_f32(at::Tensor x, at::Tensor blocks, int64_t part) {
  return blocks_linear_f32<Q8Decoder>(x, blocks, part);
}

// The 8-bit blocks of a float32 weight [out, in] (out a multiple of 16, in of 32) in the layout
// above, or None if one block is not exactly d * q: d the block's largest magnitude over 127 as a
// float16 value (Q8_0's), every weight an integer q times it.
c10::optional<at::Tensor> q8_blocks(at::Tensor w) {
  return find_blocks(w, kGroupBytes8, [](const float* v, uint8_t* o, int64_t j) {
    float amax = 0.0f;
    for (int64_t k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(v[k]));
    if (!std::isfinite(amax)) return false;
    const c10::Half dh(amax / 127.0f);
    const float d = static_cast<float>(dh);
    int8_t q[kBlock];
    bool ok = true;
    for (int64_t k = 0; k < kBlock; ++k) {
      const float qf = d != 0.0f ? std::nearbyint(v[k] / d) : 0.0f;
      ok &= qf >= -128.0f && qf <= 127.0f && qf * d == v[k];   // q * d is exact
      q[k] = static_cast<int8_t>(std::min(127.0f, std::max(-128.0f, qf)));
    }
    if (!ok) return false;
    std::memcpy(o + 2 * j, &dh.x, 2);
    for (int64_t k = 0; k < kBlock; ++k) o[32 + k * kGroup + j] = static_cast<uint8_t>(q[k]);
    return true;
  });
}


namespace {

// One linear layer of the stack, prepared as engine/layers/linear.py and quant.py prepare it, and
// multiplied with the same torch ops their matmul runs (so the same bits come out):
//   dense: oneDNN's packed float32 weight (mkldnn::_linear_pointwise)
//   bf16:  the same on bf16 activations and oneDNN's packed bf16 weight, the result as float32
//   int8:  int8_rows (which spreads the rows where the weight is spread: quant.py Int8Weight),
//          then quantized::linear_dynamic on the prepacked weight, the span row dropped and each
//          row scaled back
//   int4:  _weight_int4pack_mm_for_cpu on bf16 activations
// and, where the layer also holds its weight as 4-bit blocks (quant.py Q4Blocks), q4_linear (bf16)
// or q4_linear_f32 (dense) for a step of at most q4_rows rows.
struct Linear {
  enum Kind { kDense, kBf16, kInt8, kInt4 } kind = kDense;
  at::Tensor weight, aux, span_row, bias;      // aux: int4 scales/zeros or int8 inv_smooth
  c10::IValue packed;                          // int8: the prepacked weight object
  at::Tensor q4;                               // the 4-bit blocks, or undefined
  int64_t q4_part = 0;                         // q4_linear's part
  int64_t q4_rows = 0;
  at::Tensor bp;                               // our own packing (bf16_pack, f32_pack), or undefined
  int64_t bp_part = 0;                         // its part

  // a bf16 layer's product past q4_rows: our own where the layer has its packing (the same
  // bits as oneDNN's: quant.py checked them; a bfloat16 packing is amx_linear's, a uint8 one
  // amx_q4_linear's, an int8 one amx_q8_linear's, an int16 one bf16_linear's), else oneDNN on
  // bf16 input; bf16 out
  at::Tensor bf16_product(const at::Tensor& x) const {
    if (bp.defined() && bp.scalar_type() == at::kBFloat16) return amx_linear(x, bp);
    if (bp.defined() && bp.scalar_type() == at::kByte) return amx_q4_linear(x, bp);
    if (bp.defined() && bp.scalar_type() == at::kChar) return amx_q8_linear(x, bp);
    if (bp.defined()) return bf16_linear(x, bp, bp_part);
    return onednn(x.scalar_type() == at::kBFloat16 ? x : x.to(at::kBFloat16), weight, c10::IValue());
  }

  // oneDNN's product, one row run as two as engine/layers/linear.py's onednn_linear does (the
  // same bits for a row alone as in a batch)
  static at::Tensor onednn(const at::Tensor& x, const at::Tensor& w, const c10::IValue& b) {
    static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    const bool one = x.size(0) == 1;
    torch::jit::Stack st{one ? x.expand({2, x.size(1)}).contiguous() : x, w, b, std::string("none"),
                         c10::List<std::optional<at::Scalar>>(), std::string("")};
    op.callBoxed(&st);
    const auto y = st[0].toTensor();
    return one ? y.slice(0, 0, 1) : y;
  }

  // Whether the layer multiplies in bf16 (oneDNN, or q4_linear's 4-bit blocks in the
  // same arithmetic): then it takes bf16 input and gives bf16 output (raw()), and the stack keeps
  // its activations in bf16 between them.
  bool bf16() const { return kind == kBf16; }

  bool q4_at(int64_t rows) const { return q4.defined() && rows <= q4_rows; }

  // The product as operator() computes it, but on the bf16 path without the conversions around
  // it: x may already be bf16 (else it is converted here) and the result stays bf16 (its float32
  // conversion is what operator() returns). Other paths return operator()'s result.
  at::Tensor raw(const at::Tensor& x) const {
    if (!bf16() || bias.defined()) {
      return (*this)(x.scalar_type() == at::kFloat ? x : x.to(at::kFloat));
    }
    if (q4_at(x.size(0))) return q4_linear(x, q4, q4_part);
    return bf16_product(x);
  }

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y;
    if (q4_at(x.size(0))) {
      // a dense (float32) layer's blocks in float32 arithmetic, a bf16 one's in bf16
      y = kind == kDense ? q4_linear_f32(x, q4, q4_part) : q4_linear(x, q4, q4_part).to(at::kFloat);
      return bias.defined() ? y + bias : y;
    }
    if (kind == kDense) {
      if (bp.defined()) return f32_linear(x, bp, bp_part);  // (no bias: set_own)
      return onednn(x, weight, bias.defined() ? c10::IValue(bias) : c10::IValue());
    }
    if (kind == kBf16) {
      y = bf16_product(x).to(at::kFloat);
    } else if (kind == kInt8) {
      static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("quantized::linear_dynamic", "");
      auto rows = int8_rows(x, aux.defined() ? c10::optional<at::Tensor>(aux) : c10::nullopt, span_row);
      torch::jit::Stack st{rows[0], packed, false};
      op.callBoxed(&st);
      const auto full = st[0].toTensor();
      y = full.slice(0, 0, full.size(0) - 1).mul_(rows[1]);
    } else {
      const int64_t group = x.size(1) / aux.size(0);
      y = at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16).contiguous(), weight, group, aux)
              .to(at::kFloat);
    }
    return bias.defined() ? y + bias : y;
  }
};

struct Layer {
  at::Tensor input_norm, post_norm;
  Linear qkv, o, gate_up, down;
};

}  // namespace

// dst[slots[t]] = src[t] for every token t: a step's new K (or V) rows into one layer's half of
// the paged cache, viewed as [slots, heads, head_dim] (index_copy_'s result). A float32 src goes
// into a bfloat16 cache rounded as .to(torch.bfloat16) rounds it, without the separate conversion
// pass. index_copy_ took about a quarter of a millisecond for a 512-token prompt's rows of one
// layer; this is a row copy, on the calling thread (a step's rows are far too few to share).
void kv_write_(at::Tensor dst, at::Tensor slots, at::Tensor src) {
  TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu() && slots.device().is_cpu(),
              "kv_write_: CPU tensors expected");
  TORCH_CHECK(dst.dim() == 3 && src.dim() == 3 && dst.size(1) == src.size(1) && dst.size(2) == src.size(2),
              "kv_write_: dst [slots, heads, head_dim] and src [tokens, heads, head_dim] expected");
  TORCH_CHECK(dst.is_contiguous(), "kv_write_: dst must be contiguous");
  const int64_t width = src.size(1) * src.size(2), T = src.size(0), S = dst.size(0);
  TORCH_CHECK(src.stride(2) == 1 && src.stride(1) == src.size(2),
              "kv_write_: each src token's heads must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == T &&
                  slots.is_contiguous(), "kv_write_: slots int64 [tokens] expected");
  const auto dt = dst.scalar_type(), st = src.scalar_type();
  TORCH_CHECK(dt == st || (dt == at::kBFloat16 && st == at::kFloat),
              "kv_write_: src must have dst's dtype, or be float32 into a bfloat16 dst");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sl[t] >= 0 && sl[t] < S, "kv_write_: slot ", sl[t], " out of range [0, ", S, ")");
  const int64_t ss = src.stride(0);
  if (dt == st) {
    const int64_t esz = src.element_size();
    const char* sp = static_cast<const char*>(src.data_ptr());
    char* dp = static_cast<char*>(dst.data_ptr());
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(dp + sl[t] * width * esz, sp + t * ss * esz, width * esz);
    return;
  }
  const float* sp = src.data_ptr<float>();
  uint16_t* dp = reinterpret_cast<uint16_t*>(dst.data_ptr<at::BFloat16>());
  for (int64_t t = 0; t < T; ++t) to_bf16(sp + t * ss, dp + sl[t] * width, width);
}

// The decoder layers of a decode-only step (one new token per sequence) in one call: the
// per-layer work of engine/models/llama.py (norms, projections, rotary, the KV write, paged
// attention, the MLP) as the same torch ops in the same order, without a Python call per op.
// At a few rows a decode step is mostly such calls. Built by engine/models/llama.py
// (LlamaModel.prepare_decode_stack); `attend` is the paged decode kernel's capsule
// (paged_decode_cpu.cpp). run() releases the GIL: a step never stalls the process's other threads.
constexpr const char* kAttendSignature =
    "pdserve.paged_decode(Tensor q, Tensor layer_kv, Tensor block_tables, Tensor context_lens, double scale) -> Tensor";
using AttendFn = at::Tensor (*)(at::Tensor, at::Tensor, at::Tensor, at::Tensor, double);

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
              py::capsule attend)
      : H_(num_heads), Hkv_(num_kv_heads), D_(head_dim), eps_(eps), scale_(scale) {
    TORCH_CHECK(attend.name() != nullptr && std::string(attend.name()) == kAttendSignature,
                "DecodeStack: attend must be the paged decode kernel's capsule");
    attend_ = reinterpret_cast<AttendFn>(attend.get_pointer());
  }

  void add_layer(at::Tensor input_norm, at::Tensor post_norm) {
    layers_.push_back(Layer{input_norm, post_norm});
  }

  // which: "qkv" | "o" | "gate_up" | "down" of the last layer added;
  // kind: "dense" | "bf16" | "int8" | "int4"
  void set_linear(const std::string& which, const std::string& kind, py::object weight,
                  c10::optional<at::Tensor> aux, c10::optional<at::Tensor> span_row,
                  c10::optional<at::Tensor> bias) {
    TORCH_CHECK(!layers_.empty(), "DecodeStack: add_layer first");
    Layer& l = layers_.back();
    Linear* lin = which == "qkv" ? &l.qkv : which == "o" ? &l.o : which == "gate_up" ? &l.gate_up
                : which == "down" ? &l.down : nullptr;
    TORCH_CHECK(lin != nullptr, "DecodeStack: unknown linear ", which);
    if (kind == "int8") {
      lin->kind = Linear::kInt8;
      // a torch.ScriptObject in Python: torch::jit::Object, whose IValue the op takes
      lin->packed = c10::IValue(weight.cast<torch::jit::Object>()._ivalue());
      TORCH_CHECK(span_row.has_value(), "DecodeStack: int8 needs its span row");
      lin->span_row = *span_row;
    } else {
      TORCH_CHECK(kind == "dense" || kind == "bf16" || kind == "int4", "DecodeStack: unknown kind ", kind);
      lin->kind = kind == "dense" ? Linear::kDense : kind == "bf16" ? Linear::kBf16 : Linear::kInt4;
      lin->weight = weight.cast<at::Tensor>();
      TORCH_CHECK(kind != "int4" || aux.has_value(), "DecodeStack: int4 needs its scales");
    }
    if (aux.has_value()) lin->aux = *aux;
    if (bias.has_value()) lin->bias = *bias;
  }

  // The 4-bit blocks of a linear of the last layer added (which: as set_linear) and their part
  // (q4_linear), used for steps of at most `rows` rows.
  void set_q4(const std::string& which, at::Tensor blocks, int64_t part, int64_t rows) {
    TORCH_CHECK(!layers_.empty(), "DecodeStack: add_layer first");
    Layer& l = layers_.back();
    Linear* lin = which == "qkv" ? &l.qkv : which == "o" ? &l.o : which == "gate_up" ? &l.gate_up
                : which == "down" ? &l.down : nullptr;
    TORCH_CHECK(lin != nullptr, "DecodeStack: unknown linear ", which);
    lin->q4 = blocks;
    lin->q4_part = part;
    lin->q4_rows = rows;
  }

  // A linear's own packing and part (quant.py own_product): bf16_linear (a bf16 linear) or
  // f32_linear (a dense one, without bias) instead of oneDNN past q4_rows.
  void set_own(const std::string& which, at::Tensor packed, int64_t part) {
    TORCH_CHECK(!layers_.empty(), "DecodeStack: add_layer first");
    Layer& l = layers_.back();
    Linear* lin = which == "qkv" ? &l.qkv : which == "o" ? &l.o : which == "gate_up" ? &l.gate_up
                : which == "down" ? &l.down : nullptr;
    TORCH_CHECK(lin != nullptr, "DecodeStack: unknown linear ", which);
    TORCH_CHECK(lin->kind == Linear::kBf16 || (lin->kind == Linear::kDense && !lin->bias.defined()),
                "DecodeStack: set_own on a bf16 linear or a dense one without bias only");
    const auto st = packed.scalar_type();
    TORCH_CHECK(lin->kind == Linear::kBf16
                    ? st == at::kShort || st == at::kBFloat16 || st == at::kByte || st == at::kChar
                    : st == at::kFloat,
                "DecodeStack: set_own: a bf16_pack'ed, amx_pack'ed, amx_q4_pack'ed or q8_blocks "
                "(bf16) or f32_pack'ed (dense) weight expected");
    lin->bp = packed;
    lin->bp_part = part;
  }

  // Returns (hidden, residual) of the last layer, before the final norm.
  std::vector<at::Tensor> run(at::Tensor hidden, at::Tensor positions, at::Tensor cos,
                              at::Tensor sin, at::Tensor kv_cache, at::Tensor slot_mapping,
                              at::Tensor block_tables, at::Tensor context_lens,
                              std::vector<int64_t> capture) {
    // capture: layers (ascending, a layer listed once per copy wanted) whose input, the residual
    // stream's sum, is returned after {hidden, residual}: an EAGLE-3 head's (engine/spec/eagle.py)
    check_rows(hidden, "hidden");
    py::gil_scoped_release no_gil;
    const int64_t T = hidden.size(0), L = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(0) == L && kv_cache.size(4) == Hkv_ &&
                    kv_cache.size(5) == D_,
                "DecodeStack: kv_cache [layers, 2, blocks, block_size, kv_heads, head_dim] expected");
    const int64_t q_size = H_ * D_, kv_size = Hkv_ * D_;
    c10::optional<at::Tensor> residual;
    std::vector<at::Tensor> out(2);
    // On the bf16 path activations stay bf16 between a linear and the op after it (the norms
    // read and write bf16, the v rows go to a bf16 cache as they are): the values of the
    // float32 round trips the layers make one by one, without the conversion passes.
    for (int64_t i = 0; i < L; ++i) {
      const Layer& l = layers_[i];
      for (const int64_t c : capture) {
        if (c != i) continue;
        const auto h32 = hidden.scalar_type() == at::kFloat ? hidden : hidden.to(at::kFloat);
        out.push_back(residual.has_value() ? h32 + residual.value() : h32.clone());
      }
      auto normed = add_rms_norm_ex(hidden, residual, l.input_norm, eps_, l.qkv.bf16());
      residual = normed[1];
      const auto qkv = l.qkv.raw(normed[0]);
      const auto qkv32 = qkv.scalar_type() == at::kFloat ? qkv : qkv.to(at::kFloat);
      auto parts = qkv32.split_with_sizes({q_size, kv_size, kv_size}, -1);
      auto q = parts[0].view({-1, H_, D_});
      auto k = parts[1].reshape({-1, Hkv_, D_});
      auto flat = kv_cache[i].view({2, -1, Hkv_, D_});
      auto v = (qkv.scalar_type() == flat.scalar_type() ? qkv : qkv32)
                   .narrow(-1, q_size + kv_size, kv_size)
                   .reshape({-1, Hkv_, D_});
      rope_(q, k, positions, cos, sin);
      kv_write_(flat[0], slot_mapping, k);
      kv_write_(flat[1], slot_mapping, v);
      auto o = attend_(q.contiguous(), kv_cache[i], block_tables, context_lens, scale_).reshape({T, -1});
      normed = add_rms_norm_ex(l.o.raw(o), residual, l.post_norm, eps_, l.gate_up.bf16());
      residual = normed[1];
      auto gu = l.gate_up.raw(normed[0]);
      if (l.gate_up.bf16() && l.down.bf16() && !l.gate_up.bias.defined() && !l.down.bias.defined()) {
        hidden = l.down.raw(silu_mul_bf16(gu));  // as LlamaMLP._bf16_fused's path (models/llama.py)
        continue;
      }
      if (gu.scalar_type() != at::kFloat) gu = gu.to(at::kFloat);
      auto halves = gu.chunk(2, -1);
      hidden = l.down.raw(at::silu(halves[0]) * halves[1]);
    }
    if (hidden.scalar_type() != at::kFloat) hidden = hidden.to(at::kFloat);
    out[0] = hidden;
    out[1] = residual.value();
    return out;
  }

 private:
  int64_t H_, Hkv_, D_;
  double eps_, scale_;
  AttendFn attend_;
  std::vector<Layer> layers_;
};

// One token of the gated delta rule per row (engine/layers/gated_delta.py _recurrent_step), in
// place on each row's state: S = ssm[slots[b], h] [dk, dv] float32 decays by exp(g), the delta
// rule writes beta * (v - S^T k) along k, and out = S^T q of the new state. Two passes over S (read,
// then read and write) where the torch path gathers, updates and scatters whole states.
void gated_delta_step_(at::Tensor ssm, at::Tensor slots, at::Tensor q, at::Tensor k, at::Tensor v,
                       at::Tensor g, at::Tensor beta, at::Tensor out) {
  TORCH_CHECK(ssm.dim() == 4 && ssm.is_contiguous() && ssm.scalar_type() == at::kFloat,
              "gated_delta_step_: ssm float32 [slots, heads, dk, dv] contiguous expected");
  const int64_t S = ssm.size(0), H = ssm.size(1), dk = ssm.size(2), dv = ssm.size(3);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "gated_delta_step_: slots int64 [rows] expected");
  const int64_t B = slots.size(0);
  for (const auto* t : {&q, &k, &v, &out})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == B && t->size(1) == H,
                "gated_delta_step_: q, k, v, out float32 [rows, heads, dim] contiguous expected");
  TORCH_CHECK(q.size(2) == dk && k.size(2) == dk && v.size(2) == dv && out.size(2) == dv,
              "gated_delta_step_: q and k of dk, v and out of dv values a head expected");
  for (const auto* t : {&g, &beta})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == B && t->size(1) == H,
                "gated_delta_step_: g and beta float32 [rows, heads] contiguous expected");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(sl[b] >= 0 && sl[b] < S, "gated_delta_step_: slot ", sl[b], " out of range [0, ",
                S, ")");
  float* sp = ssm.data_ptr<float>();
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float *gp = g.data_ptr<float>(), *bp = beta.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t first, int64_t last) {
#if defined(__AVX512F__) || defined(__AVX2__)
    // subnormals flushed to zero in here only (restored below): a state decayed by exp(g) far
    // below 1 (a real model's g reaches -50) would otherwise run at microcode-assist speed
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);
#endif
    std::vector<float> delta(dv);
    for (int64_t r = first; r < last; ++r) {
      const int64_t b = r / H, h = r % H;
      float* st = sp + (sl[b] * H + h) * dk * dv;
      const float* kr = kp + r * dk;
      const float* qr = qp + r * dk;
      const float* vr = vp + r * dv;
      float* o = op + r * dv;
      const float decay = std::exp(gp[r]), bt = bp[r];
      for (int64_t j = 0; j < dv; ++j) delta[j] = 0.f;
      for (int64_t i = 0; i < dk; ++i) {  // the decayed state's prediction of v: S^T k
        const float ki = kr[i] * decay;
        const float* row = st + i * dv;
        for (int64_t j = 0; j < dv; ++j) delta[j] += row[j] * ki;
      }
      for (int64_t j = 0; j < dv; ++j) {
        delta[j] = bt * (vr[j] - delta[j]);
        o[j] = 0.f;
      }
      for (int64_t i = 0; i < dk; ++i) {  // S = decay * S + k delta^T; out = S^T q
        const float ki = kr[i], qi = qr[i];
        float* row = st + i * dv;
        for (int64_t j = 0; j < dv; ++j) {
          const float x = row[j] * decay + ki * delta[j];
          row[j] = x;
          o[j] += x * qi;
        }
      }
    }
#if defined(__AVX512F__) || defined(__AVX2__)
    _mm_setcsr(csr);
#endif
  });
}

// One token of a Mamba2 layer per row (engine/layers/mamba2.py _ssm_step), in place on each row's
// state: S = ssm[slots[b], h] [head_dim, state] float32 decays by exp(dt * A), adds dt * x outer
// B of the head's group, and out = S C + D x. One pass over S where the torch path gathers,
// updates and scatters whole states.
void mamba2_step_(at::Tensor ssm, at::Tensor slots, at::Tensor x, at::Tensor dt, at::Tensor a,
                  at::Tensor b_in, at::Tensor c_in, at::Tensor d, at::Tensor out) {
  TORCH_CHECK(ssm.dim() == 4 && ssm.is_contiguous() && ssm.scalar_type() == at::kFloat,
              "mamba2_step_: ssm float32 [slots, heads, head_dim, state] contiguous expected");
  const int64_t S = ssm.size(0), H = ssm.size(1), P = ssm.size(2), N = ssm.size(3);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "mamba2_step_: slots int64 [rows] expected");
  const int64_t B = slots.size(0);
  for (const auto* t : {&x, &out})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == B && t->size(1) == H && t->size(2) == P,
                "mamba2_step_: x and out float32 [rows, heads, head_dim] contiguous expected");
  TORCH_CHECK(dt.scalar_type() == at::kFloat && dt.is_contiguous() && dt.dim() == 2 &&
                  dt.size(0) == B && dt.size(1) == H,
              "mamba2_step_: dt float32 [rows, heads] contiguous expected");
  for (const auto* t : {&a, &d})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 1 &&
                    t->size(0) == H,
                "mamba2_step_: A and D float32 [heads] expected");
  TORCH_CHECK(b_in.dim() == 3 && b_in.size(0) == B && b_in.size(2) == N,
              "mamba2_step_: B float32 [rows, groups, state] expected");
  const int64_t G = b_in.size(1);
  TORCH_CHECK(G >= 1 && H % G == 0, "mamba2_step_: the groups must divide the heads");
  for (const auto* t : {&b_in, &c_in})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                    t->size(0) == B && t->size(1) == G && t->size(2) == N,
                "mamba2_step_: B and C float32 [rows, groups, state] contiguous expected");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < B; ++r)
    TORCH_CHECK(sl[r] >= 0 && sl[r] < S, "mamba2_step_: slot ", sl[r], " out of range [0, ", S,
                ")");
  float* sp = ssm.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *ap = a.data_ptr<float>();
  const float *bp = b_in.data_ptr<float>(), *cp = c_in.data_ptr<float>(), *dp = d.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t per_group = H / G;
  at::parallel_for(0, B * H, 1, [&](int64_t first, int64_t last) {
#if defined(__AVX512F__) || defined(__AVX2__)
    // subnormals flushed to zero in here only (restored below), as in gated_delta_step_
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);
#endif
    for (int64_t r = first; r < last; ++r) {
      const int64_t row = r / H, h = r % H, g = h / per_group;
      float* st = sp + (sl[row] * H + h) * P * N;
      const float* br = bp + (row * G + g) * N;
      const float* cr = cp + (row * G + g) * N;
      const float* xr = xp + r * P;
      float* o = op + r * P;
      const float step = dtp[r], decay = std::exp(step * ap[h]), skip = dp[h];
      for (int64_t p = 0; p < P; ++p) {
        const float xdt = xr[p] * step;
        float* s = st + p * N;
        float acc = 0.f;
        for (int64_t n = 0; n < N; ++n) {
          const float v = s[n] * decay + xdt * br[n];
          s[n] = v;
          acc += v * cr[n];
        }
        o[p] = acc + skip * xr[p];
      }
    }
#if defined(__AVX512F__) || defined(__AVX2__)
    _mm_setcsr(csr);
#endif
  });
}

// Mamba's selective scan over a step's rows in order (engine/layers/mamba1.py _scan): row t
// updates the state ssm[slots[t]] [inner, state] float32 in place (a prompt chunk's rows share a
// slot and run one after another, a decode row has its own): each channel's state decays by
// exp(dt * A[channel]) and takes dt * x * B, and y = state . C + D * x. Channels are split across
// the threads; each thread runs every row for its channels.
void mamba1_scan_(at::Tensor ssm, at::Tensor slots, at::Tensor x, at::Tensor dt, at::Tensor a,
                  at::Tensor b_in, at::Tensor c_in, at::Tensor d, at::Tensor out) {
  TORCH_CHECK(ssm.dim() == 3 && ssm.is_contiguous() && ssm.scalar_type() == at::kFloat,
              "mamba1_scan_: ssm float32 [slots, inner, state] contiguous expected");
  const int64_t S = ssm.size(0), C = ssm.size(1), N = ssm.size(2);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous(),
              "mamba1_scan_: slots int64 [rows] expected");
  const int64_t T = slots.size(0);
  for (const auto* t : {&x, &dt, &out})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == T && t->size(1) == C,
                "mamba1_scan_: x, dt and out float32 [rows, inner] contiguous expected");
  TORCH_CHECK(a.scalar_type() == at::kFloat && a.is_contiguous() && a.dim() == 2 &&
                  a.size(0) == C && a.size(1) == N,
              "mamba1_scan_: A float32 [inner, state] expected");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.dim() == 1 && d.size(0) == C,
              "mamba1_scan_: D float32 [inner] expected");
  for (const auto* t : {&b_in, &c_in})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                    t->size(0) == T && t->size(1) == N,
                "mamba1_scan_: B and C float32 [rows, state] contiguous expected");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < T; ++r)
    TORCH_CHECK(sl[r] >= 0 && sl[r] < S, "mamba1_scan_: slot ", sl[r], " out of range [0, ", S,
                ")");
  float* sp = ssm.data_ptr<float>();
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *ap = a.data_ptr<float>();
  const float *bp = b_in.data_ptr<float>(), *cp = c_in.data_ptr<float>(), *dp = d.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, C, 16, [&](int64_t first, int64_t last) {
#if defined(__AVX512F__) || defined(__AVX2__)
    // subnormals flushed to zero in here only (restored below), as in gated_delta_step_
    const unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040);
#endif
    for (int64_t t = 0; t < T; ++t) {
      const float* br = bp + t * N;
      const float* cr = cp + t * N;
      float* state = sp + sl[t] * C * N;
      for (int64_t ch = first; ch < last; ++ch) {
        const float step = dtp[t * C + ch], xv = xp[t * C + ch], dbx = step * xv;
        const float* arow = ap + ch * N;
        float* h = state + ch * N;
        float acc = 0.f;
        for (int64_t n = 0; n < N; ++n) {
          const float v = h[n] * std::exp(step * arow[n]) + dbx * br[n];
          h[n] = v;
          acc += v * cr[n];
        }
        op[t * C + ch] = acc + dp[ch] * xv;
      }
    }
#if defined(__AVX512F__) || defined(__AVX2__)
    _mm_setcsr(csr);
#endif
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mamba1_scan_", &mamba1_scan_);
  m.def("mamba2_step_", &mamba2_step_);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("rope_", &rope_);
  m.def("int8_rows", &int8_rows);
  m.def("argmax_rows", &argmax_rows);
  m.def("q4_linear", &q4_linear);
  m.def("bf16_pack", &bf16_pack);
  m.def("bf16_linear", &bf16_linear);
  m.def("bf16_linear_fast", &bf16_linear_fast);
  m.def("amx_bf16_ready", &amx_bf16_ready);
  m.def("amx_pack", &amx_pack);
  m.def("amx_linear", &amx_linear, py::arg("x"), py::arg("packed"), py::arg("float_out") = false);
  m.def("amx_q4_pack", &amx_q4_pack);
  m.def("amx_q4_linear", &amx_q4_linear, py::arg("x"), py::arg("packed"),
        py::arg("float_out") = false);
  m.def("amx_q8_linear", &amx_q8_linear, py::arg("x"), py::arg("blocks"),
        py::arg("float_out") = false);
  m.def("f32_pack", &f32_pack);
  m.def("f32_linear", &f32_linear);
  m.def("f32_linear_fast", &f32_linear_fast);
  m.def("q4_linear_f32", &q4_linear_f32);
  m.def("q8_linear_f32", &q8_linear_f32);
  m.def("q8_blocks", &q8_blocks);
  m.def("silu_mul_bf16", &silu_mul_bf16);
  m.def("kv_write_", &kv_write_);
  m.def("gated_delta_step_", &gated_delta_step_);
  m.def("topk_rows", &topk_rows);
  m.def("q4_blocks", &q4_blocks);
  py::class_<DecodeStack>(m, "DecodeStack")
      .def(py::init<int64_t, int64_t, int64_t, double, double, py::capsule>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("set_linear", &DecodeStack::set_linear)
      .def("set_q4", &DecodeStack::set_q4)
      .def("set_own", &DecodeStack::set_own)
      .def("run", &DecodeStack::run);
}
