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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm);
  m.def("rope_", &rope_);
  m.def("int8_rows", &int8_rows);
}
