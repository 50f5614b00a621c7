// Quest block selection on the CPU: per (request, KV head), which blocks of its context a sparse
// decode step reads, chosen by the blocks' key bounds. The same rule and output as the Triton
// kernel (kernels/triton/quest_select.py, its module docstring) and its PyTorch reference
// (quest_select_reference), so the CPU backend hands the result straight to sparse_paged_decode:
//
//   sinks   [0, min(S, nblk))          always kept
//   middle  [S, nblk - W)              the top `top_k` by bound are kept
//   window  [max(nblk - W, S), nblk)   always kept
//
// The bound of a middle block is the best over the head's query group of q+ . kmax + q- . kmin
// (Quest's sum_c max(q_c kmin_c, q_c kmax_c)) over the block's fp16 key summaries. Ties go to the
// lower position; a bound that is -inf or NaN is never picked. Output per pair: the kept positions
// ascending, then -1. With `every` [kv_heads] set for a head (a retrieval head, DuoAttention's
// split), that head keeps all of [0, nblk) and the output is max_blocks wide where that is wider.
//
// Why a kernel: the PyTorch spelling gathers each middle block's summaries into fresh tensors,
// converts them, runs two matmuls, a top-k and a sort, ~15 operations a layer: 0.6 ms a layer at
// 16K tokens on two cores, a third of sparse decode's attention time. Here the summaries are read
// in place once (2 x d fp16 per block), scored in registers and the top-k taken by nth_element.
//
// ISA: fp16 -> fp32 with F16C and the dot products with FMA where the CPU has them (AVX2 path,
// chosen at run time), else plain C++. Threads: (request, KV head) pairs on the thread pool.
#include <torch/extension.h>

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "thread_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#define QS_X86 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kInlineBlocks = 64;  // fewer middle blocks in all: the caller alone
constexpr int64_t kAhead = 4;          // blocks prefetched ahead of the one scored

struct Problem {
  const float* q;  // [b, H, d] fp32 contiguous
  const c10::Half* kmin;
  const c10::Half* kmax;  // [kv_heads, num_blocks, d]
  int64_t n_head, n_block, x_head, x_block;  // kmin's and kmax's strides (elements)
  const int64_t* tables;    // [b, max_blocks] int64 contiguous
  const int64_t* lens;      // [b]
  const bool* every;        // [kv_heads] or nullptr
  int64_t kv_heads, group, d, num_blocks, max_blocks, block_size;
  int64_t sinks, window, top_k, width;
  int32_t* out;  // [b, kv_heads, width]
};

// bounds[i] for the middle blocks i = 0 .. n - 1 (positions sinks + i), scalar
void score_plain(const Problem& p, const float* qg, const int64_t* ids, int64_t n, int64_t h, float* bounds) {
  const int64_t d = p.d;
  for (int64_t i = 0; i < n; ++i) {
    const c10::Half* lo = p.kmin + h * p.n_head + ids[i] * p.n_block;
    const c10::Half* hi = p.kmax + h * p.x_head + ids[i] * p.x_block;
    float best = -std::numeric_limits<float>::infinity();
    bool nan = false;
    for (int64_t g = 0; g < p.group; ++g) {
      const float* qr = qg + g * d;
      float acc = 0.0f;  // as the vector path: q+ * kmax + q- * kmin in every channel
      for (int64_t c = 0; c < d; ++c) {
        acc += std::max(qr[c], 0.0f) * static_cast<float>(hi[c]);
        acc += std::min(qr[c], 0.0f) * static_cast<float>(lo[c]);
      }
      nan |= std::isnan(acc);
      best = std::max(best, acc);
    }
    bounds[i] = nan ? std::numeric_limits<float>::quiet_NaN() : best;
  }
}

using ScoreFn = void (*)(const Problem&, const float*, const int64_t*, int64_t, int64_t, float*);

#ifdef QS_X86
// the same with F16C + FMA, 8 channels at a time (d a multiple of 8), for a group of G query heads:
// 2G accumulators in registers (kmax's and kmin's terms apart: half the chain of dependent FMAs)
template <int G>
__attribute__((target("avx2,fma,f16c"))) void score_avx2(const Problem& p, const float* qg,
                                                         const int64_t* ids, int64_t n, int64_t h,
                                                         float* bounds) {
  const int64_t d = p.d, steps = d / 8;
  // the group's q+ and q-, kept for the whole walk
  std::vector<float> qpos(G * d), qneg(G * d);
  for (int64_t c = 0; c < G * d; ++c) {
    qpos[c] = std::max(qg[c], 0.0f);
    qneg[c] = std::min(qg[c], 0.0f);
  }
  const float* qp = qpos.data();
  const float* qn = qneg.data();
  const c10::Half* kmin = p.kmin + h * p.n_head;
  const c10::Half* kmax = p.kmax + h * p.x_head;
  for (int64_t i = 0; i < n; ++i) {
    if (i + kAhead < n) {  // blocks may lie at random: fetch a later one's summaries meanwhile
      _mm_prefetch(reinterpret_cast<const char*>(kmin + ids[i + kAhead] * p.n_block), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(kmax + ids[i + kAhead] * p.x_block), _MM_HINT_T0);
    }
    const c10::Half* lo = kmin + ids[i] * p.n_block;
    const c10::Half* hi = kmax + ids[i] * p.x_block;
    __m256 up[G], down[G];
    for (int g = 0; g < G; ++g) up[g] = down[g] = _mm256_setzero_ps();
    for (int64_t s = 0; s < steps; ++s) {
      const __m256 vlo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo + s * 8)));
      const __m256 vhi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(hi + s * 8)));
      for (int g = 0; g < G; ++g) {
        up[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qp + g * d + s * 8), vhi, up[g]);
        down[g] = _mm256_fmadd_ps(_mm256_loadu_ps(qn + g * d + s * 8), vlo, down[g]);
      }
    }
    float best = -std::numeric_limits<float>::infinity();
    bool nan = false;
    for (int g = 0; g < G; ++g) {
      const __m256 sum = _mm256_add_ps(up[g], down[g]);
      __m128 x = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
      x = _mm_add_ps(x, _mm_movehl_ps(x, x));
      x = _mm_add_ss(x, _mm_movehdup_ps(x));
      const float v = _mm_cvtss_f32(x);
      nan |= std::isnan(v);
      best = std::max(best, v);
    }
    bounds[i] = nan ? std::numeric_limits<float>::quiet_NaN() : best;
  }
}

// the vector path for this group size, or nullptr (the plain path serves it)
ScoreFn vector_score(int64_t group) {
  switch (group) {
    case 1: return score_avx2<1>;
    case 2: return score_avx2<2>;
    case 3: return score_avx2<3>;
    case 4: return score_avx2<4>;
    case 5: return score_avx2<5>;
    case 6: return score_avx2<6>;
    case 7: return score_avx2<7>;
    case 8: return score_avx2<8>;
    default: return nullptr;
  }
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return yes;
}
#endif

// one (request r, KV head h) pair: its positions into out's row
void select_pair(const Problem& p, int64_t r, int64_t h, ScoreFn vector, std::vector<float>& bounds,
                 std::vector<int64_t>& ids, std::vector<int64_t>& order) {
  int32_t* row = p.out + (r * p.kv_heads + h) * p.width;
  std::fill(row, row + p.width, -1);
  const int64_t len = std::max<int64_t>(0, p.lens[r]);
  const int64_t nblk = std::min(p.max_blocks, (len + p.block_size - 1) / p.block_size);
  int64_t k = 0;
  if (p.every != nullptr && p.every[h]) {
    for (int64_t j = 0; j < nblk; ++j) row[k++] = static_cast<int32_t>(j);
    return;
  }
  const int64_t sink_end = std::min(p.sinks, nblk);
  const int64_t win_start = std::max(nblk - p.window, p.sinks);
  for (int64_t j = 0; j < sink_end; ++j) row[k++] = static_cast<int32_t>(j);
  const int64_t n = std::max<int64_t>(0, nblk - p.window - p.sinks);  // middle blocks
  if (n > 0 && p.top_k > 0) {
    bounds.resize(n);
    ids.resize(n);
    for (int64_t i = 0; i < n; ++i) ids[i] = p.tables[r * p.max_blocks + p.sinks + i];
    const float* qg = p.q + (r * p.kv_heads * p.group + h * p.group) * p.d;
    (vector != nullptr ? vector : score_plain)(p, qg, ids.data(), n, h, bounds.data());
    order.clear();
    for (int64_t i = 0; i < n; ++i) {
      if (!std::isnan(bounds[i]) && bounds[i] > -std::numeric_limits<float>::infinity()) order.push_back(i);
    }
    // highest bound first, the lower position on a tie
    const auto before = [&](int64_t a, int64_t b) {
      return bounds[a] > bounds[b] || (bounds[a] == bounds[b] && a < b);
    };
    if (static_cast<int64_t>(order.size()) > p.top_k) {
      std::nth_element(order.begin(), order.begin() + p.top_k, order.end(), before);
      order.resize(p.top_k);
    }
    std::sort(order.begin(), order.end());
    for (const int64_t i : order) row[k++] = static_cast<int32_t>(p.sinks + i);
  }
  for (int64_t j = win_start; j < nblk; ++j) row[k++] = static_cast<int32_t>(j);
}

// q [b, H, d] fp32 contiguous; kmin, kmax [kv_heads, num_blocks, d] fp16 (last dim contiguous);
// tables [b, max_blocks] and lens [b] int64 contiguous; every: [kv_heads] bool or an empty tensor
torch::Tensor quest_select(const torch::Tensor& q, const torch::Tensor& kmin, const torch::Tensor& kmax,
                           const torch::Tensor& tables, const torch::Tensor& lens, const torch::Tensor& every,
                           int64_t sinks, int64_t window, int64_t top_k, int64_t block_size, bool vector) {
  TORCH_CHECK_VALUE(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(),
                    "q must be a contiguous float32 [b, heads, d]");
  TORCH_CHECK_VALUE(kmin.dim() == 3 && kmin.sizes() == kmax.sizes() && kmin.scalar_type() == torch::kHalf &&
                        kmax.scalar_type() == torch::kHalf && kmin.stride(2) == 1 && kmax.stride(2) == 1,
                    "kmin and kmax must be float16 [kv_heads, num_blocks, d] alike, the last dim contiguous");
  TORCH_CHECK_VALUE(tables.dim() == 2 && tables.scalar_type() == torch::kInt64 && tables.is_contiguous() &&
                        tables.size(0) == q.size(0),
                    "block tables must be contiguous int64 [b, max_blocks]");
  TORCH_CHECK_VALUE(lens.dim() == 1 && lens.scalar_type() == torch::kInt64 && lens.size(0) == q.size(0) &&
                        lens.is_contiguous(),
                    "context lengths must be contiguous int64 [b]");
  const int64_t b = q.size(0), heads = q.size(1), d = q.size(2), kvh = kmin.size(0);
  TORCH_CHECK_VALUE(kvh > 0 && heads % kvh == 0 && kmin.size(2) == d,
                    "q's heads must be a multiple of kmin's KV heads, with the same head dim");
  TORCH_CHECK_VALUE(sinks >= 0 && window >= 0 && top_k >= 0 && block_size >= 1, "bad selection sizes");
  const bool* ev = nullptr;
  if (every.numel() != 0) {
    TORCH_CHECK_VALUE(every.scalar_type() == torch::kBool && every.dim() == 1 && every.size(0) == kvh &&
                          every.is_contiguous(),
                      "every must be a contiguous bool [kv_heads]");
    ev = every.data_ptr<bool>();
  }
  Problem p{};
  p.q = q.data_ptr<float>();
  p.kmin = kmin.data_ptr<c10::Half>();
  p.kmax = kmax.data_ptr<c10::Half>();
  p.n_head = kmin.stride(0);
  p.n_block = kmin.stride(1);
  p.x_head = kmax.stride(0);
  p.x_block = kmax.stride(1);
  p.tables = tables.data_ptr<int64_t>();
  p.lens = lens.data_ptr<int64_t>();
  p.every = ev;
  p.kv_heads = kvh;
  p.group = heads / kvh;
  p.d = d;
  p.num_blocks = kmin.size(1);
  p.max_blocks = tables.size(1);
  p.block_size = block_size;
  p.sinks = sinks;
  p.window = window;
  p.top_k = top_k;
  p.width = sinks + top_k + window;
  if (ev != nullptr && std::any_of(ev, ev + kvh, [](bool x) { return x; })) {
    p.width = std::max(p.width, p.max_blocks);  // a retrieval head lists every block
  }
  auto out = torch::empty({b, kvh, p.width}, torch::kInt32);
  p.out = out.data_ptr<int32_t>();
  // every block id the walk reads, checked before any thread starts (no exception may leave a region)
  int64_t middle = 0;
  for (int64_t r = 0; r < b; ++r) {
    const int64_t len = std::max<int64_t>(0, p.lens[r]);
    const int64_t nblk = std::min(p.max_blocks, (len + block_size - 1) / block_size);
    for (int64_t j = sinks; j < nblk - window; ++j) {
      const int64_t id = p.tables[r * p.max_blocks + j];
      TORCH_CHECK_VALUE(id >= 0 && id < p.num_blocks, "request ", r, " names block ", id, " outside the ",
                        p.num_blocks, " summarized");
      ++middle;
    }
  }
  ScoreFn score = nullptr;  // the vector path where it serves (F16C + FMA, d a multiple of 8)
#ifdef QS_X86
  if (vector && d % 8 == 0 && has_avx2()) score = vector_score(p.group);
#else
  (void)vector;
#endif
  const int64_t pairs = b * kvh;
  auto work = [&](int64_t i0, int64_t i1, int) {
    std::vector<float> bounds;
    std::vector<int64_t> ids, order;
    for (int64_t i = i0; i < i1; ++i) select_pair(p, i / kvh, i % kvh, score, bounds, ids, order);
  };
  if (middle * kvh < kInlineBlocks || pairs < 2) {
    work(0, pairs, 0);
  } else {
    ctxfuse_pool::parallel_for(pairs, 1, work);
  }
  return out;
}

bool vector_path() {
#ifdef QS_X86
  return has_avx2();
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  mod.def("quest_select", &quest_select, "Quest block selection -> [b, kv_heads, width] int32 positions",
          nogil);
  mod.def("vector_path", &vector_path, "whether this CPU takes the F16C + FMA path");
}
