// Fused float32 CPU ops for the layers' small steps (engine/layers), each one call instead of the
// 3-10 torch ops it replaces: at one decode row a torch op costs more in dispatch than in math.
// Built with -ffp-contract=off: no fused multiply-adds, so rotary and the int8 row preparation
// round exactly as the torch expressions they replace (RMSNorm's sum is ordered differently).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, name, ": CPU float32 expected");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, ": [rows, width] with unit last stride expected");
}

void norm_row(const float* in, const float* w, float* out, int64_t n, double eps) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += in[i] * in[i];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(n) + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (in[i] * r);
}

}  // namespace

// RMSNorm of x's rows; with a residual, residual += x first (in place) and the sum is normalized.
// Returns (normalized, residual or x).
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                        torch::Tensor weight, double eps) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = torch::empty({rows, n}, x.options());
  torch::Tensor src = x;
  if (residual.has_value()) {
    src = residual.value();
    check_rows(src, "residual");
    TORCH_CHECK(src.sizes() == x.sizes(), "residual: shape of x expected");
  }
  TORCH_CHECK(weight.scalar_type() == torch::kFloat32 && weight.is_contiguous() && weight.numel() == n,
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
void rope_(torch::Tensor q, torch::Tensor k, torch::Tensor positions, torch::Tensor cos,
           torch::Tensor sin) {
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat32,
              "cos/sin: contiguous float32 tables expected");
  TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.is_contiguous(), "positions: int64");
  const int64_t T = positions.size(0), D = cos.size(1), h = D / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && sin.scalar_type() == torch::kFloat32,
              "cos/sin: [max_pos, head_dim] tables of one shape expected");
  for (int64_t r = 0; r < T; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < cos.size(0), "positions: beyond the rotary table");
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  for (torch::Tensor* t : {&q, &k}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->dim() == 3 && t->size(0) == T && t->size(2) == D
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
// [-1, 1] appended. Returns (prepared [T + 1, K], row maxima [T, 1]).
std::vector<torch::Tensor> int8_rows(torch::Tensor x, c10::optional<torch::Tensor> inv_smooth,
                                     torch::Tensor span_row) {
  check_rows(x, "x");
  const int64_t T = x.size(0), K = x.size(1), xs = x.stride(0);
  auto out = torch::empty({T + 1, K}, x.options());
  auto rmax = torch::empty({T, 1}, x.options());
  TORCH_CHECK(span_row.scalar_type() == torch::kFloat32 && span_row.is_contiguous() && span_row.numel() == K,
              "span_row: contiguous float32 of the row width expected");
  if (inv_smooth.has_value())
    TORCH_CHECK(inv_smooth->scalar_type() == torch::kFloat32 && inv_smooth->is_contiguous() &&
                inv_smooth->numel() == K, "inv_smooth: contiguous float32 of the row width expected");
  const float* xp = x.data_ptr<float>();
  const float* sm = inv_smooth.has_value() ? inv_smooth.value().data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  float* mp = rmax.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t a, int64_t b) {
    for (int64_t r = a; r < b; ++r) {
      const float* xr = xp + r * xs;
      float* o = op + r * K;
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
    }
  });
  std::memcpy(op + T * K, span_row.data_ptr<float>(), K * sizeof(float));
  return {out, rmax};
}

namespace {

// y = x @ W^T (+ bias) for an int4 weight as engine/layers/quant.py Int4Weight packs it: the same
// torch ops Int4Weight.matmul and LinearBase.matmul run, so the same bits come out
torch::Tensor int4_linear(const torch::Tensor& x, const torch::Tensor& packed,
                          const torch::Tensor& scales_zeros, const torch::Tensor& bias) {
  const int64_t group = x.size(1) / scales_zeros.size(0);
  auto y = at::_weight_int4pack_mm_for_cpu(x.to(torch::kBFloat16).contiguous(), packed, group,
                                           scales_zeros)
               .to(torch::kFloat32);
  return bias.defined() && bias.numel() ? y + bias : y;
}

}  // namespace

// The decoder layers of a decode-only step (one new token per sequence) with int4 weights, in one
// call: the per-layer work of engine/models/llama.py (norms, projections, rotary, the KV write,
// paged attention, the MLP) as the same torch ops in the same order, without a Python call per
// op. At one row a decode step is mostly such calls, so this is where batch-1 latency goes.
// params holds kParams tensors per layer (see engine/models/llama.py's _int4_stack_params);
// attend is the compiled paged decode kernel. Returns (hidden, residual) before the final norm.
constexpr int64_t kParams = 11;

std::vector<torch::Tensor> int4_decode_layers(
    torch::Tensor hidden, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
    torch::Tensor kv_cache, torch::Tensor slot_mapping, torch::Tensor block_tables,
    torch::Tensor context_lens, const std::vector<torch::Tensor>& params, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double eps, double scale, py::object attend) {
  check_rows(hidden, "hidden");
  const int64_t layers = kv_cache.size(0), T = hidden.size(0);
  TORCH_CHECK(static_cast<int64_t>(params.size()) == layers * kParams,
              "int4_decode_layers: ", kParams, " parameters per layer expected");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(4) == num_kv_heads && kv_cache.size(5) == head_dim,
              "int4_decode_layers: kv_cache [layers, 2, blocks, block_size, kv_heads, head_dim]");
  const int64_t q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  c10::optional<torch::Tensor> residual;
  for (int64_t i = 0; i < layers; ++i) {
    const torch::Tensor* p = params.data() + i * kParams;
    auto normed = add_rms_norm(hidden, residual, p[0], eps);
    residual = normed[1];
    // attention
    auto qkv = int4_linear(normed[0], p[1], p[2], p[3]);
    auto parts = qkv.split_with_sizes({q_size, kv_size, kv_size}, -1);
    auto q = parts[0].view({-1, num_heads, head_dim});
    auto k = parts[1].reshape({-1, num_kv_heads, head_dim});
    auto v = parts[2].reshape({-1, num_kv_heads, head_dim});
    rope_(q, k, positions, cos, sin);
    auto flat = kv_cache[i].view({2, -1, num_kv_heads, head_dim});
    const bool narrow = flat.scalar_type() != k.scalar_type();
    flat[0].index_copy_(0, slot_mapping, narrow ? k.to(flat.scalar_type()) : k);
    flat[1].index_copy_(0, slot_mapping, narrow ? v.to(flat.scalar_type()) : v);
    auto o = attend(q.contiguous(), kv_cache[i], block_tables, context_lens, scale)
                 .cast<torch::Tensor>()
                 .reshape({T, -1});
    auto attn = int4_linear(o, p[4], p[5], torch::Tensor());
    normed = add_rms_norm(attn, residual, p[6], eps);
    residual = normed[1];
    // MLP
    auto gate_up = int4_linear(normed[0], p[7], p[8], torch::Tensor());
    auto gu = gate_up.chunk(2, -1);
    hidden = int4_linear(at::silu(gu[0]) * gu[1], p[9], p[10], torch::Tensor());
  }
  return {hidden, residual.value()};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm);
  m.def("rope_", &rope_);
  m.def("int8_rows", &int8_rows);
  m.def("int4_decode_layers", &int4_decode_layers);
}
