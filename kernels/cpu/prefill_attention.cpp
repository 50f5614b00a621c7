// Causal prefill attention on the CPU, read in place from the paged KV cache: a chunk of n query
// tokens at positions start .. start + n - 1 against keys 0 .. (its own position), the earlier
// ones cached by previous chunks, its own just written (fp32 cache only). The math is the PyTorch
// reference's (cloud/engine/attention.py DenseAttention.prefill, softmax(q k^T * scale) v with a
// causal mask): fp32 throughout, only the order of fp32 additions differs.
//
// Why not PyTorch's CPU flash kernel: it reaches ~170 GFLOP/s on our 2-core AVX-512 machine where
// the same cores run ~430 in our weight GEMM, it needs the context gathered out of the pages, and
// it has no GQA for a causal call (the K/V of the chunk are repeated per query head).
//
// Layout: the problem is worked transposed, so that every step is vertical (no horizontal sums):
// an item is (KV head h, a run of positions), and its R rows are the (position, group head) pairs,
// R <= 48, lanes of vectors. Per item:
//   qt [d][R]   the queries times the softmax scale, transposed once;
//   per tile of 64 keys (key rows read from the cache pages by pointer):
//   st [64][R]  scores: st[j] = sum_c k_j[c] * qt[c]  (k_j[c] broadcast, qt[c] vectors: a GEMM
//               micro-kernel of KB keys x RV row vectors in registers);
//               keys after a row's position: -inf (only in tiles that reach past the item's first
//               position);
//   softmax     m_new = max(m, max_j st[j]) lane-wise; st[j] = exp(st[j] - m_new);
//               alpha = exp(m - m_new); l = l * alpha + sum_j st[j];
//   ot [d][R]   ot[c] = ot[c] * alpha + sum_j v_j[c] * st[j]  (the same micro-kernel shape).
// At the end out[row] = ot[.][row] / l[row]. The first tile holds key 0, which every row sees, so m
// is finite from then on and masked scores give exp(-inf) = 0, never NaN. Keys past the item's
// last position are never read: a tile's tail points at its last live key and is masked.
//
// Items run longest first on the thread pool (the last positions see the most keys). A short chunk
// after a long context (a verify step: 1 + drafts positions) makes one item per KV head, fewer than
// the threads could share: each is then cut into parts over its keys (flash-decoding), every cut
// inside the prefix that all its rows see, and the parts' m, l and ot are merged at the end.
//
// Built into the paged_attention extension (paged_attention.cpp binds it and picks the ISA level).
// ISA: as paged_attention.cpp, the kernel text below `#else` is compiled for plain C++, AVX2 + FMA
// and AVX-512 in namespaces of their own and chosen at run time; simd.h holds the primitives.

#ifndef PF_KERNEL_PASS

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "lse_merge.h"
#include "thread_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#define PF_X86 1
#include <immintrin.h>
#endif

namespace pf {

constexpr int64_t kKeyTile = 64;     // keys per tile, at most (whole key blocks: KB below)
constexpr int64_t kMaxRows = 48;     // rows (position, group head) per item
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kInlineTiles = 8;  // fewer (item, key tile) pairs than this: the caller alone
// A short chunk after a long context (a verify step's drafts) has a few items only, one per KV
// head: each is split over its shared prefix until a thread has this many to take
constexpr int64_t kItemsPerThread = 4;

struct Problem {
  const float* q = nullptr;  // [n, H, d]
  int64_t qs0 = 0, qs1 = 0;  // strides in floats
  const float* k = nullptr;  // [kv_heads, num_blocks, block_size, d]
  const float* v = nullptr;
  int64_t cs0 = 0, cs1 = 0, cs2 = 0;  // cache strides in floats (keys and values alike)
  std::vector<int64_t> table;         // the chunk's blocks, checked against the cache
  int64_t n = 0, heads = 0, kv_heads = 0, group = 0, head_dim = 0, block_size = 0, start = 0;
  float scale = 1.0f;
  float* out = nullptr;  // [n, H, d]
  int64_t os0 = 0, os1 = 0;
  float* parts = nullptr;  // the partials of split items (part_floats each)

  const float* key(int64_t h, int64_t pos) const {
    return k + h * cs0 + table[pos / block_size] * cs1 + (pos % block_size) * cs2;
  }
  const float* value(int64_t h, int64_t pos) const {
    return v + h * cs0 + table[pos / block_size] * cs1 + (pos % block_size) * cs2;
  }
};

// positions [t0, t1) of the chunk with KV head h, over keys [k_lo, k_hi) (cut at k_hi only when the
// item is one part of a split: part >= 0 is the index of its partial m, l and ot)
struct Item {
  int64_t h, t0, t1;
  int64_t k_lo = 0, k_hi = std::numeric_limits<int64_t>::max(), part = -1;
};

// The parts of one split item: partials first .. first + count - 1
struct Split {
  int64_t h, t0, t1, first, count;
};

// floats of one partial: m, l [kMaxRows], ot [kMaxRows][d]
constexpr int64_t part_floats(int64_t d) { return (2 + d) * kMaxRows; }

// floats of one thread's scratch: qt, st, ot, positions, m, l, alpha (rows padded to 48)
constexpr int64_t scratch_floats(int64_t d) {
  return (2 * d + kKeyTile + 4) * kMaxRows;
}

using ItemFn = void (*)(const Problem&, const Item&, float* scratch);

}  // namespace pf

#define PF_KERNEL_PASS 1

#define PF_NS scalar
#define PF_WIDTH 1
#include __FILE__
#undef PF_NS
#undef PF_WIDTH

#ifdef PF_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define PF_NS avx2
#define PF_WIDTH 8
#include __FILE__
#undef PF_NS
#undef PF_WIDTH
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#define PF_NS avx512
#define PF_WIDTH 16
#include __FILE__
#undef PF_NS
#undef PF_WIDTH
#pragma GCC pop_options
#endif

namespace pa {
int64_t isa_level(int64_t isa);  // paged_attention.cpp: 1 scalar, 2 AVX2, 3 AVX-512 (0: the best)
}  // namespace pa

namespace pf {

ItemFn item_fn(int64_t isa) {
  const int64_t level = pa::isa_level(isa);
#ifdef PF_X86
  if (level == 3) return avx512::run_item;
  if (level == 2) return avx2::run_item;
#endif
  return scalar::run_item;
}

void check_cache(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.dim() == 4,
                    name, " must be a float32 CPU tensor [kv_heads, num_blocks, block_size, d]");
  TORCH_CHECK_VALUE(t.stride(3) == 1, name, " needs a contiguous last dimension");
}

// Fewer items than the threads can share (a short chunk: one per KV head): each is cut into parts
// over its keys, the cuts at whole key tiles within the prefix all its rows see (so every part's
// first key is seen by every row). Replaces those items by their parts in `items`; returns the
// number of partials.
int64_t split_items(const Problem& p, int64_t threads, std::vector<Item>& items, std::vector<Split>& splits) {
  const int64_t n_items = static_cast<int64_t>(items.size()), want = threads * kItemsPerThread;
  if (threads <= 1 || n_items >= want) return 0;
  const int64_t kt = kKeyTile;  // parts cut at multiples of the tile (KT divides it: KB does)
  std::vector<Item> out;
  int64_t parts = 0;
  for (const Item& it : items) {
    const int64_t first = p.start + it.t0, keys = p.start + it.t1;  // keys 0 .. keys - 1
    const int64_t tiles = (keys + kt - 1) / kt;
    int64_t count = std::min((want + n_items - 1) / n_items, tiles);
    int64_t per = count > 0 ? (tiles + count - 1) / count : tiles;  // tiles per part
    while (count > 1 && (count - 1) * per * kt > first) {  // the last cut must be a key row 0 sees
      --count;
      per = (tiles + count - 1) / count;
    }
    if (count <= 1) {
      out.push_back(it);
      continue;
    }
    splits.push_back({it.h, it.t0, it.t1, parts, count});
    for (int64_t s = 0; s < count; ++s) {
      const int64_t lo = s * per * kt, hi = s + 1 < count ? (s + 1) * per * kt : keys;
      out.push_back({it.h, it.t0, it.t1, lo, hi, parts++});
    }
  }
  items = std::move(out);
  return parts;
}

// Each split item's rows from its parts (lse_merge.h: every part saw a key of every row)
void merge(const Problem& p, const std::vector<Split>& splits) {
  const int64_t d = p.head_dim, g_n = p.group, stride = part_floats(d);
  std::vector<float> w;
  for (const Split& sp : splits) {
    const float* first = p.parts + sp.first * stride;
    const int64_t rows = (sp.t1 - sp.t0) * g_n;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t t = sp.t0 + r / g_n;
      float* o = p.out + t * p.os0 + (sp.h * g_n + r % g_n) * p.os1;
      ctxfuse_merge::merge_row(first + r, first + kMaxRows + r, first + 2 * kMaxRows + r * d, stride,
                               sp.count, d, o, w);
    }
  }
}

// q [n, H, d] fp32; k_cache, v_cache [kv_heads, num_blocks, block_size, d] fp32 (same strides);
// table [>= ceil((start + n) / block_size)] block ids; out [n, H, d] fp32 or undefined (a new one)
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& table, int64_t start, double scale,
                             c10::optional<at::Tensor> out_arg, int64_t isa) {
  TORCH_CHECK_VALUE(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3,
                    "q must be a float32 CPU tensor [n, heads, d]");
  TORCH_CHECK_VALUE(q.size(2) <= 1 || q.stride(2) == 1, "q needs a contiguous last dimension");
  check_cache(k_cache, "k_cache");
  check_cache(v_cache, "v_cache");
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(),
                    "k_cache and v_cache must have the same shape and strides");
  Problem p;
  p.n = q.size(0);
  p.heads = q.size(1);
  p.head_dim = q.size(2);
  p.kv_heads = k_cache.size(0);
  p.block_size = k_cache.size(2);
  p.start = start;
  p.scale = static_cast<float>(scale);
  const int64_t d = p.head_dim, num_blocks = k_cache.size(1);
  TORCH_CHECK_VALUE(k_cache.size(3) == d, "head dims differ: q has ", d, ", the cache ", k_cache.size(3));
  TORCH_CHECK_VALUE(d > 0 && d % 8 == 0 && d <= kMaxHeadDim, "head dim ", d,
                    " is not supported (a multiple of 8 up to ", kMaxHeadDim, ")");
  TORCH_CHECK_VALUE(p.kv_heads > 0 && p.heads % p.kv_heads == 0, p.heads,
                    " query heads are not a multiple of ", p.kv_heads, " KV heads");
  p.group = p.heads / p.kv_heads;
  TORCH_CHECK_VALUE(p.group <= kMaxRows, "more than ", kMaxRows, " query heads per KV head");
  TORCH_CHECK_VALUE(start >= 0, "start must be >= 0, got ", start);
  TORCH_CHECK_VALUE(p.block_size > 0, "empty cache blocks");
  TORCH_CHECK_VALUE(std::isfinite(scale), "scale must be finite");
  at::Tensor out;
  if (out_arg.has_value() && out_arg->defined()) {
    out = *out_arg;
    TORCH_CHECK_VALUE(out.device().is_cpu() && out.scalar_type() == at::kFloat &&
                          out.sizes() == q.sizes() && out.stride(2) == 1,
                      "out must be a float32 CPU tensor shaped as q with a contiguous last dimension");
  } else {
    out = at::empty(q.sizes(), q.options());
  }
  if (p.n == 0 || p.heads == 0) return out;
  TORCH_CHECK_VALUE(table.device().is_cpu() && table.dim() == 1 &&
                        (table.scalar_type() == at::kInt || table.scalar_type() == at::kLong),
                    "table must be a 1-D int32 or int64 CPU tensor");
  const int64_t need = (start + p.n + p.block_size - 1) / p.block_size;
  TORCH_CHECK_VALUE(table.size(0) >= need, "table has ", table.size(0), " blocks; positions 0..",
                    start + p.n - 1, " need ", need);
  const at::Tensor ids = table.slice(0, 0, need).to(at::kLong).contiguous();
  p.table.assign(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + need);
  for (int64_t i = 0; i < need; ++i) {
    TORCH_CHECK_VALUE(p.table[i] >= 0 && p.table[i] < num_blocks, "table entry ", i, " is block ",
                      p.table[i], ", outside the cache's ", num_blocks, " blocks");
  }
  p.q = q.data_ptr<float>();
  p.qs0 = q.stride(0);
  p.qs1 = q.stride(1);
  p.k = k_cache.data_ptr<float>();
  p.v = v_cache.data_ptr<float>();
  p.cs0 = k_cache.stride(0);
  p.cs1 = k_cache.stride(1);
  p.cs2 = k_cache.stride(2);
  p.out = out.data_ptr<float>();
  p.os0 = out.stride(0);
  p.os1 = out.stride(1);

  const ItemFn fn = item_fn(isa);
  const int64_t span = std::max<int64_t>(1, kMaxRows / p.group);  // positions per item
  std::vector<Item> items;
  int64_t tiles = 0;
  for (int64_t t1 = p.n; t1 > 0; t1 -= span) {  // the last positions (most keys) first
    const int64_t t0 = std::max<int64_t>(0, t1 - span);
    for (int64_t h = 0; h < p.kv_heads; ++h) items.push_back({h, t0, t1});
    tiles += p.kv_heads * ((start + t1 + kKeyTile - 1) / kKeyTile);
  }
  const int64_t pool = tiles < kInlineTiles ? 1 : std::max(1, at::get_num_threads());
  std::vector<Split> splits;
  const int64_t parts = split_items(p, pool, items, splits);
  std::vector<float> partials(parts * part_floats(d));
  p.parts = partials.data();
  const int64_t n_items = static_cast<int64_t>(items.size());
  const int threads = static_cast<int>(std::min(n_items, pool));
  std::vector<std::vector<float>> scratch(threads);
  ctxfuse_pool::parallel_for(
      n_items, 1,
      [&](int64_t i0, int64_t i1, int t) {
        std::vector<float>& s = scratch[t];
        if (s.empty()) s.resize(scratch_floats(d));
        for (int64_t i = i0; i < i1; ++i) fn(p, items[i], s.data());
      },
      threads);
  merge(p, splits);
  return out;
}

}  // namespace pf

#else  // PF_KERNEL_PASS ------------------------------------------------------------------------
// The kernel, compiled once per ISA: namespace pf::PF_NS, vectors V of W = PF_WIDTH floats.

namespace pf::PF_NS {

constexpr int W = PF_WIDTH;

#define CTXFUSE_SIMD_WIDTH PF_WIDTH
#include "simd.h"
#undef CTXFUSE_SIMD_WIDTH

// Register blocking of both micro-kernels: KB broadcast scalars (keys, or value channels) times up
// to RV row vectors. AVX-512 has 32 vector registers (24 accumulators), AVX2 16 (12).
#if PF_WIDTH == 16
constexpr int KB = 8, RV = 3;
#elif PF_WIDTH == 8
constexpr int KB = 4, RV = 3;  // measured at 7K: 4x3 205, 6x2 197, 3x3 195, 4x2 185 GFLOP/s
#else
constexpr int KB = 4, RV = 4;
#endif
constexpr int64_t KT = kKeyTile / KB * KB;  // keys per tile

// st[j * R + r..] = sum_c keys[j][c] * qt[c * R + r..] for KB keys j and NR row vectors from r
template <int NR>
inline void score_block(const float* const* keys, const float* qt, int64_t d, int64_t rp, int64_t r,
                        float* st) {
  V acc[KB][NR];
  for (int j = 0; j < KB; ++j)
    for (int i = 0; i < NR; ++i) acc[j][i] = vzero();
  for (int64_t c = 0; c < d; ++c) {
    V qv[NR];
    for (int i = 0; i < NR; ++i) qv[i] = vload(qt + c * rp + r + i * W);
    for (int j = 0; j < KB; ++j) {
      const V kc = vset(keys[j][c]);
      for (int i = 0; i < NR; ++i) acc[j][i] = vfma(kc, qv[i], acc[j][i]);
    }
  }
  for (int j = 0; j < KB; ++j)
    for (int i = 0; i < NR; ++i) vstore(st + j * rp + r + i * W, acc[j][i]);
}

// ot[c * R + r..] = ot * alpha + sum_j vals[j][c] * st[j * R + r..] for KB channels c0.. and NR
// row vectors from r, over nk keys
template <int NR>
inline void value_block(const float* const* vals, const float* st, int64_t nk, int64_t c0, int64_t rp,
                        int64_t r, const float* alpha, float* ot) {
  V acc[KB][NR];
  for (int i = 0; i < NR; ++i) {
    const V a = vload(alpha + r + i * W);
    for (int c = 0; c < KB; ++c) acc[c][i] = vmul(vload(ot + (c0 + c) * rp + r + i * W), a);
  }
  for (int64_t j = 0; j < nk; ++j) {
    V pv[NR];
    for (int i = 0; i < NR; ++i) pv[i] = vload(st + j * rp + r + i * W);
    const float* vj = vals[j] + c0;
    for (int c = 0; c < KB; ++c) {
      const V vc = vset(vj[c]);
      for (int i = 0; i < NR; ++i) acc[c][i] = vfma(vc, pv[i], acc[c][i]);
    }
  }
  for (int c = 0; c < KB; ++c)
    for (int i = 0; i < NR; ++i) vstore(ot + (c0 + c) * rp + r + i * W, acc[c][i]);
}

template <int N>
using Rows = std::integral_constant<int, N>;

// fn(Rows<NR>, r) over the nv row vectors: RV at a time, then the rest
template <class F>
inline void over_rows(int64_t nv, F&& fn) {
  int64_t v = 0;
  for (; v + RV <= nv; v += RV) fn(Rows<RV>{}, v * W);
  switch (nv - v) {
    case 1: fn(Rows<1>{}, v * W); break;
    case 2: if constexpr (RV > 2) fn(Rows<2>{}, v * W); break;
    case 3: if constexpr (RV > 3) fn(Rows<3>{}, v * W); break;
    default: break;
  }
}

void run_item(const Problem& p, const Item& it, float* scratch) {
  const int64_t d = p.head_dim, g_n = p.group, h = it.h;
  const int64_t rows = (it.t1 - it.t0) * g_n;
  const int64_t nv = (rows + W - 1) / W, rp = nv * W;  // row vectors; rows padded to whole vectors
  float* qt = scratch;             // [d][rp]
  float* st = qt + d * kMaxRows;   // [kKeyTile][rp]
  float* ot = st + kKeyTile * kMaxRows;  // [d][rp]
  float* pos = ot + d * kMaxRows;  // [rp] each row's position, as a float
  float* m = pos + kMaxRows;
  float* l = m + kMaxRows;
  float* alpha = l + kMaxRows;

  // rows r = (t - t0) * G + g; padding rows copy the last row's position and see zero queries
  const int64_t first = p.start + it.t0, last = p.start + it.t1 - 1;
  for (int64_t r = 0; r < rp; ++r) {
    const bool live = r < rows;
    const int64_t t = live ? it.t0 + r / g_n : it.t1 - 1;
    pos[r] = static_cast<float>(p.start + t);
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
    const float* qrow = live ? p.q + t * p.qs0 + (h * g_n + r % g_n) * p.qs1 : nullptr;
    for (int64_t c = 0; c < d; ++c) {
      qt[c * rp + r] = live ? qrow[c] * p.scale : 0.0f;
      ot[c * rp + r] = 0.0f;
    }
  }

  const float* keys[kKeyTile];
  const float* vals[kKeyTile];
  // a part of a split starts at a key every row sees (k_lo <= first), so m is finite after its
  // first tile as it is after key 0's
  const int64_t k_end = std::min(last + 1, it.k_hi);
  for (int64_t k0 = it.k_lo; k0 < k_end; k0 += KT) {
    const int64_t live = std::min(KT, k_end - k0);
    const int64_t nk = (live + KB - 1) / KB * KB;  // whole key blocks; the tail repeats a live key
    for (int64_t j = 0; j < nk; ++j) {
      const int64_t at = k0 + std::min(j, live - 1);
      keys[j] = p.key(h, at);
      vals[j] = p.value(h, at);
    }
    // scores
    for (int64_t j = 0; j < nk; j += KB) {
      over_rows(nv, [&](auto nr, int64_t r) { score_block<decltype(nr)::value>(keys + j, qt, d, rp, r, st + j * rp); });
    }
    // causal mask: keys after a row's position (the tail: after the last position)
    for (int64_t j = std::max<int64_t>(0, first + 1 - k0); j < nk; ++j) {
      const float at = static_cast<float>(k0 + j);
      for (int64_t r = 0; r < rp; r += W) vstore(st + j * rp + r, vmask_below(vload(st + j * rp + r), vload(pos + r), at));
    }
    // online softmax, lane-wise
    for (int64_t r = 0; r < rp; r += W) {
      const V m_old = vload(m + r);
      V mx = m_old;
      for (int64_t j = 0; j < nk; ++j) mx = vmax(mx, vload(st + j * rp + r));
      V sum = vzero();
      for (int64_t j = 0; j < nk; ++j) {
        const V e = vexp_nonpos(vsub(vload(st + j * rp + r), mx));
        vstore(st + j * rp + r, e);
        sum = vadd(sum, e);
      }
      const V a = vexp(vsub(m_old, mx));  // m_old = -inf (first tile): 0
      vstore(alpha + r, a);
      vstore(l + r, vfma(vload(l + r), a, sum));
      vstore(m + r, mx);
    }
    // values
    for (int64_t c0 = 0; c0 < d; c0 += KB) {
      over_rows(nv, [&](auto nr, int64_t r) { value_block<decltype(nr)::value>(vals, st, nk, c0, rp, r, alpha, ot); });
    }
  }

  if (it.part >= 0) {
    float* part = p.parts + it.part * part_floats(d);
    for (int64_t r = 0; r < rows; ++r) {
      part[r] = m[r];
      part[kMaxRows + r] = l[r];
      for (int64_t c = 0; c < d; ++c) part[2 * kMaxRows + r * d + c] = ot[c * rp + r];
    }
    return;
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = it.t0 + r / g_n;
    float* o = p.out + t * p.os0 + (h * g_n + r % g_n) * p.os1;
    const float inv = 1.0f / l[r];
    for (int64_t c = 0; c < d; ++c) o[c] = ot[c * rp + r] * inv;
  }
}

}  // namespace pf::PF_NS

#endif  // PF_KERNEL_PASS
