// The vector primitives the attention kernels share (paged_attention.cpp, prefill_attention.cpp):
// V, a vector of CTXFUSE_SIMD_WIDTH floats (16: AVX-512, 8: AVX2 + FMA, 1: a plain float), and the
// few operations their kernel text is written in. No include guard: a kernel file includes this
// once per ISA pass, inside that pass's namespace and `#pragma GCC target`, with
// CTXFUSE_SIMD_WIDTH set to the pass's width.
//
// vexp is Cephes' expf (~1 ulp over the range that matters); below -87, -inf included, it gives 0,
// so a masked score (-inf) contributes nothing and never a NaN. vexp_nonpos is for a softmax's
// exp(s - max) <= 1: no upper clamp, and below -87 it gives exp(-87) ~ 1.6e-38 rather than 0 (two
// instructions fewer; no fp32 sum that holds the max's exp(0) = 1 can tell).

#if CTXFUSE_SIMD_WIDTH == 16
using V = __m512;
inline V vzero() { return _mm512_setzero_ps(); }
inline V vset(float x) { return _mm512_set1_ps(x); }
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V x) { _mm512_storeu_ps(p, x); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(V x) { return _mm512_reduce_add_ps(x); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline float vhmax(V x) { return _mm512_reduce_max_ps(x); }
// lanes whose bound is below `at` become -inf (a causal mask: at = a key's position, bound = each
// query row's position)
inline V vmask_below(V x, V bound, float at) {
  const __mmask16 out = _mm512_cmp_ps_mask(bound, vset(at), _CMP_LT_OQ);
  return _mm512_mask_blend_ps(out, x, vset(-__builtin_inff()));
}
// 2^n * e^r for x = n ln2 + r, x already within [-87, 88]
inline V vexp_in_range(V x) {
  const V n = _mm512_roundscale_ps(vmul(x, vset(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  V r = _mm512_fnmadd_ps(n, vset(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, vset(-2.12194440e-4f), r);
  V y = vfma(vset(1.9875691500e-4f), r, vset(1.3981999507e-3f));
  y = vfma(y, r, vset(8.3334519073e-3f));
  y = vfma(y, r, vset(4.1665795894e-2f));
  y = vfma(y, r, vset(1.6666665459e-1f));
  y = vfma(y, r, vset(5.0000001201e-1f));
  y = vfma(y, vmul(r, r), _mm512_add_ps(r, vset(1.0f)));
  const __m512i e =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return vmul(y, _mm512_castsi512_ps(e));
}
inline V vexp(V x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, vset(-87.0f), _CMP_LT_OQ);
  const V y = vexp_in_range(_mm512_min_ps(_mm512_max_ps(x, vset(-87.0f)), vset(88.0f)));
  return _mm512_mask_blend_ps(tiny, y, vzero());
}
inline V vexp_nonpos(V x) { return vexp_in_range(_mm512_max_ps(x, vset(-87.0f))); }

#elif CTXFUSE_SIMD_WIDTH == 8
using V = __m256;
inline V vzero() { return _mm256_setzero_ps(); }
inline V vset(float x) { return _mm256_set1_ps(x); }
inline V vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, V x) { _mm256_storeu_ps(p, x); }
inline V vadd(V a, V b) { return _mm256_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(V x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline V vmax(V a, V b) { return _mm256_max_ps(a, b); }
inline float vhmax(V x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline V vmask_below(V x, V bound, float at) {
  return _mm256_blendv_ps(x, vset(-__builtin_inff()), _mm256_cmp_ps(bound, vset(at), _CMP_LT_OQ));
}
inline V vexp_in_range(V x) {
  const V n = _mm256_round_ps(vmul(x, vset(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  V r = _mm256_fnmadd_ps(n, vset(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, vset(-2.12194440e-4f), r);
  V y = vfma(vset(1.9875691500e-4f), r, vset(1.3981999507e-3f));
  y = vfma(y, r, vset(8.3334519073e-3f));
  y = vfma(y, r, vset(4.1665795894e-2f));
  y = vfma(y, r, vset(1.6666665459e-1f));
  y = vfma(y, r, vset(5.0000001201e-1f));
  y = vfma(y, vmul(r, r), _mm256_add_ps(r, vset(1.0f)));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return vmul(y, _mm256_castsi256_ps(e));
}
inline V vexp(V x) {
  const V tiny = _mm256_cmp_ps(x, vset(-87.0f), _CMP_LT_OQ);
  const V y = vexp_in_range(_mm256_min_ps(_mm256_max_ps(x, vset(-87.0f)), vset(88.0f)));
  return _mm256_blendv_ps(y, vzero(), tiny);
}
inline V vexp_nonpos(V x) { return vexp_in_range(_mm256_max_ps(x, vset(-87.0f))); }

#else  // plain C++: a "vector" is one float
using V = float;
inline V vzero() { return 0.0f; }
inline V vset(float x) { return x; }
inline V vload(const float* p) { return *p; }
inline void vstore(float* p, V x) { *p = x; }
inline V vadd(V a, V b) { return a + b; }
inline V vsub(V a, V b) { return a - b; }
inline V vmul(V a, V b) { return a * b; }
inline V vfma(V a, V b, V c) { return a * b + c; }
inline float vsum(V x) { return x; }
inline V vmax(V a, V b) { return std::max(a, b); }
inline float vhmax(V x) { return x; }
inline V vmask_below(V x, V bound, float at) { return bound < at ? -__builtin_inff() : x; }
inline V vexp(V x) { return std::exp(x); }
inline V vexp_nonpos(V x) { return std::exp(x); }
#endif
