// The small per-layer operations of the CPU forward, fused: RMSNorm, residual add + RMSNorm, RoPE in
// place, and SiLU(gate) * up. fp32 tensors only (the CPU engine's run dtype). Each is one call where
// the PyTorch spelling is five to eight ops: on a decode step of the default model (30 layers, one
// token) the dispatch of those ops cost more than their arithmetic.
//
// The math is the PyTorch reference's (kernels/triton/norm_rope.py *_reference, the engine's `_norm`
// and `RotaryEmbedding.apply`) in fp32; only the order of the sum of squares differs. Rows are
// spread over the thread pool when there are many (prefill), done inline for a few (decode).
// Shapes and dtypes are checked here (TORCH_CHECK -> ValueError/RuntimeError in Python).
#include <torch/extension.h>

#include <cmath>
#include <cstdint>

#include "thread_pool.h"

namespace {

constexpr int64_t kRowsPerChunk = 16;
constexpr int64_t kInlineRows = 32;  // fewer rows than this: no threads

template <class F>
void rows(int64_t n, F&& fn) {
  if (n < kInlineRows) {
    fn(int64_t{0}, n, 0);
  } else {
    ctxfuse_pool::parallel_for(n, kRowsPerChunk, fn);
  }
}

void check_2d(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, hidden] with contiguous rows");
}

void check_weight(const torch::Tensor& w, int64_t hidden) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kFloat32, "weight must be CPU float32");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == hidden && w.is_contiguous(), "weight must be [hidden]");
}

inline void norm_row(const float* x, const float* w, float* out, int64_t d, float eps) {
  float ss = 0.f;
  for (int64_t j = 0; j < d; ++j) ss += x[j] * x[j];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
  for (int64_t j = 0; j < d; ++j) out[j] = (x[j] * inv) * w[j];
}

// x * rsqrt(mean(x^2) + eps) * weight, a new tensor
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_2d(x, "x");
  const int64_t n = x.size(0), d = x.size(1);
  check_weight(weight, d);
  auto out = torch::empty({n, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  rows(n, [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * xs, wp, op + r * d, d, static_cast<float>(eps));
  });
  return out;
}

// residual += x (in place), then (rms_norm(residual) * weight, residual)
std::vector<torch::Tensor> add_rms_norm_(const torch::Tensor& x, torch::Tensor residual,
                                          const torch::Tensor& weight, double eps) {
  check_2d(x, "x");
  check_2d(residual, "residual");
  const int64_t n = x.size(0), d = x.size(1);
  TORCH_CHECK(residual.size(0) == n && residual.size(1) == d, "x and residual must have one shape");
  check_weight(weight, d);
  auto out = torch::empty({n, d}, x.options());
  const float* xp = x.data_ptr<float>();
  float* hp = residual.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), hs = residual.stride(0);
  rows(n, [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r) {
      float* h = hp + r * hs;
      const float* a = xp + r * xs;
      for (int64_t j = 0; j < d; ++j) h[j] = a[j] + h[j];
      norm_row(h, wp, op + r * d, d, static_cast<float>(eps));
    }
  });
  return {out, residual};
}

// qk [T, heads, d] rotated in place (rotate-half layout): cos, sin [T, d]
torch::Tensor rope_(torch::Tensor qk, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(qk.device().is_cpu() && qk.scalar_type() == torch::kFloat32, "qk must be CPU float32");
  TORCH_CHECK(qk.dim() == 3 && qk.stride(2) == 1, "qk must be [T, heads, d] with contiguous rows");
  const int64_t n = qk.size(0), heads = qk.size(1), d = qk.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0, "the head dim must be even");
  check_2d(cos, "cos");
  check_2d(sin, "sin");
  TORCH_CHECK(cos.size(0) == n && cos.size(1) == d && sin.size(0) == n && sin.size(1) == d,
              "cos and sin must be [T, d]");
  float* q = qk.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t s0 = qk.stride(0), s1 = qk.stride(1), cs = cos.stride(0), ss = sin.stride(0);
  rows(n, [&](int64_t r0, int64_t r1, int) {
    for (int64_t t = r0; t < r1; ++t) {
      const float* c = cp + t * cs;
      const float* s = sp + t * ss;
      for (int64_t h = 0; h < heads; ++h) {
        float* x = q + t * s0 + h * s1;
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = x[j], x2 = x[j + half];
          x[j] = x1 * c[j] + (-x2) * s[j];
          x[j + half] = x2 * c[j + half] + x1 * s[j + half];
        }
      }
    }
  });
  return qk;
}

// gate_up [T, 2I] -> silu(gate) * up [T, I]
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_2d(gate_up, "gate_up");
  const int64_t n = gate_up.size(0), two = gate_up.size(1), inter = two / 2;
  TORCH_CHECK(two % 2 == 0, "gate_up must hold gate and up side by side");
  auto out = torch::empty({n, inter}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t gs = gate_up.stride(0);
  rows(n, [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = gp + r * gs;
      const float* u = g + inter;
      float* o = op + r * inter;
      for (int64_t j = 0; j < inter; ++j) o[j] = (g[j] / (1.f + std::exp(-g[j]))) * u[j];
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("rms_norm", &rms_norm, "x * rsqrt(mean(x^2) + eps) * weight (fp32)");
  mod.def("add_rms_norm_", &add_rms_norm_, "residual += x; (rms_norm(residual), residual) (fp32)");
  mod.def("rope_", &rope_, "rotate-half RoPE in place on [T, heads, d] (fp32)");
  mod.def("silu_mul", &silu_mul, "silu(gate) * up from [T, 2I] (fp32)");
}
