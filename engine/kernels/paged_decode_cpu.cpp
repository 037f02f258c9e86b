// Decode attention read straight from the paged KV cache (CPU, float32).
//
// A torch version must first gather every sequence's blocks into a contiguous copy: it reads the
// KV, writes a copy and reads that again, and on a 2-core machine those copies took most of a
// decode step. This kernel follows the block table in place and reads each K and V row once.
// One task per (sequence, kv head) keeps the G query heads of a GQA group together, so every
// K/V row that is loaded serves all of them.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor layer_kv, torch::Tensor block_tables,
                           torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && layer_kv.scalar_type() == torch::kFloat32,
              "paged_decode: q and the KV cache must be float32");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64,
              "paged_decode: block tables and context lengths must be int64");
  TORCH_CHECK(q.is_contiguous() && layer_kv.is_contiguous() && block_tables.is_contiguous() &&
              context_lens.is_contiguous(), "paged_decode: inputs must be contiguous");
  TORCH_CHECK(q.dim() == 3 && layer_kv.dim() == 5 && block_tables.dim() == 2,
              "paged_decode: q [N,Hq,D], layer_kv [2,blocks,block_size,Hkv,D], block_tables [N,max_blocks]");
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t num_blocks = layer_kv.size(1), bs = layer_kv.size(2), Hkv = layer_kv.size(3);
  TORCH_CHECK(layer_kv.size(4) == D && Hq % Hkv == 0, "paged_decode: head shapes do not match");
  const int64_t G = Hq / Hkv, max_blocks = block_tables.size(1);
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = layer_kv.data_ptr<float>();
  const float* vp = kp + num_blocks * bs * Hkv * D;
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t* cl = context_lens.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);

  at::parallel_for(0, N * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(G * D), inv(G);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / Hkv, h = task % Hkv, L = cl[n];
      TORCH_CHECK(L >= 1 && L <= max_blocks * bs, "paged_decode: context length out of range");
      const int64_t* row = bt + n * max_blocks;
      const float* qh = qp + (n * Hq + h * G) * D;
      scores.resize(G * L);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t slot = row[t / bs] * bs + t % bs;
        const float* k = kp + (slot * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) scores[g * L + t] = dot(qh + g * D, k, D) * sc;
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * L;
        const float m = *std::max_element(s, s + L);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        inv[g] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t slot = row[t / bs] * bs + t % bs;
        const float* v = vp + (slot * Hkv + h) * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t i = 0; i < D; ++i) a[i] += p * v[i];
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* o = op + (n * Hq + h * G + g) * D;
        for (int64_t i = 0; i < D; ++i) o[i] = acc[g * D + i] * inv[g];
      }
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over a paged KV cache (float32, CPU)");
}
