// Merging the parts of a split attention row (flash-decoding): each part s of a row's keys left its
// running max m_s, its sum l_s of exp(score - m_s) and its unnormalized output acc_s; the row's
// output is sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M), M = max over the parts that saw a key
// (l_s > 0). Shared by the decode kernel (paged_attention.cpp) and the prefill kernel
// (prefill_attention.cpp), whose partials lay these out differently: hence the strides.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace ctxfuse_merge {

// Part s of the row: m at m[s * stride], l at l[s * stride], acc [d] at acc + s * stride. Writes
// out [d] and returns true; a row no part saw anything of is left as it is (false).
inline bool merge_row(const float* m, const float* l, const float* acc, int64_t stride, int64_t count,
                      int64_t d, float* out, std::vector<float>& w) {
  w.resize(count);
  float big = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < count; ++s) {
    if (l[s * stride] > 0.0f) big = std::max(big, m[s * stride]);
  }
  float den = 0.0f;
  for (int64_t s = 0; s < count; ++s) {
    w[s] = l[s * stride] > 0.0f ? std::exp(m[s * stride] - big) : 0.0f;
    den += w[s] * l[s * stride];
  }
  if (!(den > 0.0f)) return false;
  for (int64_t c = 0; c < d; ++c) {
    float num = 0.0f;
    for (int64_t s = 0; s < count; ++s) {
      if (w[s] != 0.0f) num += w[s] * acc[s * stride + c];
    }
    out[c] = num / den;
  }
  return true;
}

}  // namespace ctxfuse_merge
