// The sampler's last step on the CPU in one pass: for each row, argmax over the vocabulary of
// probs / noise, where noise is the engine's seeded Exp(1) draw of each (seed, step, token id)
// (cloud/engine/sampler.py exponential_noise, the reference). PyTorch spends ~15 full passes over
// [rows, vocab] int64 tensors on the noise alone; here each element is hashed, divided and compared
// in registers, and nothing of vocab size is allocated.
//
// The same arithmetic as the reference: splitmix64's finalizer over the same wrapping 64-bit key,
// 53 bits to a double uniform in (0, 1), -log(u) in double rounded to float, then probs / noise in
// float and the first index of the largest quotient (as torch.argmax). Only the double log may
// differ from PyTorch's in its last bit, which the float rounding then almost always absorbs.
//
// Threads: rows x vocabulary slices on the thread pool, each slice's best merged in slice order
// (so ties still go to the lowest index).
#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "thread_pool.h"

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kMix1 = 0xBF58476D1CE4E5B9ull;
constexpr uint64_t kMix2 = 0x94D049BB133111EBull;
constexpr uint64_t kStepKey = 0xD1B54A32D192ED03ull;
constexpr int64_t kSlice = 8192;        // vocabulary entries per work item
constexpr int64_t kInlineItems = 4;     // fewer items: the caller alone

inline float noise(uint64_t base, int64_t token) {
  uint64_t z = base + static_cast<uint64_t>(token) * kGolden;
  z = (z ^ (z >> 30)) * kMix1;
  z = (z ^ (z >> 27)) * kMix2;
  z = z ^ (z >> 31);
  const double u = (static_cast<double>(z >> 11) + 0.5) * (1.0 / 9007199254740992.0);  // 2^53
  return static_cast<float>(-std::log(u));
}

struct Best {
  float value;
  int64_t index;
};

// probs [rows, vocab] fp32 (rows contiguous), seeds and steps [rows] int64 -> [rows] int64
torch::Tensor noisy_argmax(const torch::Tensor& probs, const torch::Tensor& seeds, const torch::Tensor& steps) {
  TORCH_CHECK_VALUE(probs.device().is_cpu() && probs.scalar_type() == torch::kFloat32 && probs.dim() == 2,
                    "probs must be a float32 CPU tensor [rows, vocab]");
  TORCH_CHECK_VALUE(probs.stride(1) == 1 || probs.size(1) <= 1, "probs needs contiguous rows");
  const int64_t rows = probs.size(0), vocab = probs.size(1);
  for (const auto* t : {&seeds, &steps}) {
    TORCH_CHECK_VALUE(t->device().is_cpu() && t->scalar_type() == torch::kInt64 && t->dim() == 1 &&
                          t->size(0) == rows,
                      "seeds and steps must be int64 CPU tensors [rows]");
  }
  TORCH_CHECK_VALUE(vocab > 0 || rows == 0, "an empty vocabulary has no argmax");
  auto out = torch::empty({rows}, torch::kInt64);
  if (rows == 0) return out;
  const auto seed_c = seeds.contiguous(), step_c = steps.contiguous();
  const int64_t* sd = seed_c.data_ptr<int64_t>();
  const int64_t* st = step_c.data_ptr<int64_t>();
  const float* p = probs.data_ptr<float>();
  const int64_t ps = probs.stride(0);
  const int64_t slices = (vocab + kSlice - 1) / kSlice, items = rows * slices;
  std::vector<Best> best(items);
  auto work = [&](int64_t i0, int64_t i1, int) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / slices, lo = (i % slices) * kSlice, hi = std::min(vocab, lo + kSlice);
      const uint64_t base = static_cast<uint64_t>(sd[r]) * kGolden + static_cast<uint64_t>(st[r]) * kStepKey;
      const float* row = p + r * ps;
      Best b{row[lo] / noise(base, lo), lo};
      for (int64_t t = lo + 1; t < hi; ++t) {
        const float q = row[t] / noise(base, t);
        if (q > b.value || (std::isnan(q) && !std::isnan(b.value))) b = {q, t};  // NaN wins, as argmax
      }
      best[i] = b;
    }
  };
  if (items < kInlineItems) {
    work(0, items, 0);
  } else {
    ctxfuse_pool::parallel_for(items, 1, work);
  }
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r) {
    Best b = best[r * slices];
    for (int64_t s = 1; s < slices; ++s) {
      const Best& c = best[r * slices + s];
      if (std::isnan(b.value)) break;
      if (c.value > b.value || std::isnan(c.value)) b = c;
    }
    o[r] = b.index;
  }
  return out;
}

// the reference's noise itself, [rows, vocab] fp32 (for tests)
torch::Tensor exponential_noise(const torch::Tensor& seeds, const torch::Tensor& steps, int64_t vocab) {
  TORCH_CHECK_VALUE(seeds.scalar_type() == torch::kInt64 && steps.scalar_type() == torch::kInt64 &&
                        seeds.dim() == 1 && steps.sizes() == seeds.sizes() && vocab >= 0,
                    "seeds and steps must be int64 [rows] alike and vocab >= 0");
  const auto sd = seeds.contiguous(), st = steps.contiguous();
  auto out = torch::empty({seeds.size(0), vocab}, torch::kFloat32);
  float* o = out.data_ptr<float>();
  for (int64_t r = 0; r < seeds.size(0); ++r) {
    const uint64_t base = static_cast<uint64_t>(sd.data_ptr<int64_t>()[r]) * kGolden +
                          static_cast<uint64_t>(st.data_ptr<int64_t>()[r]) * kStepKey;
    for (int64_t t = 0; t < vocab; ++t) o[r * vocab + t] = noise(base, t);
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  mod.def("noisy_argmax", &noisy_argmax, "argmax(probs / exponential_noise) per row -> [rows] int64", nogil);
  mod.def("exponential_noise", &exponential_noise, "the sampler's seeded Exp(1) draws [rows, vocab]", nogil);
}
