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

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "thread_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#define NR_X86 1
#include <immintrin.h>
#endif

// The row kernels, vectorized: the same text compiled for plain C++, AVX2 + FMA and AVX-512
// (simd.h's V and its primitives), chosen at run time (`set_isa` caps it: CTXFUSE_CPU_ISA).
// silu uses simd.h's vexp (Cephes' expf, ~1 ulp); the sum of squares runs in W lanes.
#define NR_ROW_KERNELS                                                                      \
  inline float sum_squares(const float* x, int64_t d) {                                     \
    V acc = vzero();                                                                        \
    int64_t j = 0;                                                                          \
    for (; j + W <= d; j += W) acc = vfma(vload(x + j), vload(x + j), acc);                 \
    float ss = vsum(acc);                                                                   \
    for (; j < d; ++j) ss += x[j] * x[j];                                                   \
    return ss;                                                                              \
  }                                                                                         \
  void scale_row(const float* x, const float* w, float inv, float* out, int64_t d) {        \
    const V vi = vset(inv);                                                                 \
    int64_t j = 0;                                                                          \
    for (; j + W <= d; j += W) vstore(out + j, vmul(vmul(vload(x + j), vi), vload(w + j))); \
    for (; j < d; ++j) out[j] = (x[j] * inv) * w[j];                                        \
  }                                                                                         \
  void add_row(const float* a, float* h, int64_t d) {                                       \
    int64_t j = 0;                                                                          \
    for (; j + W <= d; j += W) vstore(h + j, vadd(vload(a + j), vload(h + j)));             \
    for (; j < d; ++j) h[j] = a[j] + h[j];                                                  \
  }                                                                                         \
  /* silu(g) * u = g / (1 + exp(-g)) * u */                                                 \
  void silu_row(const float* g, const float* u, float* o, int64_t n) {                      \
    const V one = vset(1.0f);                                                               \
    int64_t j = 0;                                                                          \
    for (; j + W <= n; j += W) {                                                            \
      const V x = vload(g + j);                                                             \
      const V e = vexp(vsub(vzero(), x));                                                   \
      vstore(o + j, vmul(vdiv(x, vadd(one, e)), vload(u + j)));                             \
    }                                                                                       \
    for (; j < n; ++j) o[j] = (g[j] / (1.f + std::exp(-g[j]))) * u[j];                      \
  }                                                                                         \
  constexpr RowKernels kRowKernels{sum_squares, scale_row, add_row, silu_row};

namespace {

struct RowKernels {
  float (*sum_squares)(const float*, int64_t);
  void (*scale_row)(const float*, const float*, float, float*, int64_t);
  void (*add_row)(const float*, float*, int64_t);
  void (*silu_row)(const float*, const float*, float*, int64_t);
};

}  // namespace

namespace nr_scalar {
constexpr int W = 1;
#define CTXFUSE_SIMD_WIDTH 1
#include "simd.h"
#undef CTXFUSE_SIMD_WIDTH
inline V vdiv(V a, V b) { return a / b; }
NR_ROW_KERNELS
}  // namespace nr_scalar

#ifdef NR_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace nr_avx2 {
constexpr int W = 8;
#define CTXFUSE_SIMD_WIDTH 8
#include "simd.h"
#undef CTXFUSE_SIMD_WIDTH
inline V vdiv(V a, V b) { return _mm256_div_ps(a, b); }
NR_ROW_KERNELS
}  // namespace nr_avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
namespace nr_avx512 {
constexpr int W = 16;
#define CTXFUSE_SIMD_WIDTH 16
#include "simd.h"
#undef CTXFUSE_SIMD_WIDTH
inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
NR_ROW_KERNELS
}  // namespace nr_avx512
#pragma GCC pop_options
#endif

namespace {

// 1 scalar, 2 AVX2, 3 AVX-512 (as the attention kernels' levels)
int64_t best_level() {
#ifdef NR_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")) {
    return 3;
  }
  if (avx2) return 2;
#endif
  return 1;
}

int64_t g_level = best_level();

const RowKernels& kernels() {
#ifdef NR_X86
  if (g_level == 3) return nr_avx512::kRowKernels;
  if (g_level == 2) return nr_avx2::kRowKernels;
#endif
  return nr_scalar::kRowKernels;
}

void set_isa(int64_t level) {
  const int64_t best = best_level();
  TORCH_CHECK_VALUE(level >= 1 && level <= best, "ISA level ", level, " is not available here (best: ",
                    best, ")");
  g_level = level;
}

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

inline void norm_row(const RowKernels& k, const float* x, const float* w, float* out, int64_t d,
                     float eps) {
  const float inv = 1.f / std::sqrt(k.sum_squares(x, d) / static_cast<float>(d) + eps);
  k.scale_row(x, w, inv, out, d);
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
  const RowKernels& k = kernels();
  rows(n, [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r) norm_row(k, xp + r * xs, wp, op + r * d, d, static_cast<float>(eps));
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
  const RowKernels& k = kernels();
  rows(n, [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r) {
      float* h = hp + r * hs;
      k.add_row(xp + r * xs, h, d);
      norm_row(k, h, wp, op + r * d, d, static_cast<float>(eps));
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
  const RowKernels& k = kernels();
  rows(n, [&](int64_t r0, int64_t r1, int) {
    for (int64_t r = r0; r < r1; ++r) k.silu_row(gp + r * gs, gp + r * gs + inter, op + r * inter, inter);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("rms_norm", &rms_norm, "x * rsqrt(mean(x^2) + eps) * weight (fp32)");
  mod.def("add_rms_norm_", &add_rms_norm_, "residual += x; (rms_norm(residual), residual) (fp32)");
  mod.def("rope_", &rope_, "rotate-half RoPE in place on [T, heads, d] (fp32)");
  mod.def("silu_mul", &silu_mul, "silu(gate) * up from [T, 2I] (fp32)");
  mod.def("best_isa", &best_level, "the widest vector path here: 1 scalar, 2 AVX2, 3 AVX-512");
  mod.def("isa", [] { return g_level; }, "the vector path the kernels take");
  mod.def("set_isa", &set_isa, "take a narrower vector path (CTXFUSE_CPU_ISA, tests)");
}
