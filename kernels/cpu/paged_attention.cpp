// Fused decode attention on the CPU: one query token per request against its context, read in
// place from the paged KV cache (fp32 / bf16 / fp16 rows, or int8 / int4 codes dequantized in
// registers), threaded over (request, KV head, context split). Multi-query: n query tokens per
// request (its last n positions, a verify step's drafts) share each item; row i sees the context
// but its last n - 1 - i keys, masked (-inf) in the blocks that hold them. The math is that of the PyTorch
// references in kernels/triton/ (paged_decode_reference, paged_decode_quant_reference,
// sparse_paged_decode_reference): fp32 throughout, only the order of fp32 additions differs.
//
// Work: an item is (request r, KV head h, a run [lo, hi) of the pair's block list). The list is the
// block table's first ceil(len / bs) entries (dense, quantized) or the selected block positions
// (sparse: -1, out of the table, or wholly past len: skipped). An item loads the G queries of the
// head's group once, times the softmax scale, then per block of T live tokens:
//   1. scores: each of the T key rows is loaded once and dotted with all G queries (GQA-packed);
//      the dot vectors of W rows are reduced together (a transpose-add tree, W scores at once);
//   2. online softmax per query: running max m and sum l in fp32, acc rescaled by exp(m_old - m);
//   3. values: acc[g] += p[g, t] * v_t over the T rows (acc [G, d] fp32).
// The next live block is prefetched meanwhile: blocks lie at random, so the hardware prefetchers
// cannot follow. Reads per block: T * d key and value elements, or T * w code bytes each with
// 2 * d fp16 key and 2 * T fp16 value parameters (a staged block: its T full-precision rows
// instead). Tokens at or past len are never read (a last block's tail may hold anything). When a
// pair's list is split over several items (flash-decoding, so 2+ threads work at batch 1), each
// writes m, l, acc to a partial and `merge` combines them; a single item writes acc / l itself.
//
// Quantized keys (per block and channel): key_c = kmin_c + code_c * step_c, step the fp32
// (kmax - kmin) / levels (1 where not > 0) rounded to fp16, as kv_quant.key_scale. So
//   q . key = q . kmin + sum_c (q_c * step_c) * code_c:
// per block qs = q * step and qz = q . kmin are computed once, per token only the codes convert.
// Values (per token): v_c = vzero + code_c * vscale, so
//   sum_t p_t v_t = sum_t (p_t * vscale_t) code_t + sum_t p_t * vzero_t:
// the codes go to an L1 tile as floats, the weights absorb vscale, the zero term is one add.
//
// ISA: one portable build (no -march). The kernel below `#else` is compiled three times by
// including this file into itself: plain C++, AVX2 + FMA + F16C and AVX-512 (F, BW, VL), each
// under `#pragma GCC target` in its own namespace; the best the CPU and OS support is chosen at
// run time with __builtin_cpu_supports. The passes share the kernel text; only the few vector
// primitives (load, convert, fma, exp, sums) differ: simd.h holds those the prefill kernel
// (prefill_attention.cpp, built into this extension and bound below) shares.

#ifndef PA_KERNEL_PASS

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "lse_merge.h"
#include "thread_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#define PA_X86 1
#include <immintrin.h>
#endif

#define PA_INLINE inline __attribute__((always_inline))

namespace pa {

constexpr int kHeadDims[2] = {64, 128};  // the compiled head sizes
constexpr int64_t kItemsPerThread = 8;     // splits aim at this many items per thread...
constexpr int64_t kMinSplitBlocks = 16;    // ...but a split covers at least this many list entries
constexpr int64_t kMaxSplits = 64;
constexpr int64_t kMaxQueries = 16;        // query rows per request (a verify step's drafts + 1)

enum class Elem : int { F32, BF16, F16, U8 };

// A tensor's base and first three strides in bytes: [heads, blocks, rows, ...] for caches,
// [heads, blocks, ...] for block parameters.
struct Strided {
  const char* data = nullptr;
  int64_t s0 = 0, s1 = 0, s2 = 0;
  Elem elem = Elem::F32;

  template <class T>
  const T* at(int64_t i, int64_t j, int64_t k = 0) const {
    return reinterpret_cast<const T*>(data + i * s0 + j * s1 + k * s2);
  }
};

// An int32 or int64 index tensor of up to three dimensions
struct Ints {
  const char* data = nullptr;
  int64_t s0 = 0, s1 = 0, s2 = 0;  // bytes
  bool wide = false;

  int64_t at(int64_t i, int64_t j = 0, int64_t k = 0) const {
    const char* p = data + i * s0 + j * s1 + k * s2;
    if (wide) return *reinterpret_cast<const int64_t*>(p);
    return *reinterpret_cast<const int32_t*>(p);
  }
};

// The int8 / int4 cache of one layer (quantized_kv_cache.py)
struct Quant {
  int bits = 0;             // 0: a full-precision cache (Problem::k, v)
  Strided kq, vq;           // [h, nb, bs, w] uint8
  Strided kmin, kmax;       // [h, nb, d] fp16
  Strided vscale, vzero;    // [h, nb, bs] fp16, tokens contiguous
  Ints stage_of;            // [nb]: -1 or the block's staging slot
  Strided stage_k, stage_v; // [h, slots, bs, d]
  int64_t slots = 0;
};

struct Problem {
  const float* q = nullptr;  // [b, n, H, d] fp32, contiguous (n = queries; [b, H, d] when 1)
  int64_t batch = 0, heads = 0, kv_heads = 0, group = 0, head_dim = 0, block_size = 0;
  // query rows per request: the last `queries` positions of its context, each attending causally
  // (row i sees len - queries + 1 + i keys); rows = queries * group share each (r, h) item
  int64_t queries = 1, rows = 0;
  int64_t num_blocks = 0, max_blocks = 0, num_selected = 0;
  float scale = 1.0f;
  Ints tables, lens, selected;  // [b, max_blocks], [b], sparse only: [b, kv_heads, n]
  bool sparse = false;
  Strided k, v;                 // [kv_heads, nb, bs, d] (bits == 0)
  Quant quant;
  std::vector<int64_t> len;     // context lengths clamped to [0, max_blocks * bs]
  std::vector<int64_t> shape;   // q's, the output's
};

// One unit of work: pair (r, h), entries [lo, hi) of its list; part: -1 writes the output, else
// the index of its partial (m [R], l [R], acc [R, d]; R = rows: queries x group)
struct Item {
  int64_t r, h, lo, hi, part;
};

// Where row (i, g) of pair (r, h) lies in q and out ([b, n, H, d]), i = row / G, g = row % G
inline int64_t row_offset(const Problem& p, int64_t r, int64_t h, int64_t row) {
  const int64_t i = row / p.group, g = row % p.group;
  return ((r * p.queries + i) * p.heads + h * p.group + g) * p.head_dim;
}

struct Merge {
  int64_t r, h, first, count;  // the pair's partials first .. first + count - 1
};

// A thread's scratch, in floats: q [G, d] (scaled), qs [G, d], qz [G], scores s [G, sb],
// m, l, alpha, zs [G], acc [G, d], key and value tiles [bs, d], a block's value scales and zeros
// [sb], and room for G * kMaxWidth dot vectors of kMaxWidth lanes (reduced kMaxWidth at a time)
constexpr int64_t kMaxWidth = 16;

struct Layout {
  int64_t sb, q, qs, qz, s, m, l, alpha, zs, acc, ktile, vtile, vsc, vzr, red, total;

  Layout(int64_t g, int64_t d, int64_t bs) {
    sb = (bs + kMaxWidth - 1) / kMaxWidth * kMaxWidth;  // a tile's scores are stored W at a time
    q = 0;
    qs = q + g * d;
    qz = qs + g * d;
    s = qz + g;
    m = s + g * sb;
    l = m + g;
    alpha = l + g;
    zs = alpha + g;
    acc = zs + g;
    ktile = acc + g * d;
    vtile = ktile + bs * d;
    vsc = vtile + bs * d;
    vzr = vsc + sb;
    red = vzr + sb;
    total = red + g * kMaxWidth * kMaxWidth;
  }
};

inline float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

inline float round_to_half(float x) {  // fp32 -> fp16 (round to nearest even) -> fp32, as .half()
  return c10::detail::fp16_ieee_to_fp32_value(c10::detail::fp16_ieee_from_fp32_value(x));
}

using ItemFn = void (*)(const Problem&, const Item&, float* scratch, float* out, float* parts);

// An ISA's item functions by head size (kHeadDims index) and bits (0: full precision, 4, 8)
struct Kernels {
  ItemFn fn[2][3];
};

}  // namespace pa

#define PA_KERNEL_PASS 1

#define PA_NS scalar
#define PA_WIDTH 1
#include __FILE__
#undef PA_NS
#undef PA_WIDTH

#ifdef PA_X86
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define PA_NS avx2
#define PA_WIDTH 8
#include __FILE__
#undef PA_NS
#undef PA_WIDTH
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#define PA_NS avx512
#define PA_WIDTH 16
#include __FILE__
#undef PA_NS
#undef PA_WIDTH
#pragma GCC pop_options
#endif

namespace pa {

// ---- ISA choice ------------------------------------------------------------------------------
// levels as Python's Isa enum: 1 scalar, 2 AVX2, 3 AVX-512

int64_t best_isa() {
#ifdef PA_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl")) {
    return 3;
  }
  if (avx2) return 2;
#endif
  return 1;
}

// The level a call runs: `isa` (0: the best), refused when this CPU cannot run it
int64_t isa_level(int64_t isa) {
  const int64_t best = best_isa();
  TORCH_CHECK_VALUE(isa >= 0 && isa <= best, "ISA level ", isa, " is not available here (best: ",
                    best, ")");
  return isa == 0 ? best : isa;
}

const Kernels& kernels(int64_t isa) {
  const int64_t level = isa_level(isa);
#ifdef PA_X86
  if (level == 3) return avx512::kKernels;
  if (level == 2) return avx2::kKernels;
#endif
  return scalar::kKernels;
}

ItemFn item_fn(const Kernels& k, int64_t head_dim, int bits) {
  const int di = head_dim == kHeadDims[0] ? 0 : 1;
  TORCH_CHECK_VALUE(head_dim == kHeadDims[di], "head_dim ", head_dim, " is not compiled (64, 128)");
  return k.fn[di][bits == 0 ? 0 : bits == 4 ? 1 : 2];
}

// ---- input views -----------------------------------------------------------------------------

Elem elem_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return Elem::F32;
    case at::kBFloat16: return Elem::BF16;
    case at::kHalf: return Elem::F16;
    case at::kByte: return Elem::U8;
    default: TORCH_CHECK_VALUE(false, "unsupported dtype ", t.scalar_type());
  }
  return Elem::F32;
}

Strided strided(const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.dim() >= 2, "expected a CPU tensor of 2+ dims");
  TORCH_CHECK_VALUE(t.size(-1) <= 1 || t.stride(-1) == 1, "the last dimension must be contiguous");
  Strided s;
  s.data = static_cast<const char*>(t.data_ptr());
  const int64_t e = static_cast<int64_t>(t.element_size());
  s.s0 = t.stride(0) * e;
  s.s1 = t.stride(1) * e;
  s.s2 = t.dim() > 2 ? t.stride(2) * e : 0;
  s.elem = elem_of(t);
  return s;
}

Ints ints(const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), "index tensors must be on the CPU");
  TORCH_CHECK_VALUE(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong,
                    "index tensors must be int32 or int64");
  Ints x;
  x.data = static_cast<const char*>(t.data_ptr());
  x.wide = t.scalar_type() == at::kLong;
  const int64_t e = x.wide ? 8 : 4;
  x.s0 = t.dim() > 0 ? t.stride(0) * e : 0;
  x.s1 = t.dim() > 1 ? t.stride(1) * e : 0;
  x.s2 = t.dim() > 2 ? t.stride(2) * e : 0;
  return x;
}

Problem problem(const at::Tensor& q, const at::Tensor& tables, const at::Tensor& lens, int64_t kv_heads,
                int64_t num_blocks, int64_t block_size, double scale) {
  TORCH_CHECK_VALUE(q.device().is_cpu() && q.scalar_type() == at::kFloat &&
                        (q.dim() == 3 || q.dim() == 4) && q.is_contiguous(),
                    "q must be a contiguous fp32 [b, H, d] or [b, n, H, d] CPU tensor");
  Problem p;
  const int64_t x = q.dim() - 3;  // 1 when q holds n query rows per request
  p.q = q.data_ptr<float>();
  p.shape = q.sizes().vec();
  p.batch = q.size(0);
  p.queries = x ? q.size(1) : 1;
  p.heads = q.size(1 + x);
  p.head_dim = q.size(2 + x);
  p.kv_heads = kv_heads;
  TORCH_CHECK_VALUE(kv_heads > 0 && p.heads % kv_heads == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK_VALUE(block_size > 0, "block_size must be positive");
  TORCH_CHECK_VALUE(p.queries >= 1 && p.queries <= kMaxQueries, "1 to ", kMaxQueries,
                    " query rows per request, got ", p.queries);
  p.group = p.heads / kv_heads;
  p.rows = p.queries * p.group;
  p.num_blocks = num_blocks;
  p.block_size = block_size;
  p.scale = static_cast<float>(scale);
  TORCH_CHECK_VALUE(tables.dim() == 2 && tables.size(0) == p.batch,
                    "block_tables must be [b, max_blocks]");
  TORCH_CHECK_VALUE(lens.dim() == 1 && lens.size(0) == p.batch, "context_lens must be [b]");
  p.tables = ints(tables);
  p.lens = ints(lens);
  p.max_blocks = tables.size(1);
  return p;
}

// ---- planning: lengths, block ids checked, the work cut into items ---------------------------

void check_block(const Problem& p, int64_t r, int64_t blk) {
  TORCH_CHECK_VALUE(blk >= 0 && blk < p.num_blocks, "request ", r, " names block ", blk,
                    ", outside the cache's ", p.num_blocks, " blocks");
  if (p.quant.bits != 0) {
    const int64_t slot = p.quant.stage_of.at(blk);
    TORCH_CHECK_VALUE(slot < p.quant.slots, "block ", blk, " is staged in slot ", slot, " of ",
                      p.quant.slots);
  }
}

// Clamps the lengths and checks every block id the kernel will read (no exception may leave
// the parallel region); returns per pair (r, h) its live list entries and its list length.
std::vector<std::pair<int64_t, int64_t>> prepare(Problem& p) {
  const int64_t bs = p.block_size;
  std::vector<std::pair<int64_t, int64_t>> units(p.batch * p.kv_heads, {0, 0});
  p.len.assign(p.batch, 0);
  for (int64_t r = 0; r < p.batch; ++r) {
    const int64_t n = std::clamp<int64_t>(p.lens.at(r), 0, p.max_blocks * bs);
    p.len[r] = n;
    if (!p.sparse) {
      const int64_t nblk = (n + bs - 1) / bs;
      for (int64_t j = 0; j < nblk; ++j) check_block(p, r, p.tables.at(r, j));
      for (int64_t h = 0; h < p.kv_heads; ++h) units[r * p.kv_heads + h] = {nblk, nblk};
      continue;
    }
    for (int64_t h = 0; h < p.kv_heads; ++h) {
      int64_t live = 0;
      for (int64_t e = 0; e < p.num_selected; ++e) {
        const int64_t pos = p.selected.at(r, h, e);
        if (pos < 0 || pos >= p.max_blocks || pos * bs >= n) continue;
        check_block(p, r, p.tables.at(r, pos));
        ++live;
      }
      units[r * p.kv_heads + h] = {live, p.num_selected};
    }
  }
  return units;
}

struct Plan {
  std::vector<Item> items;
  std::vector<Merge> merges;
  int64_t parts = 0;
};

constexpr int64_t kInlineBlocks = 192;  // 16-token blocks: ~1K tokens x 3 KV heads

Plan plan(const std::vector<std::pair<int64_t, int64_t>>& units, int64_t kv_heads, int64_t threads) {
  int64_t total = 0;
  for (const auto& u : units) total += u.first;
  int64_t chunk = std::numeric_limits<int64_t>::max();  // one thread: never split
  if (threads > 1) {
    const int64_t want = threads * kItemsPerThread;
    chunk = std::max(kMinSplitBlocks, (total + want - 1) / want);
  }
  Plan out;
  for (int64_t i = 0; i < static_cast<int64_t>(units.size()); ++i) {
    const auto [live, length] = units[i];
    if (live == 0) continue;  // the output stays 0
    const int64_t r = i / kv_heads, h = i % kv_heads;
    const int64_t splits = std::min({(live + chunk - 1) / chunk, kMaxSplits, length});
    if (splits <= 1) {
      out.items.push_back({r, h, 0, length, -1});
      continue;
    }
    const int64_t per = (length + splits - 1) / splits;
    const int64_t first = out.parts;
    for (int64_t lo = 0; lo < length; lo += per) {
      out.items.push_back({r, h, lo, std::min(length, lo + per), out.parts++});
    }
    out.merges.push_back({r, h, first, out.parts - first});
  }
  return out;
}

// out[r, i, h * G + g] from the pair's partials (lse_merge.h); a row nothing was live for stays 0
void merge(const Problem& p, const Plan& pl, const float* parts, float* out) {
  const int64_t g_n = p.rows, d = p.head_dim, stride = g_n * (d + 2);
  std::vector<float> w;
  for (const Merge& mg : pl.merges) {
    const float* first = parts + mg.first * stride;
    for (int64_t g = 0; g < g_n; ++g) {
      ctxfuse_merge::merge_row(first + g, first + g_n + g, first + 2 * g_n + g * d, stride, mg.count, d,
                               out + row_offset(p, mg.r, mg.h, g), w);
    }
  }
}

at::Tensor run(Problem& p, int64_t isa) {
  const ItemFn fn = item_fn(kernels(isa), p.head_dim, p.quant.bits);
  auto out = at::zeros(p.shape, at::kFloat);
  if (p.batch == 0 || p.heads == 0) return out;
  const auto units = prepare(p);
  int64_t blocks = 0;  // (request, KV head) blocks to read in all
  for (const auto& u : units) blocks += u.first;
  // a small step runs on the caller alone: waking a pool worker that has gone to sleep between two
  // layers (the weight kernels ran in between) costs more than the work (measured: 250 tokens x 3
  // KV heads, 12 us on one thread, ~35 us on two with a sleeping worker)
  const int64_t threads =
      blocks * p.queries < kInlineBlocks ? 1 : std::max(1, at::get_num_threads());
  const Plan pl = plan(units, p.kv_heads, threads);
  const int64_t n_items = static_cast<int64_t>(pl.items.size());
  std::vector<float> parts(pl.parts * p.rows * (p.head_dim + 2));
  const Layout lay(p.rows, p.head_dim, p.block_size);
  float* o = out.data_ptr<float>();
  const int nt = static_cast<int>(std::max<int64_t>(1, std::min(threads, n_items)));
  std::vector<std::vector<float>> scratch(nt);  // once per thread and call, never per token
  ctxfuse_pool::parallel_for(
      n_items, 1,
      [&](int64_t i0, int64_t i1, int t) {
        std::vector<float>& s = scratch[t];
        if (s.empty()) s.resize(lay.total);
        for (int64_t i = i0; i < i1; ++i) fn(p, pl.items[i], s.data(), o, parts.data());
      },
      nt);
  merge(p, pl, parts.data(), o);
  return out;
}

// ---- entry points ----------------------------------------------------------------------------
// The Python wrappers check every input and name it in their errors; the checks here only keep a
// direct call memory-safe.

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& tables, const at::Tensor& lens, double scale, int64_t isa) {
  TORCH_CHECK_VALUE(k.dim() == 4 && v.sizes() == k.sizes(), "caches must be [kv_heads, nb, bs, d]");
  Problem p = problem(q, tables, lens, k.size(0), k.size(1), k.size(2), scale);
  TORCH_CHECK_VALUE(k.size(3) == p.head_dim, "the caches' head dim differs from q's");
  p.k = strided(k);
  p.v = strided(v);
  TORCH_CHECK_VALUE(p.k.elem != Elem::U8 && p.v.elem != Elem::U8, "caches must be fp32, bf16 or fp16");
  return run(p, isa);
}

at::Tensor sparse_paged_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& tables, const at::Tensor& selected,
                               const at::Tensor& lens, double scale, int64_t isa) {
  TORCH_CHECK_VALUE(k.dim() == 4 && v.sizes() == k.sizes(), "caches must be [kv_heads, nb, bs, d]");
  Problem p = problem(q, tables, lens, k.size(0), k.size(1), k.size(2), scale);
  TORCH_CHECK_VALUE(k.size(3) == p.head_dim, "the caches' head dim differs from q's");
  TORCH_CHECK_VALUE(selected.dim() == 3 && selected.size(0) == p.batch && selected.size(1) == p.kv_heads,
                    "selected must be [b, kv_heads, n]");
  p.k = strided(k);
  p.v = strided(v);
  TORCH_CHECK_VALUE(p.k.elem != Elem::U8 && p.v.elem != Elem::U8, "caches must be fp32, bf16 or fp16");
  TORCH_CHECK_VALUE(p.queries == 1, "sparse decode takes one query row per request");
  p.sparse = true;
  p.selected = ints(selected);
  p.num_selected = selected.size(2);
  return run(p, isa);
}

at::Tensor paged_decode_quant(const at::Tensor& q, const at::Tensor& kq, const at::Tensor& vq,
                              const at::Tensor& kmin, const at::Tensor& kmax, const at::Tensor& vscale,
                              const at::Tensor& vzero, const at::Tensor& stage_of,
                              const at::Tensor& stage_k, const at::Tensor& stage_v,
                              const at::Tensor& tables, const at::Tensor& lens, double scale,
                              int64_t bits, int64_t isa, const c10::optional<at::Tensor>& selected) {
  TORCH_CHECK_VALUE(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK_VALUE(kq.dim() == 4 && vq.sizes() == kq.sizes() && kq.scalar_type() == at::kByte &&
                        vq.scalar_type() == at::kByte, "codes must be uint8 [kv_heads, nb, bs, w]");
  Problem p = problem(q, tables, lens, kq.size(0), kq.size(1), kq.size(2), scale);
  const int64_t h = p.kv_heads, nb = p.num_blocks, bs = p.block_size, d = p.head_dim;
  TORCH_CHECK_VALUE(kq.size(3) == (bits == 8 ? d : d / 2), "codes are not int", bits, " of ", d,
                    " channels");
  const std::vector<int64_t> param_shape{h, nb, d}, token_shape{h, nb, bs};
  const at::IntArrayRef params(param_shape), tokens(token_shape);
  for (const at::Tensor* t : {&kmin, &kmax}) {
    TORCH_CHECK_VALUE(t->sizes() == params && t->scalar_type() == at::kHalf,
                      "kmin, kmax: fp16 [h, nb, d]");
  }
  for (const at::Tensor* t : {&vscale, &vzero}) {
    TORCH_CHECK_VALUE(t->sizes() == tokens && t->scalar_type() == at::kHalf,
                      "vscale, vzero: fp16 [h, nb, bs]");
  }
  TORCH_CHECK_VALUE(stage_of.dim() == 1 && stage_of.size(0) == nb, "stage_of must be [num_blocks]");
  TORCH_CHECK_VALUE(stage_k.dim() == 4 && stage_v.sizes() == stage_k.sizes() && stage_k.size(0) == h &&
                        stage_k.size(2) == bs && stage_k.size(3) == d,
                    "stage_k, stage_v must be [kv_heads, slots, bs, d]");
  Quant& qt = p.quant;
  qt.bits = static_cast<int>(bits);
  qt.kq = strided(kq);
  qt.vq = strided(vq);
  qt.kmin = strided(kmin);
  qt.kmax = strided(kmax);
  qt.vscale = strided(vscale);
  qt.vzero = strided(vzero);
  qt.stage_of = ints(stage_of);
  qt.stage_k = strided(stage_k);
  qt.stage_v = strided(stage_v);
  qt.slots = stage_k.size(1);
  TORCH_CHECK_VALUE(qt.stage_k.elem != Elem::U8 && qt.stage_v.elem != Elem::U8,
                    "staging must be fp32, bf16 or fp16");
  if (selected.has_value()) {  // block-sparse over the codes: only the selected positions are read
    const at::Tensor& sel = *selected;
    TORCH_CHECK_VALUE(sel.dim() == 3 && sel.size(0) == p.batch && sel.size(1) == p.kv_heads,
                      "selected must be [b, kv_heads, n]");
    TORCH_CHECK_VALUE(p.queries == 1, "sparse decode takes one query row per request");
    p.sparse = true;
    p.selected = ints(sel);
    p.num_selected = sel.size(2);
  }
  return run(p, isa);
}

}  // namespace pa

namespace pf {  // prefill_attention.cpp
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& table, int64_t start, double scale,
                             c10::optional<at::Tensor> out, int64_t isa);
}  // namespace pf

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  // the GIL is released while a kernel runs: the serving loop's Python thread goes on meanwhile
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  mod.def("paged_decode", &pa::paged_decode, "dense paged decode attention -> [b, H, d] fp32", nogil);
  mod.def("paged_decode_quant", &pa::paged_decode_quant,
          "int8 / int4 paged decode, dense or over selected blocks -> [b, H, d] fp32", nogil);
  mod.def("sparse_paged_decode", &pa::sparse_paged_decode,
          "block-sparse paged decode -> [b, H, d] fp32", nogil);
  mod.def("prefill_attention", &pf::prefill_attention,
          "causal prefill attention over the paged fp32 cache -> [n, H, d] fp32", nogil);
  mod.def("best_isa", &pa::best_isa, "1 scalar, 2 AVX2, 3 AVX-512: the best this CPU runs");
}

#else  // PA_KERNEL_PASS ------------------------------------------------------------------------
// The kernel, compiled once per ISA: namespace pa::PA_NS, vectors V of W = PA_WIDTH floats.

namespace pa::PA_NS {

constexpr int W = PA_WIDTH;

#define CTXFUSE_SIMD_WIDTH PA_WIDTH
#include "simd.h"
#undef CTXFUSE_SIMD_WIDTH

// the decode kernel's own primitives
#if PA_WIDTH == 16
// 128-bit blocks [a0 + a1, a2 + a3, b0 + b1, b2 + b3]
inline V add_block_pairs(V a, V b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
// 16 vectors at v, v + 16, ...: lane i of the result is the sum of vector i (a transpose-add tree)
inline V vsum_lanes(const float* v) {
  V u[8], w[4];
  for (int k = 0; k < 8; ++k) {  // per 128-bit block: [a0+a2, b0+b2, a1+a3, b1+b3]
    const V a = vload(v + 32 * k), b = vload(v + 32 * k + 16);
    u[k] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int k = 0; k < 4; ++k) {  // per 128-bit block: vectors 4k .. 4k + 3, that block's sums
    const __m512d a = _mm512_castps_pd(u[2 * k]), b = _mm512_castps_pd(u[2 * k + 1]);
    w[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  return add_block_pairs(add_block_pairs(w[0], w[1]), add_block_pairs(w[2], w[3]));
}
inline V vbf16(const uint16_t* p) {  // bf16 is the top half of an fp32
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline V vf16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline V bytes_to_v(__m128i x) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(x)); }
inline V vu8(const uint8_t* p) {
  return bytes_to_v(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void vu4(const uint8_t* p, V& a, V& b) {  // 16 bytes: channels 0-15 into a, 16-31 into b
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i nib = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(x, nib), hi = _mm_and_si128(_mm_srli_epi16(x, 4), nib);
  a = bytes_to_v(_mm_unpacklo_epi8(lo, hi));  // even channel (low nibble) first
  b = bytes_to_v(_mm_unpackhi_epi8(lo, hi));
}
inline V vstep(V lo, V hi, float levels) {  // kv_quant.key_scale
  V s = _mm512_div_ps(_mm512_sub_ps(hi, lo), vset(levels));
  s = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(s, vzero(), _CMP_GT_OQ), vset(1.0f), s);
  return _mm512_cvtph_ps(_mm512_cvtps_ph(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

#elif PA_WIDTH == 8
// 8 vectors at v, v + 8, ...: lane i of the result is the sum of vector i
inline V vsum_lanes(const float* v) {
  const V s01 = _mm256_hadd_ps(vload(v), vload(v + 8));
  const V s23 = _mm256_hadd_ps(vload(v + 16), vload(v + 24));
  const V s45 = _mm256_hadd_ps(vload(v + 32), vload(v + 40));
  const V s67 = _mm256_hadd_ps(vload(v + 48), vload(v + 56));
  const V lo = _mm256_hadd_ps(s01, s23), hi = _mm256_hadd_ps(s45, s67);  // per 128-bit half: 4 sums
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}
inline V vbf16(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline V vf16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline V bytes_to_v(__m128i x) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(x)); }
inline V vu8(const uint8_t* p) {
  return bytes_to_v(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline void vu4(const uint8_t* p, V& a, V& b) {  // 8 bytes: channels 0-7 into a, 8-15 into b
  const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i nib = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(x, nib), hi = _mm_and_si128(_mm_srli_epi16(x, 4), nib);
  const __m128i c = _mm_unpacklo_epi8(lo, hi);  // even channel (low nibble) first
  a = bytes_to_v(c);
  b = bytes_to_v(_mm_srli_si128(c, 8));
}
inline V vstep(V lo, V hi, float levels) {  // kv_quant.key_scale
  V s = _mm256_div_ps(_mm256_sub_ps(hi, lo), vset(levels));
  s = _mm256_blendv_ps(vset(1.0f), s, _mm256_cmp_ps(s, vzero(), _CMP_GT_OQ));
  return _mm256_cvtph_ps(_mm256_cvtps_ph(s, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

#else  // plain C++
inline V vsum_lanes(const float* v) { return *v; }
inline V vbf16(const uint16_t* p) {
  const uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline V vf16(const uint16_t* p) { return half_to_float(*p); }
inline V vu8(const uint8_t* p) { return static_cast<float>(*p); }
inline void vu4(const uint8_t* p, V& a, V& b) {
  a = static_cast<float>(*p & 15);
  b = static_cast<float>(*p >> 4);
}
inline V vstep(V lo, V hi, float levels) {
  const float s = (hi - lo) / levels;
  return round_to_half(s > 0.0f ? s : 1.0f);
}
#endif

// One thread's scratch, carved by pa::Layout
struct Scratch {
  float *q, *qs, *qz, *s, *m, *l, *alpha, *zs, *acc, *ktile, *vtile, *vsc, *vzr, *red;
  int64_t sb;
  // causal rows (queries > 1): row (i, g) sees the block's first vis0 + i tokens; rows are i-major
  // in groups of `group`. vis0 >= the block's T: nothing masked (always so for one query row)
  int64_t vis0 = std::numeric_limits<int64_t>::max(), group = 1;

  Scratch(float* base, const Layout& lay)
      : q(base + lay.q), qs(base + lay.qs), qz(base + lay.qz), s(base + lay.s), m(base + lay.m),
        l(base + lay.l), alpha(base + lay.alpha), zs(base + lay.zs), acc(base + lay.acc),
        ktile(base + lay.ktile), vtile(base + lay.vtile), vsc(base + lay.vsc), vzr(base + lay.vzr),
        red(base + lay.red), sb(lay.sb) {}
};

// T rows of a block as fp32: the cache rows themselves (fp32) or converted into `tile` [T, D];
// returns the rows and sets their stride in floats
template <int D>
const float* rows_f32(const Strided& src, int64_t h, int64_t blk, int64_t T, float* tile,
                      int64_t& stride) {
  if (src.elem == Elem::F32) {
    stride = src.s2 / static_cast<int64_t>(sizeof(float));
    return src.at<float>(h, blk);
  }
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* row = src.at<uint16_t>(h, blk, t);
    float* o = tile + t * D;
    if (src.elem == Elem::BF16) {
      for (int i = 0; i < D; i += W) vstore(o + i, vbf16(row + i));
    } else {
      for (int i = 0; i < D; i += W) vstore(o + i, vf16(row + i));
    }
  }
  stride = D;
  return tile;
}

// codes of one token -> D fp32 values in channel order
template <int D, int BITS>
inline void unpack(const uint8_t* c, V* r) {
  if constexpr (BITS == 8) {
    for (int i = 0; i < D / W; ++i) r[i] = vu8(c + i * W);
  } else {
    for (int i = 0; i < D / W / 2; ++i) vu4(c + i * W, r[2 * i], r[2 * i + 1]);
  }
}

// One key row as D fp32 values: rows of floats (BITS 0, stride in floats) or of codes (bytes)
template <int D, int BITS>
inline void key_row(const void* rows, int64_t stride, int64_t t, V* r) {
  if constexpr (BITS == 0) {
    const float* k = static_cast<const float*>(rows) + t * stride;
    for (int i = 0; i < D / W; ++i) r[i] = vload(k + i * W);
  } else {
    unpack<D, BITS>(static_cast<const uint8_t*>(rows) + t * stride, r);
  }
}

// s[g, t] = q_g . k_t (+ qz_g for codes) for T rows; qv: the queries the rows are dotted with.
// W rows at a time: each row's G dot vectors are parked in S.red, then reduced W to a vector.
template <int D, int BITS>
void score_tile(const void* rows, int64_t stride, int64_t T, int64_t G, const float* qv, Scratch& S) {
  constexpr int NV = D / W;
  for (int64_t t0 = 0; t0 < T; t0 += W) {
    const int64_t n = std::min<int64_t>(W, T - t0);
    for (int64_t j = 0; j < W; ++j) {
      if (j >= n) {  // past the tile: zero dots, their scores are never read
        for (int64_t g = 0; g < G; ++g) vstore(S.red + (g * W + j) * W, vzero());
        continue;
      }
      V kr[NV];
      key_row<D, BITS>(rows, stride, t0 + j, kr);
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qv + g * D;
        V a = vmul(kr[0], vload(qg));
        for (int i = 1; i < NV; ++i) a = vfma(kr[i], vload(qg + i * W), a);
        vstore(S.red + (g * W + j) * W, a);
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      V r = vsum_lanes(S.red + g * W * W);
      if constexpr (BITS != 0) r = r + vset(S.qz[g]);
      vstore(S.s + g * S.sb + t0, r);
    }
  }
}

// A block's key parameters folded into the queries: qs_g = q_g * step, qz_g = q_g . kmin
template <int D>
void fold_keys(const uint16_t* kmin, const uint16_t* kmax, float levels, int64_t G, Scratch& S) {
  float lo[D], step[D];
  for (int i = 0; i < D; i += W) {
    const V a = vf16(kmin + i);
    vstore(lo + i, a);
    vstore(step + i, vstep(a, vf16(kmax + i), levels));
  }
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = S.q + g * D;
    V z = vzero();
    for (int i = 0; i < D; i += W) {
      const V x = vload(qg + i);
      vstore(S.qs + g * D + i, vmul(x, vload(step + i)));
      z = vfma(x, vload(lo + i), z);
    }
    S.qz[g] = vsum(z);
  }
}

// Scores of keys a row may not see yet become -inf (causal rows of a multi-query item)
void mask_tile(int64_t T, int64_t G, Scratch& S) {
  constexpr float ninf = -std::numeric_limits<float>::infinity();
  for (int64_t g = 0; g < G; ++g) {
    const int64_t vis = std::clamp<int64_t>(S.vis0 + g / S.group, 0, T);
    std::fill(S.s + g * S.sb + vis, S.s + g * S.sb + T, ninf);
  }
}

// Online softmax over a tile's scores: s becomes p = exp(s - m_new); alpha = exp(m_old - m_new).
// A row that sees none of the tile's keys and none before (a causal row's first keys lie further
// on) keeps m = -inf and l = 0, its weights 0.
void softmax_tile(int64_t T, int64_t G, Scratch& S) {
  if (S.vis0 < T) mask_tile(T, G, S);
  for (int64_t g = 0; g < G; ++g) {
    float* sg = S.s + g * S.sb;
    V vtop = vset(sg[0]);
    int64_t t = 0;
    for (; t + W <= T; t += W) vtop = vmax(vtop, vload(sg + t));
    float top = vhmax(vtop);
    for (; t < T; ++t) top = std::max(top, sg[t]);
    const float m_new = std::max(S.m[g], top);
    if (m_new == -std::numeric_limits<float>::infinity()) {  // a causal row sees nothing yet
      std::fill(sg, sg + T, 0.0f);
      S.alpha[g] = 1.0f;
      continue;
    }
    const V mv = vset(m_new);
    V sum = vzero();
    for (t = 0; t + W <= T; t += W) {
      const V e = vexp(vload(sg + t) - mv);
      vstore(sg + t, e);
      sum = sum + e;
    }
    float tail = 0.0f;
    for (; t < T; ++t) {
      sg[t] = std::exp(sg[t] - m_new);
      tail += sg[t];
    }
    S.alpha[g] = std::exp(S.m[g] - m_new);  // m_old = -inf: 0
    S.l[g] = S.l[g] * S.alpha[g] + vsum(sum) + tail;
    S.m[g] = m_new;
  }
}

// acc_g = alpha_g * acc_g + sum_t w[g, t] * v_t (+ bias_g) for T rows v (stride vs floats), the
// weights w in S.s. Two tokens at a time into separate sums: 2 * CH independent FMA chains.
template <int D>
void accumulate(const float* v, int64_t vs, int64_t T, int64_t G, const float* bias, Scratch& S) {
  constexpr int NV = D / W;
  constexpr int CH = NV < 4 ? NV : 4;  // accumulator vectors per pass over the rows
  for (int64_t g = 0; g < G; ++g) {
    const float* w = S.s + g * S.sb;
    float* acc = S.acc + g * D;
    const V al = vset(S.alpha[g]), b = vset(bias != nullptr ? bias[g] : 0.0f);
    for (int c0 = 0; c0 < NV; c0 += CH) {
      V a[CH], e[CH];
      for (int i = 0; i < CH; ++i) {
        a[i] = vmul(vload(acc + (c0 + i) * W), al);
        e[i] = vzero();
      }
      int64_t t = 0;
      for (; t + 1 < T; t += 2) {
        const V w0 = vset(w[t]), w1 = vset(w[t + 1]);
        const float* r0 = v + t * vs + c0 * W;
        const float* r1 = r0 + vs;
        for (int i = 0; i < CH; ++i) {
          a[i] = vfma(w0, vload(r0 + i * W), a[i]);
          e[i] = vfma(w1, vload(r1 + i * W), e[i]);
        }
      }
      if (t < T) {
        const V w0 = vset(w[t]);
        for (int i = 0; i < CH; ++i) a[i] = vfma(w0, vload(v + t * vs + (c0 + i) * W), a[i]);
      }
      for (int i = 0; i < CH; ++i) vstore(acc + (c0 + i) * W, a[i] + e[i] + b);
    }
  }
}

// Values of a quantized block: v_t = vzero_t + code_t * vscale_t, so
//   sum_t p_t v_t = sum_t (p_t vscale_t) code_t + sum_t p_t vzero_t:
// the weights p become p * vscale in place, zs_g = sum_t p_t vzero_t, and the tile holds the codes
template <int D, int BITS>
void prepare_values(const uint8_t* c, int64_t cs, const uint16_t* scale, const uint16_t* zero, int64_t T,
                    int64_t G, Scratch& S) {
  constexpr int NV = D / W;
  int64_t t = 0;
  for (; t + W <= T; t += W) {
    vstore(S.vsc + t, vf16(scale + t));
    vstore(S.vzr + t, vf16(zero + t));
  }
  for (; t < T; ++t) {  // never past the block's own parameters
    S.vsc[t] = half_to_float(scale[t]);
    S.vzr[t] = half_to_float(zero[t]);
  }
  for (int64_t g = 0; g < G; ++g) {
    float* p = S.s + g * S.sb;
    V z = vzero();
    for (t = 0; t + W <= T; t += W) {
      const V pv = vload(p + t);
      z = vfma(pv, vload(S.vzr + t), z);
      vstore(p + t, vmul(pv, vload(S.vsc + t)));
    }
    float zt = vsum(z);
    for (; t < T; ++t) {
      zt += p[t] * S.vzr[t];
      p[t] *= S.vsc[t];
    }
    S.zs[g] = zt;
  }
  for (t = 0; t < T; ++t) {
    V r[NV];
    unpack<D, BITS>(c + t * cs, r);
    for (int i = 0; i < NV; ++i) vstore(S.vtile + t * D + i * W, r[i]);
  }
}

// T live tokens of full-precision rows (a dense block, or a quantized cache's staged block)
template <int D>
void attend_rows(const Strided& K, const Strided& Vc, int64_t h, int64_t blk, int64_t T, int64_t G,
                 Scratch& S) {
  int64_t ks = 0, vs = 0;
  const float* k = rows_f32<D>(K, h, blk, T, S.ktile, ks);
  score_tile<D, 0>(k, ks, T, G, S.q, S);
  softmax_tile(T, G, S);
  const float* v = rows_f32<D>(Vc, h, blk, T, S.vtile, vs);
  accumulate<D>(v, vs, T, G, nullptr, S);
}

template <int D, int BITS>
void attend_codes(const Quant& qt, int64_t h, int64_t blk, int64_t T, int64_t G, Scratch& S) {
  constexpr float levels = static_cast<float>((1 << BITS) - 1);
  fold_keys<D>(qt.kmin.at<uint16_t>(h, blk), qt.kmax.at<uint16_t>(h, blk), levels, G, S);
  score_tile<D, BITS>(qt.kq.at<uint8_t>(h, blk), qt.kq.s2, T, G, S.qs, S);
  softmax_tile(T, G, S);
  prepare_values<D, BITS>(qt.vq.at<uint8_t>(h, blk), qt.vq.s2, qt.vscale.at<uint16_t>(h, blk),
                          qt.vzero.at<uint16_t>(h, blk), T, G, S);
  accumulate<D>(S.vtile, D, T, G, S.zs, S);
}

// The first live entry at or after e of the item's list: its block id, live tokens T and the
// position of its first token
bool live_entry(const Problem& p, const Item& it, int64_t& e, int64_t& blk, int64_t& T, int64_t& at) {
  for (; e < it.hi; ++e) {
    const int64_t pos = p.sparse ? p.selected.at(it.r, it.h, e) : e;
    if (pos < 0 || pos >= p.max_blocks) continue;
    at = pos * p.block_size;
    T = std::min(p.block_size, p.len[it.r] - at);
    if (T <= 0) continue;
    blk = p.tables.at(it.r, pos);
    return true;
  }
  return false;
}

// Asks for `rows` rows of `bytes` (stride apart) to be brought into the cache: blocks lie at
// random in memory, so the hardware prefetchers cannot see the next one coming. Always inlined
// (PA_INLINE): GCC counts a prefetch as no side effect and drops calls to functions that only
// prefetch.
PA_INLINE void prefetch_rows(const char* base, int64_t rows, int64_t stride, int64_t bytes) {
  if (stride == bytes) {
    bytes *= rows;
    rows = 1;
  }
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(base + t * stride + o);
  }
}

PA_INLINE void prefetch_tile(const Strided& x, int64_t h, int64_t b, int64_t rows, int64_t bytes) {
  prefetch_rows(x.at<char>(h, b), rows, x.s2, bytes);
}

PA_INLINE int64_t row_bytes(const Strided& x, int64_t d) { return d * (x.elem == Elem::F32 ? 4 : 2); }

template <int D, int BITS>
PA_INLINE void prefetch_block(const Problem& p, int64_t h, int64_t blk) {
  const int64_t bs = p.block_size;
  if constexpr (BITS == 0) {
    prefetch_tile(p.k, h, blk, bs, row_bytes(p.k, D));
    prefetch_tile(p.v, h, blk, bs, row_bytes(p.v, D));
  } else {
    const Quant& qt = p.quant;
    const int64_t slot = qt.stage_of.at(blk);
    if (slot >= 0) {
      prefetch_tile(qt.stage_k, h, slot, bs, row_bytes(qt.stage_k, D));
      prefetch_tile(qt.stage_v, h, slot, bs, row_bytes(qt.stage_v, D));
      return;
    }
    prefetch_tile(qt.kq, h, blk, bs, D * BITS / 8);
    prefetch_tile(qt.vq, h, blk, bs, D * BITS / 8);
    prefetch_rows(qt.kmin.at<char>(h, blk), 1, 0, 2 * D);
    prefetch_rows(qt.kmax.at<char>(h, blk), 1, 0, 2 * D);
    prefetch_rows(qt.vscale.at<char>(h, blk), 1, 0, 2 * bs);
    prefetch_rows(qt.vzero.at<char>(h, blk), 1, 0, 2 * bs);
  }
}

template <int D, int BITS>
void attend_block(const Problem& p, int64_t h, int64_t blk, int64_t T, Scratch& S) {
  const int64_t R = p.rows;
  if constexpr (BITS == 0) {
    attend_rows<D>(p.k, p.v, h, blk, T, R, S);
  } else {
    const int64_t slot = p.quant.stage_of.at(blk);
    if (slot >= 0) {
      attend_rows<D>(p.quant.stage_k, p.quant.stage_v, h, slot, T, R, S);
    } else {
      attend_codes<D, BITS>(p.quant, h, blk, T, R, S);
    }
  }
}

template <int D, int BITS>
void run_item(const Problem& p, const Item& it, float* scratch, float* out, float* parts) {
  const int64_t G = p.rows;  // the item's query rows: queries x group, each with its own softmax
  Scratch S(scratch, Layout(G, D, p.block_size));
  S.group = p.group;
  for (int64_t g = 0; g < G; ++g) {
    const float* q = p.q + row_offset(p, it.r, it.h, g);
    for (int64_t c = 0; c < D; ++c) S.q[g * D + c] = q[c] * p.scale;
    S.m[g] = -std::numeric_limits<float>::infinity();
    S.l[g] = 0.0f;
  }
  std::fill(S.acc, S.acc + G * D, 0.0f);
  // row 0 of n sees keys before position len - n + 1; one query row sees the whole context
  const int64_t first_limit = p.len[it.r] - p.queries + 1;
  int64_t e = it.lo, blk = 0, T = 0, at = 0;
  bool live = live_entry(p, it, e, blk, T, at);
  while (live) {  // one block ahead: its rows are fetched while this one computes
    int64_t e_next = e + 1, blk_next = 0, T_next = 0, at_next = 0;
    const bool more = live_entry(p, it, e_next, blk_next, T_next, at_next);
    if (more) prefetch_block<D, BITS>(p, it.h, blk_next);
    S.vis0 = first_limit - at;
    attend_block<D, BITS>(p, it.h, blk, T, S);
    e = e_next;
    blk = blk_next;
    T = T_next;
    at = at_next;
    live = more;
  }
  if (it.part < 0) {
    for (int64_t g = 0; g < G; ++g) {
      float* o = out + row_offset(p, it.r, it.h, g);
      const float inv = S.l[g] > 0.0f ? 1.0f / S.l[g] : 0.0f;
      for (int64_t c = 0; c < D; ++c) o[c] = S.acc[g * D + c] * inv;
    }
    return;
  }
  float* part = parts + it.part * G * (D + 2);
  std::copy(S.m, S.m + G, part);
  std::copy(S.l, S.l + G, part + G);
  std::copy(S.acc, S.acc + G * D, part + 2 * G);
}

constexpr Kernels kKernels{{
    {run_item<64, 0>, run_item<64, 4>, run_item<64, 8>},
    {run_item<128, 0>, run_item<128, 4>, run_item<128, 8>},
}};

}  // namespace pa::PA_NS

#endif  // PA_KERNEL_PASS
