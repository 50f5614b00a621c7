// y[m, n] = x[m, k] @ W[n, k]^T where W stays in the GGUF file's own blocks (Q4_0, Q4_1, Q8_0: 32
// weights a block, an fp16 scale d, Q4_1 also an fp16 offset m) and x, y and every sum are fp32.
//
// Invariant: the result is that of F.linear(x, dequantize(W)) (gguf.quants.dequantize: w = d * q, or
// (d * q) + m with two roundings) up to the order of fp32 roundings. Every path but one multiplies x
// by exactly those fp32 weights; the AVX2 GEMV takes d (and m) out of each block's dot product,
// d * sum(q x) + m * sum(x), the same real sum (see there). Activations are never quantized.
//
// Two paths, chosen by m:
//   GEMV (m <= kGemvMaxRows, decode). Grid: the n output rows split among the threads. For each of
//     its rows a thread unpacks a block's 32 weights in registers and dots them with up to
//     kGemvGroup rows of x. Reads each weight byte once per kGemvGroup rows of x, and all of x
//     (L1/L2-resident) once per output row.
//   Tiled (m > kGemvMaxRows, prefill). Grid: tiles of `tile` output rows split among the threads.
//     A thread dequantizes a tile [tile, k] into its fp32 scratch (the whole fp32 matrix never
//     exists), then, one k-chunk (<= kChunk) at a time, sweeps x in groups of kMR rows against it
//     with a register-blocked kMR x NR micro-kernel (NR: 4 with AVX-512, 3 with AVX2) of dot
//     products along k. The tile's chunk (about kTileBytes) stays in L1 while all of x streams by;
//     each weight byte is read and unpacked once a call.
//
// ISA: one portable build (no -march). The inner routines exist three times, for AVX-512 (F, BW,
// VL), AVX2 and plain C++, each compiled for its ISA by `#pragma GCC target` (the mechanism of
// __attribute__((target))) inside its own namespace, so no symbol is shared between ISAs. The widest
// that the CPU and OS support is chosen once, at load, with __builtin_cpu_supports. In the SIMD
// regions fp-contract is off: a * b + c is two roundings as in numpy, and FMA only where written.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "thread_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#define CTXFUSE_X86 1
#include <immintrin.h>
#endif

namespace {

// Measured on a 2-core Zen 5 (AVX-512 and AVX2 paths) with SmolLM2-135M's shapes: the tiled path
// overtakes the GEMV from m = 5-8; a 32 KiB tile chunk and k-chunks of at most 640 (k = 576 in one
// pass, 1536 in three of 512) were the fastest of those tried.
constexpr int64_t kBlock = 32;            // weights a block, every format
constexpr int64_t kGemvMaxRows = 4;       // m at or below: the GEMV path
constexpr int kGemvGroup = 4;             // rows of x dotted with one unpacked block
constexpr int64_t kChunksPerThread = 4;  // GEMV chunks handed out per thread (dynamically)
constexpr int64_t kGemvGrain = 16;        // output rows a chunk holds at least
// After a GEMV the pool's workers spin this long for the next before they sleep: a decode step at one
// stream makes ~120 such calls with a little Python between, and waking a sleeping worker cost more
// than the spin (in-process step median 6.0-7.1 -> 5.8-6.8 ms). Only after a GEMV: at 32 streams the
// attention and norm kernels' own pools run between the weight calls and a spinning worker slowed
// them (step 55 -> 57 ms with every region at 100 us).
constexpr int64_t kGemvLingerNs = 100000;
constexpr int kMR = 4;                    // rows of x in the tiled micro-kernel
constexpr int64_t kTileBytes = 32 << 10;  // a tile's fp32 weights over one k-chunk (L1-sized)
constexpr int64_t kChunk = 640;           // k at most, a pass of the micro-kernel
constexpr int64_t kXRows = 128;           // rows of x a pass over the tiles (128 x 640 x 4: 320 KiB)

// The codes Python passes (kernels/cpu/gguf_matmul.py: _FORMATS)
enum class QType : int64_t { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };

constexpr int64_t block_bytes(QType t) {
  return t == QType::Q4_0 ? 18 : t == QType::Q4_1 ? 20 : 34;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// The routines of one ISA (per-QType entries indexed by QType, gemv also by rows of x - 1):
//   dequant: blocks [rows, row_bytes] -> out [rows, nb * 32] fp32, the reference's weights.
//   gemv<M>: out[r, i] = x[r, :] . W[i, :] for r < M, i in [n0, n1); x [M, ldx], out [M, ldo].
//   tile: out[r, j] (+)= x[r, :kc] . w[j, :kc] for r < mr, j < nr (<= kMR, nr_max), adding to out
//     when `add`; x rows r >= mr are not read; w must hold nr_max rows (the rest are ignored).
using DequantFn = void (*)(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t nb, float* out);
using GemvFn = void (*)(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t n0, int64_t n1,
                        const float* x, int64_t ldx, float* out, int64_t ldo);
using TileFn = void (*)(const float* x, int64_t ldx, int mr, const float* w, int64_t ldw, int64_t kc,
                        float* out, int64_t ldo, int nr, bool add);

struct Kernels {
  const char* name;
  DequantFn dequant[3];
  GemvFn gemv[3][kGemvGroup];
  TileFn tile;
  int nr_max;  // rows of w in the micro-kernel
};

// The table of a namespace that defines dequant_t<T>, gemv_t<T, M>, tile_kernel and kNR
#define CTXFUSE_KERNELS(NAME)                                                                    \
  Kernels {                                                                                      \
    NAME, {dequant_t<QType::Q4_0>, dequant_t<QType::Q4_1>, dequant_t<QType::Q8_0>},              \
        {                                                                                        \
            {gemv_t<QType::Q4_0, 1>, gemv_t<QType::Q4_0, 2>, gemv_t<QType::Q4_0, 3>,             \
             gemv_t<QType::Q4_0, 4>},                                                            \
            {gemv_t<QType::Q4_1, 1>, gemv_t<QType::Q4_1, 2>, gemv_t<QType::Q4_1, 3>,             \
             gemv_t<QType::Q4_1, 4>},                                                            \
            {gemv_t<QType::Q8_0, 1>, gemv_t<QType::Q8_0, 2>, gemv_t<QType::Q8_0, 3>,             \
             gemv_t<QType::Q8_0, 4>},                                                            \
        },                                                                                       \
        tile_kernel, kNR                                                                         \
  }

// ---------------------------------------------------------------------------------------------------
// Plain C++ (any CPU), one weight at a time.
namespace scalar {

constexpr int kNR = 4;

// the 32 fp32 weights of one block
template <QType T>
inline void decode(const uint8_t* blk, float w[kBlock]) {
  const float d = c10::detail::fp16_ieee_to_fp32_value(load_u16(blk));
  if constexpr (T == QType::Q8_0) {
    for (int j = 0; j < 32; ++j) w[j] = static_cast<float>(static_cast<int8_t>(blk[2 + j])) * d;
  } else if constexpr (T == QType::Q4_0) {
    for (int j = 0; j < 16; ++j) {
      w[j] = static_cast<float>((blk[2 + j] & 0xF) - 8) * d;
      w[j + 16] = static_cast<float>((blk[2 + j] >> 4) - 8) * d;
    }
  } else {
    const float m = c10::detail::fp16_ieee_to_fp32_value(load_u16(blk + 2));
    for (int j = 0; j < 16; ++j) {
      w[j] = static_cast<float>(blk[4 + j] & 0xF) * d + m;
      w[j + 16] = static_cast<float>(blk[4 + j] >> 4) * d + m;
    }
  }
}

template <QType T>
void dequant_t(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t nb, float* out) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      decode<T>(w + i * row_bytes + b * block_bytes(T), out + (i * nb + b) * kBlock);
    }
  }
}

template <QType T, int M>
void gemv_t(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t n0, int64_t n1, const float* x,
            int64_t ldx, float* out, int64_t ldo) {
  float wb[kBlock];
  for (int64_t i = n0; i < n1; ++i) {
    float acc[M] = {};
    for (int64_t b = 0; b < nb; ++b) {
      decode<T>(w + i * row_bytes + b * block_bytes(T), wb);
      for (int r = 0; r < M; ++r) {
        const float* xb = x + r * ldx + b * kBlock;
        for (int j = 0; j < 32; ++j) acc[r] += wb[j] * xb[j];
      }
    }
    for (int r = 0; r < M; ++r) out[r * ldo + i] = acc[r];
  }
}

void tile_kernel(const float* x, int64_t ldx, int mr, const float* w, int64_t ldw, int64_t kc, float* out,
                 int64_t ldo, int nr, bool add) {
  for (int r = 0; r < mr; ++r) {
    for (int j = 0; j < nr; ++j) {
      float acc = 0.0f;
      for (int64_t c = 0; c < kc; ++c) acc += x[r * ldx + c] * w[j * ldw + c];
      out[r * ldo + j] = add ? out[r * ldo + j] + acc : acc;
    }
  }
}

constexpr Kernels kKernels = CTXFUSE_KERNELS("scalar");

}  // namespace scalar

#ifdef CTXFUSE_X86
// ---------------------------------------------------------------------------------------------------
// AVX2 + FMA + F16C: a block is 4 vectors of 8 weights.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
namespace avx2 {

constexpr int kNR = 3;  // 4 x 3 accumulators + 3 + 1 operands: the 16 ymm registers

struct Block {
  __m256 w[4];  // weights 0-7, 8-15, 16-23, 24-31
};

template <QType T>
inline void codes(const uint8_t* blk, __m256 q[4]);

template <QType T>
inline Block decode(const uint8_t* blk) {
  Block k;
  __m256 q[4];  // the codes as fp32 (Q4_0's minus 8)
  codes<T>(blk, q);
  if constexpr (T == QType::Q4_1) {
    uint32_t dm;
    std::memcpy(&dm, blk, 4);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));  // [d, m, 0, 0]
    const __m256 d = _mm256_broadcastss_ps(f), m = _mm256_broadcastss_ps(_mm_movehdup_ps(f));
    for (int v = 0; v < 4; ++v) k.w[v] = _mm256_add_ps(_mm256_mul_ps(q[v], d), m);
  } else {
    const __m256 d = _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(load_u16(blk))));
    for (int v = 0; v < 4; ++v) k.w[v] = _mm256_mul_ps(q[v], d);
  }
  return k;
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <QType T>
void dequant_t(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t nb, float* out) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      const Block k = decode<T>(w + i * row_bytes + b * block_bytes(T));
      float* o = out + (i * nb + b) * kBlock;
      for (int v = 0; v < 4; ++v) _mm256_storeu_ps(o + 8 * v, k.w[v]);
    }
  }
}

// The codes of a block as fp32 (Q4_0's minus 8): the part of decode() before the scale
template <QType T>
inline void codes(const uint8_t* blk, __m256 q[4]) {
  if constexpr (T == QType::Q8_0) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
    q[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(a));
    q[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)));
    q[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    q[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)));
  } else {
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + block_bytes(T) - 16));
    const __m256i z0 = _mm256_cvtepu8_epi32(v);
    const __m256i z1 = _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8));
    const __m256i low4 = _mm256_set1_epi32(0xF);
    if constexpr (T == QType::Q4_0) {
      const __m256i bias = _mm256_set1_epi32(8);
      q[0] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(z0, low4), bias));
      q[1] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(z1, low4), bias));
      q[2] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(z0, 4), bias));
      q[3] = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(z1, 4), bias));
    } else {
      q[0] = _mm256_cvtepi32_ps(_mm256_and_si256(z0, low4));
      q[1] = _mm256_cvtepi32_ps(_mm256_and_si256(z1, low4));
      q[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(z0, 4));
      q[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(z1, 4));
    }
  }
}

// The GEMV at AVX2 width is bound by the arithmetic that turns codes into weights (16 vector ops a
// block before its 4 FMAs, twice AVX-512's count), not by memory. So the block's scale, and Q4_1's
// offset, come out of the dot product: sum_j w_j x_j = d * sum_j q_j x_j (+ m * sum_j x_j), the same
// sum as over the reference's weights w_j = d * q_j (+ m) (exact products of fp16 and 4- or 8-bit
// integers, so these are the same real numbers) in another order of fp32 roundings. The sums of x
// over each block are taken once a call. Two accumulators a row, even and odd blocks.
template <QType T, int M>
void gemv_t(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t n0, int64_t n1, const float* x,
            int64_t ldx, float* out, int64_t ldo) {
  thread_local std::vector<float> sums;
  if constexpr (T == QType::Q4_1) {
    sums.resize(static_cast<size_t>(M * nb));
    for (int r = 0; r < M; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + r * ldx + b * kBlock;
        const __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xb), _mm256_loadu_ps(xb + 8)),
                                       _mm256_add_ps(_mm256_loadu_ps(xb + 16), _mm256_loadu_ps(xb + 24)));
        sums[r * nb + b] = hsum(s);
      }
    }
  }
  for (int64_t i = n0; i < n1; ++i) {
    const uint8_t* row = w + i * row_bytes;
    __m256 acc[M][2];
    float off[M] = {};
    for (int r = 0; r < M; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = row + b * block_bytes(T);
      __m256 q[4];
      codes<T>(blk, q);
      float dm[4];
      if constexpr (T == QType::Q4_1) {
        uint32_t bits;
        std::memcpy(&bits, blk, 4);
        _mm_storeu_ps(dm, _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits))));  // [d, m, 0, 0]
      } else {
        dm[0] = _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(load_u16(blk))));
      }
      const __m256 d = _mm256_set1_ps(dm[0]);
      for (int r = 0; r < M; ++r) {
        const float* xb = x + r * ldx + b * kBlock;
        __m256 t = _mm256_mul_ps(q[0], _mm256_loadu_ps(xb));
        __m256 u = _mm256_mul_ps(q[2], _mm256_loadu_ps(xb + 16));
        t = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xb + 8), t);
        u = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xb + 24), u);
        acc[r][b & 1] = _mm256_fmadd_ps(d, _mm256_add_ps(t, u), acc[r][b & 1]);
        if constexpr (T == QType::Q4_1) off[r] += dm[1] * sums[r * nb + b];
      }
    }
    for (int r = 0; r < M; ++r) out[r * ldo + i] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + off[r];
  }
}

void tile_kernel(const float* x, int64_t ldx, int mr, const float* w, int64_t ldw, int64_t kc, float* out,
                 int64_t ldo, int nr, bool add) {
  const float* xr[kMR];
  for (int r = 0; r < kMR; ++r) xr[r] = x + std::min(r, mr - 1) * ldx;  // rows >= mr: recomputed
  __m256 acc[kMR][kNR];
  for (int r = 0; r < kMR; ++r) {
    for (int j = 0; j < kNR; ++j) acc[r][j] = _mm256_setzero_ps();
  }
  for (int64_t c = 0; c < kc; c += 8) {
    __m256 wv[kNR];
    for (int j = 0; j < kNR; ++j) wv[j] = _mm256_loadu_ps(w + j * ldw + c);
    for (int r = 0; r < kMR; ++r) {
      const __m256 xv = _mm256_loadu_ps(xr[r] + c);
      for (int j = 0; j < kNR; ++j) acc[r][j] = _mm256_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  for (int r = 0; r < mr; ++r) {
    for (int j = 0; j < nr; ++j) {
      const float sum = hsum(acc[r][j]);
      out[r * ldo + j] = add ? out[r * ldo + j] + sum : sum;
    }
  }
}

constexpr Kernels kKernels = CTXFUSE_KERNELS("avx2");

}  // namespace avx2
#pragma GCC pop_options

// ---------------------------------------------------------------------------------------------------
// AVX-512 (F, BW, VL) + FMA + F16C: a block is 2 vectors of 16 weights.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#pragma GCC optimize("fp-contract=off")
namespace avx512 {

constexpr int kNR = 4;  // 4 x 4 accumulators + 4 + 4 operands: 24 of the 32 zmm registers

struct Block {
  __m512 lo, hi;  // weights 0-15 and 16-31
};

template <QType T>
inline Block decode(const uint8_t* blk) {
  __m512 lo, hi;  // the codes as fp32 (Q4_0's minus 8)
  if constexpr (T == QType::Q8_0) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  } else {
    // byte j holds weight j (low nibble) and weight j + 16 (high nibble)
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + block_bytes(T) - 16));
    const __m512i z = _mm512_cvtepu8_epi32(v);
    const __m512i bias = _mm512_set1_epi32(T == QType::Q4_0 ? 8 : 0);
    lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_and_si512(z, _mm512_set1_epi32(0xF)), bias));
    hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_srli_epi32(z, 4), bias));
  }
  if constexpr (T == QType::Q4_1) {
    uint32_t dm;
    std::memcpy(&dm, blk, 4);
    const __m128 f = _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(dm)));  // [d, m, 0, 0]
    const __m512 d = _mm512_broadcastss_ps(f), m = _mm512_broadcastss_ps(_mm_movehdup_ps(f));
    return {_mm512_add_ps(_mm512_mul_ps(lo, d), m), _mm512_add_ps(_mm512_mul_ps(hi, d), m)};
  } else {
    const __m512 d = _mm512_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(load_u16(blk))));
    return {_mm512_mul_ps(lo, d), _mm512_mul_ps(hi, d)};
  }
}

template <QType T>
void dequant_t(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t nb, float* out) {
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t b = 0; b < nb; ++b) {
      const Block k = decode<T>(w + i * row_bytes + b * block_bytes(T));
      float* o = out + (i * nb + b) * kBlock;
      _mm512_storeu_ps(o, k.lo);
      _mm512_storeu_ps(o + 16, k.hi);
    }
  }
}

// two accumulators a row of x (weights 0-15 and 16-31 of each block): two short FMA chains
template <QType T, int M>
void gemv_t(const uint8_t* w, int64_t row_bytes, int64_t nb, int64_t n0, int64_t n1, const float* x,
            int64_t ldx, float* out, int64_t ldo) {
  for (int64_t i = n0; i < n1; ++i) {
    const uint8_t* row = w + i * row_bytes;
    __m512 lo[M], hi[M];
    for (int r = 0; r < M; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const Block k = decode<T>(row + b * block_bytes(T));
      for (int r = 0; r < M; ++r) {
        const float* xb = x + r * ldx + b * kBlock;
        lo[r] = _mm512_fmadd_ps(k.lo, _mm512_loadu_ps(xb), lo[r]);
        hi[r] = _mm512_fmadd_ps(k.hi, _mm512_loadu_ps(xb + 16), hi[r]);
      }
    }
    for (int r = 0; r < M; ++r) out[r * ldo + i] = _mm512_reduce_add_ps(_mm512_add_ps(lo[r], hi[r]));
  }
}

// the sums of lanes i and i + 8
inline __m256 fold(__m512 v) {
  const __m256 upper = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return _mm256_add_ps(_mm512_castps512_ps256(v), upper);
}

// 4 sums of 16 lanes each -> [s0, s1, s2, s3]
inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(fold(a), fold(b)), _mm256_hadd_ps(fold(c), fold(d)));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

void tile_kernel(const float* x, int64_t ldx, int mr, const float* w, int64_t ldw, int64_t kc, float* out,
                 int64_t ldo, int nr, bool add) {
  const float* xr[kMR];
  for (int r = 0; r < kMR; ++r) xr[r] = x + std::min(r, mr - 1) * ldx;  // rows >= mr: recomputed
  __m512 acc[kMR][kNR];
  for (int r = 0; r < kMR; ++r) {
    for (int j = 0; j < kNR; ++j) acc[r][j] = _mm512_setzero_ps();
  }
  for (int64_t c = 0; c < kc; c += 16) {
    __m512 wv[kNR];
    for (int j = 0; j < kNR; ++j) wv[j] = _mm512_loadu_ps(w + j * ldw + c);
    for (int r = 0; r < kMR; ++r) {
      const __m512 xv = _mm512_loadu_ps(xr[r] + c);
      for (int j = 0; j < kNR; ++j) acc[r][j] = _mm512_fmadd_ps(xv, wv[j], acc[r][j]);
    }
  }
  const __mmask8 keep = static_cast<__mmask8>((1u << nr) - 1);
  for (int r = 0; r < mr; ++r) {
    __m128 sum = hsum4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]);
    if (add) sum = _mm_add_ps(_mm_maskz_loadu_ps(keep, out + r * ldo), sum);
    _mm_mask_storeu_ps(out + r * ldo, keep, sum);
  }
}

constexpr Kernels kKernels = CTXFUSE_KERNELS("avx512");

}  // namespace avx512
#pragma GCC pop_options
#endif  // CTXFUSE_X86

// ---------------------------------------------------------------------------------------------------
// Dispatch, once at load: the widest ISA the CPU and the OS (saved vector state) support.

bool supports(const Kernels& k) {
#ifdef CTXFUSE_X86
  __builtin_cpu_init();
  if (&k == &avx512::kKernels) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
  if (&k == &avx2::kKernels) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
#endif
  return &k == &scalar::kKernels;
}

// widest first
const Kernels* const kAll[] = {
#ifdef CTXFUSE_X86
    &avx512::kKernels,
    &avx2::kKernels,
#endif
    &scalar::kKernels,
};

const Kernels* detect() {
  for (const Kernels* k : kAll) {
    if (supports(*k)) return k;
  }
  return &scalar::kKernels;
}

const Kernels* g_kernels = detect();

// ---------------------------------------------------------------------------------------------------
// The two paths (grids and memory in the header comment).

// Output rows a chunk of the GEMV and dequantize grids: a few chunks a thread, handed out
// dynamically (a thread that starts late takes fewer), at least kGemvGrain rows.
int64_t gemv_chunk(int64_t n) {
  const int64_t threads = ctxfuse_pool::num_threads();
  return std::max(kGemvGrain, (n + threads * kChunksPerThread - 1) / (threads * kChunksPerThread));
}

void run_gemv(const Kernels& kern, QType t, const uint8_t* w, int64_t row_bytes, int64_t n, const float* x,
              int64_t m, int64_t k, float* out) {
  const int64_t nb = k / kBlock;
  const GemvFn* gemv = kern.gemv[static_cast<int>(t)];
  ctxfuse_pool::parallel_for(n, gemv_chunk(n), [&](int64_t n0, int64_t n1, int) {
    for (int64_t r0 = 0; r0 < m; r0 += kGemvGroup) {
      const int64_t rows = std::min<int64_t>(kGemvGroup, m - r0);
      gemv[rows - 1](w, row_bytes, nb, n0, n1, x + r0 * k, k, out + r0 * n, n);
    }
  }, 0, kGemvLingerNs);
}

void run_tiled(const Kernels& kern, QType t, const uint8_t* w, int64_t row_bytes, int64_t n, const float* x,
               int64_t m, int64_t k, float* out) {
  const int64_t nr = kern.nr_max;
  const int64_t chunks = (k + kChunk - 1) / kChunk;
  const int64_t kc = (k / kBlock + chunks - 1) / chunks * kBlock;  // k split evenly, whole blocks
  // rows a tile: a multiple of nr, about kTileBytes of fp32 over one chunk
  const int64_t tile = std::max<int64_t>(1, kTileBytes / (kc * 4 * nr)) * nr;
  const int64_t tiles = (n + tile - 1) / tile;
  const DequantFn dequant = kern.dequant[static_cast<int>(t)];
  // one contiguous run of tiles a thread (as at::parallel_for split them)
  const int64_t threads = std::min<int64_t>(ctxfuse_pool::num_threads(), tiles);
  ctxfuse_pool::parallel_for(tiles, (tiles + threads - 1) / threads, [&](int64_t t0, int64_t t1, int) {
    // [tile, k] fp32; zeroed once so the rows past a short last tile are finite
    std::vector<float> scratch(tile * k, 0.0f);
    for (int64_t x0 = 0; x0 < m; x0 += kXRows) {  // a block of x stays in L2 through the thread's tiles
      const int64_t x1 = std::min(m, x0 + kXRows);
      for (int64_t tt = t0; tt < t1; ++tt) {
        const int64_t n0 = tt * tile, rows = std::min(tile, n - n0);
        dequant(w + n0 * row_bytes, row_bytes, rows, k / kBlock, scratch.data());
        for (int64_t c0 = 0; c0 < k; c0 += kc) {
          const int64_t len = std::min(kc, k - c0);
          for (int64_t r0 = x0; r0 < x1; r0 += kMR) {
            const int mr = static_cast<int>(std::min<int64_t>(kMR, x1 - r0));
            for (int64_t j0 = 0; j0 < rows; j0 += nr) {
              kern.tile(x + r0 * k + c0, k, mr, scratch.data() + j0 * k + c0, k, len,
                        out + r0 * n + n0 + j0, n, static_cast<int>(std::min(nr, rows - j0)), c0 > 0);
            }
          }
        }
      }
    }
  });
}

QType check_weight(const at::Tensor& w, int64_t qtype, int64_t k) {
  TORCH_CHECK(qtype >= 0 && qtype <= 2, "gguf_matmul: unknown qtype code ", qtype);
  const QType t = static_cast<QType>(qtype);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "gguf_matmul: weights must be a contiguous uint8 CPU tensor [n, row_bytes]");
  TORCH_CHECK(k > 0 && k % kBlock == 0 && w.size(1) == k / kBlock * block_bytes(t),
              "gguf_matmul: row_bytes ", w.size(1), " does not hold ", k, " weights");
  return t;
}

// x [m, k] fp32 contiguous, w [n, row_bytes] uint8 -> [m, n] fp32. path: 0 by m, 1 GEMV, 2 tiled
// (tests and benchmarks hold both paths to the reference at every m).
at::Tensor linear(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t path) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "gguf_matmul: x must be a contiguous fp32 CPU tensor [m, k]");
  const QType t = check_weight(w, qtype, x.size(1));
  const int64_t m = x.size(0), n = w.size(0), k = x.size(1);
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0 || n == 0) return out;
  TORCH_CHECK(path >= 0 && path <= 2, "gguf_matmul: unknown path ", path);
  const bool gemv = path == 1 || (path == 0 && m <= kGemvMaxRows);
  const auto run = gemv ? run_gemv : run_tiled;
  run(*g_kernels, t, w.data_ptr<uint8_t>(), w.size(1), n, x.data_ptr<float>(), m, k, out.data_ptr<float>());
  return out;
}

// w [n, row_bytes] uint8 -> [n, k] fp32, bit-equal to gguf.quants.dequantize
at::Tensor dequantize(const at::Tensor& w, int64_t qtype, int64_t k) {
  const QType t = check_weight(w, qtype, k);
  const int64_t n = w.size(0), row_bytes = w.size(1);
  at::Tensor out = at::empty({n, k}, w.options().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const DequantFn dequant = g_kernels->dequant[static_cast<int>(t)];
  ctxfuse_pool::parallel_for(n, gemv_chunk(n), [&](int64_t n0, int64_t n1, int) {
    dequant(wp + n0 * row_bytes, row_bytes, n1 - n0, k / kBlock, op + n0 * k);
  });
  return out;
}

std::string isa() { return g_kernels->name; }

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (const Kernels* k : kAll) {
    if (supports(*k)) names.emplace_back(k->name);
  }
  return names;
}

// For tests and benchmarks: run a narrower path on a wide CPU. Not safe against concurrent calls.
void set_isa(const std::string& name) {
  for (const Kernels* k : kAll) {
    if (name == k->name) {
      TORCH_CHECK(supports(*k), "gguf_matmul: this CPU cannot run ", name);
      g_kernels = k;
      return;
    }
  }
  TORCH_CHECK(false, "gguf_matmul: no ISA path named ", name);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  // the GIL is released while a kernel runs: the serving loop's Python thread goes on meanwhile
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  mod.def("linear", &linear, "x [m, k] fp32 @ GGUF blocks [n, row_bytes]^T -> [m, n] fp32", nogil);
  mod.def("dequantize", &dequantize, "GGUF blocks [n, row_bytes] -> [n, k] fp32", nogil);
  mod.def("isa", &isa, "the ISA path in use");
  mod.def("supported_isas", &supported_isas, "the ISA paths this CPU can run, widest first");
  mod.def("set_isa", &set_isa, "use another supported ISA path (tests, benchmarks)");
}
