// kvpage's CPU kernels: paged decode attention that reads K/V in place through the block tables,
// the K/V write into the paged cache, and the small per-layer ops fused (RMSNorm with the residual
// add, RoPE on q and k in place, SiLU(gate) * up), the row and quantized linears, and all of a decode
// step's layers in one call (decode_layers). float32 and bfloat16; arithmetic in float32.
//
// Registered as torch.ops.kvpage.* (no pybind: the extension is a plain shared library, loaded by
// kvpage/ops/build.py). Work is split with at::parallel_for, i.e. torch's own thread pool.
//
// Cache layout (kvpage/worker/kv_cache.py): [num_blocks, num_kv_heads, block_size, head_dim],
// contiguous; token t of a sequence sits at cache[block_table[t / B], h, t % B, :].

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

using at::Tensor;

// --- conversions: a row of T to float and back (bf16 <-> f32 is a 16-bit shift, vectorises) ---

inline void to_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void to_float(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i)));
    _mm512_storeu_si512(d + i, _mm512_slli_epi32(w, 16));
  }
#endif
  for (; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

inline void from_float(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void from_float(const float* src, c10::BFloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i]);  // round to nearest even
}

// cnt rows of D int8 values, each times its own scale, to float (an int8 KV block read back)
inline void widen_int8(const int8_t* src, const float* scales, float* dst, int64_t cnt, int64_t D) {
  for (int64_t t = 0; t < cnt; ++t) {
    const int8_t* r = src + t * D;
    float* d = dst + t * D;
    const float sc = scales[t];
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 sv = _mm512_set1_ps(sc);
    for (; i + 16 <= D; i += 16) {
      const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r + i)));
      _mm512_storeu_ps(d + i, _mm512_mul_ps(_mm512_cvtepi32_ps(w), sv));
    }
#elif defined(__AVX2__)
    const __m256 sv = _mm256_set1_ps(sc);
    for (; i + 8 <= D; i += 8) {
      const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(r + i)));
      _mm256_storeu_ps(d + i, _mm256_mul_ps(_mm256_cvtepi32_ps(w), sv));
    }
#endif
    for (; i < D; ++i) d[i] = static_cast<float>(r[i]) * sc;
  }
}

// exp over a float array, vectorised where AVX2 is: the Cephes single-precision scheme (x = n ln2 + r,
// a degree-5 polynomial in r, times 2^n), within 2 ulp of expf over the range softmax and SiLU use.
#if defined(__AVX2__) && defined(__FMA__)
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}
#endif

// s[i] = exp(s[i] - shift); returns the sum
inline float exp_shifted(float* s, int64_t n, float shift) {
  int64_t i = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  const __m256 sh = _mm256_set1_ps(shift);
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), sh));
    _mm256_storeu_ps(s + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (float v : lanes) sum += v;
#endif
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - shift);
    sum += s[i];
  }
  return sum;
}

// s[i] = s[i] / (1 + exp(-s[i]))
inline void silu_inplace(float* s, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(s + i);
    _mm256_storeu_ps(s + i, _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, x)))));
  }
#endif
  for (; i < n; ++i) s[i] = s[i] / (1.f + std::exp(-s[i]));
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Runs f(T{}) with T the C++ type of a float32 or bfloat16 tensor; any other dtype is an error naming `op`.
template <typename F>
void dispatch_float(at::ScalarType t, const char* op, F&& f) {
  if (t == at::kFloat) {
    f(float{});
  } else if (t == at::kBFloat16) {
    f(c10::BFloat16{});
  } else {
    TORCH_CHECK(false, op, ": float32 or bfloat16 only, got ", t);
  }
}

void check_cache(const Tensor& cache, const Tensor& other, const char* what) {
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous(), what, " must be a contiguous [blocks, kv_heads, block_size, head_dim] tensor");
  TORCH_CHECK(cache.sizes() == other.sizes() && cache.scalar_type() == other.scalar_type(), "k_cache and v_cache differ");
}

// --- paged decode attention -------------------------------------------------------------------
// q, out: [S, H, D] (rows may be strided, heads and dims contiguous); block_tables [S, W] int64;
// seq_lens [S] int64. One task per (sequence, kv head): the group's H / KVH query heads are scored
// against each key as it is loaded once, with an online softmax per block of keys.

// Scores of one block: sc[g * ldsc + t] = q_g . k_t for G query heads, cnt keys (rows of D floats).
inline void block_scores(const float* q, int64_t G, int64_t D, const float* k, int64_t cnt, float* sc, int64_t ldsc) {
  int64_t t0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if (D % 8 == 0) {
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      for (int64_t t = 0; t + 4 <= cnt; t += 4) {  // four keys, four independent FMA chains
        __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
        const float* k0 = k + t * D;
        for (int64_t c = 0; c < D; c += 8) {
          const __m256 qv = _mm256_loadu_ps(qg + c);
          a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + c), a0);
          a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + D + c), a1);
          a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 2 * D + c), a2);
          a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k0 + 3 * D + c), a3);
        }
        const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        _mm_storeu_ps(sc + g * ldsc + t, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
      }
    }
    t0 = cnt / 4 * 4;
  }
#endif
  for (int64_t g = 0; g < G; ++g)
    for (int64_t t = t0; t < cnt; ++t) sc[g * ldsc + t] = dot(q + g * D, k + t * D, D);
}

// acc_g += sum_t p[g * ldp + t] * v_t for G heads, cnt values (rows of D floats).
inline void block_accumulate(float* acc, int64_t G, int64_t D, const float* v, int64_t cnt, const float* p, int64_t ldp) {
#if defined(__AVX2__) && defined(__FMA__)
  if (D == 64 || D == 128) {
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t c0 = 0; c0 < D; c0 += 64) {  // 8 accumulators in registers per 64 columns
        __m256 a[8];
        float* ag = acc + g * D + c0;
        for (int i = 0; i < 8; ++i) a[i] = _mm256_loadu_ps(ag + 8 * i);
        for (int64_t t = 0; t < cnt; ++t) {
          const __m256 pv = _mm256_set1_ps(p[g * ldp + t]);
          const float* vr = v + t * D + c0;
          for (int i = 0; i < 8; ++i) a[i] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vr + 8 * i), a[i]);
        }
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(ag + 8 * i, a[i]);
      }
    }
    return;
  }
#endif
  for (int64_t t = 0; t < cnt; ++t)
    for (int64_t g = 0; g < G; ++g) {
      const float pt = p[g * ldp + t];
      float* ag = acc + g * D;
      const float* vr = v + t * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) ag[i] += pt * vr[i];
    }
}

// One block of the online softmax for G heads: sc[g * ldsc + t] (scores) become exp(score - new max);
// the running max m, sum l and accumulator acc (G x D) are rescaled to the new max.
inline void online_softmax_step(float* sc, int64_t ldsc, int64_t G, int64_t cnt, float* m, float* l, float* acc,
                                int64_t D) {
  for (int64_t g = 0; g < G; ++g) {
    float* sg = sc + g * ldsc;
    float bm = m[g];
    for (int64_t t = 0; t < cnt; ++t) bm = std::max(bm, sg[t]);
    const float corr = std::exp(m[g] - bm);  // exp(-inf) = 0 on the first block
    l[g] = l[g] * corr + exp_shifted(sg, cnt, bm);
    m[g] = bm;
    if (corr != 1.f) {
      float* ag = acc + g * D;
      for (int64_t i = 0; i < D; ++i) ag[i] *= corr;
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// --- AVX-512: 16 floats per register; the K/V rows of a block are read straight from the cache ---
#define KVPAGE_AVX512 1

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // bfloat16 -> float32: a 16-bit shift
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// The four sums of a0..a3, times `scale`, into out[0..4).
inline void store_sums4(__m512 a0, __m512 a1, __m512 a2, __m512 a3, float scale, float* out) {
  auto half = [](__m512 a) { return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1)); };
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(half(a0), half(a1)), _mm256_hadd_ps(half(a2), half(a3)));
  const __m128 r = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  _mm_storeu_ps(out, _mm_mul_ps(r, _mm_set1_ps(scale)));
}

// sc[g * ldsc + t] = scale * q_g . k_t over G heads and cnt keys: float rows, D % 16 == 0.
inline void scores512(const float* q, int64_t G, int64_t D, const float* k, int64_t cnt, float* sc, int64_t ldsc,
                      float scale) {
  int64_t t = 0;
  for (; t + 4 <= cnt; t += 4) {
    const float* k0 = k + t * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t c = 0; c < D; c += 16) {
        const __m512 qv = _mm512_loadu_ps(qg + c);
        a0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + c), a0);
        a1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + D + c), a1);
        a2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + 2 * D + c), a2);
        a3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + 3 * D + c), a3);
      }
      store_sums4(a0, a1, a2, a3, scale, sc + g * ldsc + t);
    }
  }
  for (; t < cnt; ++t)
    for (int64_t g = 0; g < G; ++g) sc[g * ldsc + t] = scale * dot(q + g * D, k + t * D, D);
}

#if defined(__AVX512BF16__)
// The same for bfloat16 q and keys, D % 32 == 0: VDPBF16PS multiplies bf16 pairs exactly and adds in float32.
inline void scores_bf16(const c10::BFloat16* q, int64_t G, int64_t D, const c10::BFloat16* k, int64_t cnt, float* sc,
                        int64_t ldsc, float scale) {
  auto ld = [](const c10::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); };
  int64_t t = 0;
  for (; t + 4 <= cnt; t += 4) {
    const c10::BFloat16* k0 = k + t * D;
    for (int64_t g = 0; g < G; ++g) {
      const c10::BFloat16* qg = q + g * D;
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t c = 0; c < D; c += 32) {
        const __m512bh qv = ld(qg + c);
        a0 = _mm512_dpbf16_ps(a0, qv, ld(k0 + c));
        a1 = _mm512_dpbf16_ps(a1, qv, ld(k0 + D + c));
        a2 = _mm512_dpbf16_ps(a2, qv, ld(k0 + 2 * D + c));
        a3 = _mm512_dpbf16_ps(a3, qv, ld(k0 + 3 * D + c));
      }
      store_sums4(a0, a1, a2, a3, scale, sc + g * ldsc + t);
    }
  }
  for (; t < cnt; ++t)
    for (int64_t g = 0; g < G; ++g) {
      __m512 a = _mm512_setzero_ps();
      for (int64_t c = 0; c < D; c += 32) a = _mm512_dpbf16_ps(a, ld(q + g * D + c), ld(k + t * D + c));
      sc[g * ldsc + t] = scale * _mm512_reduce_add_ps(a);
    }
}
#endif

// acc_g += sum_t p[g * ldp + t] * v_t for GN heads (NC = D / 16 registers a row): the accumulators stay in
// registers over the block and each value row is loaded (and widened) once for all GN heads.
template <int NC, int GN, typename C>
inline void accumulate512_heads(float* acc, int64_t D, const C* v, int64_t cnt, const float* p, int64_t ldp) {
  __m512 a[GN * NC];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NC; ++c) a[g * NC + c] = _mm512_loadu_ps(acc + g * D + 16 * c);
  for (int64_t t = 0; t < cnt; ++t) {
    __m512 vv[NC];
    for (int c = 0; c < NC; ++c) vv[c] = load16(v + t * D + 16 * c);
    for (int g = 0; g < GN; ++g) {
      const __m512 pv = _mm512_set1_ps(p[g * ldp + t]);
      for (int c = 0; c < NC; ++c) a[g * NC + c] = _mm512_fmadd_ps(pv, vv[c], a[g * NC + c]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, a[g * NC + c]);
}

// All G heads, in passes of at most 16 accumulators. D must be 32, 64 or 128.
template <int NC, typename C>
inline void accumulate512_nc(float* acc, int64_t G, int64_t D, const C* v, int64_t cnt, const float* p, int64_t ldp) {
  constexpr int MAXG = 16 / NC;
  for (int64_t g0 = 0; g0 < G; g0 += MAXG) {
    float* ag = acc + g0 * D;
    const float* pg = p + g0 * ldp;
    switch (std::min<int64_t>(MAXG, G - g0)) {
      case 8: if constexpr (MAXG >= 8) { accumulate512_heads<NC, 8>(ag, D, v, cnt, pg, ldp); break; } [[fallthrough]];
      case 7: if constexpr (MAXG >= 7) { accumulate512_heads<NC, 7>(ag, D, v, cnt, pg, ldp); break; } [[fallthrough]];
      case 6: if constexpr (MAXG >= 6) { accumulate512_heads<NC, 6>(ag, D, v, cnt, pg, ldp); break; } [[fallthrough]];
      case 5: if constexpr (MAXG >= 5) { accumulate512_heads<NC, 5>(ag, D, v, cnt, pg, ldp); break; } [[fallthrough]];
      case 4: if constexpr (MAXG >= 4) { accumulate512_heads<NC, 4>(ag, D, v, cnt, pg, ldp); break; } [[fallthrough]];
      case 3: if constexpr (MAXG >= 3) { accumulate512_heads<NC, 3>(ag, D, v, cnt, pg, ldp); break; } [[fallthrough]];
      case 2: if constexpr (MAXG >= 2) { accumulate512_heads<NC, 2>(ag, D, v, cnt, pg, ldp); break; } [[fallthrough]];
      default: accumulate512_heads<NC, 1>(ag, D, v, cnt, pg, ldp);
    }
  }
}

template <typename C>
inline void accumulate512(float* acc, int64_t G, int64_t D, const C* v, int64_t cnt, const float* p, int64_t ldp) {
  if (D == 32) accumulate512_nc<2>(acc, G, D, v, cnt, p, ldp);
  else if (D == 64) accumulate512_nc<4>(acc, G, D, v, cnt, p, ldp);
  else accumulate512_nc<8>(acc, G, D, v, cnt, p, ldp);
}
#endif

// Whether decode_impl dots bfloat16 keys as they are (AVX512_BF16), unwidened, against the unscaled q.
template <typename T, typename C>
constexpr bool bf16_dots() {
#if defined(KVPAGE_AVX512) && defined(__AVX512BF16__)
  return std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>;
#else
  return false;
#endif
}

// T: the dtype of q and out; C: the cache's (T itself, or int8 with a float scale per token and kv head
// in ks / vs, [blocks, kv_heads, block_size]).
// With `sel` (a read budget, kvpage/attention/key_bounds.py), a sequence whose budget sel.blocks[s] > 0
// is under its block count reads only some blocks: the first `sink`, the last `recent`, and between
// them the top by score. Quest's bound of query head g on block j, b_gj = sum_d max(q_gd * kmin_d,
// q_gd * kmax_d) (key bounds per block and kv head, float32 [blocks, kv_heads, D]), bounds its scores
// there; the group's score of j is sum_g exp(b_gj - max_j' b_gj'): the most its softmax could give the
// block against its best one, added over the heads that share the kv head. Ties go to the earlier
// block. The chosen blocks are attended in table order.
struct BlockSelect {
  const float* kmin = nullptr;
  const float* kmax = nullptr;
  const int64_t* blocks = nullptr;  // [S] blocks to read per sequence (0: all)
  int64_t sink = 1, recent = 2, num_blocks = 0;
};

// sum_d max(q_d * mn_d, q_d * mx_d) in 16 running sums (lane i takes d = i mod 16), then added in
// lane order: vectorisable without reordering any float addition, so every build sums the same way.
inline float quest_bound(const float* q, const float* mn, const float* mx, int64_t D) {
  float lanes[16] = {0.f};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16)
    for (int i = 0; i < 16; ++i) lanes[i] += std::max(q[d + i] * mn[d + i], q[d + i] * mx[d + i]);
  for (int i = 0; d < D; ++d, ++i) lanes[i] += std::max(q[d] * mn[d], q[d] * mx[d]);
  float sum = 0.f;
  for (int i = 0; i < 16; ++i) sum += lanes[i];
  return sum;
}

// The table indices j a (sequence, kv head) task reads, in order, into `idx` (scores: a reused buffer).
inline void choose_blocks(const BlockSelect& sel, int64_t s, int64_t h, int64_t KVH, int64_t G, int64_t D,
                          const float* qf, const int64_t* row, int64_t nb, std::vector<int64_t>& idx,
                          std::vector<std::pair<float, int64_t>>& scores, std::vector<float>& bound) {
  idx.clear();
  const int64_t want = sel.blocks != nullptr ? sel.blocks[s] : 0;
  if (want <= 0 || want >= nb || sel.kmin == nullptr) {
    for (int64_t j = 0; j < nb; ++j) idx.push_back(j);
    return;
  }
  const int64_t sink = std::min(sel.sink, nb), first_recent = std::max(sink, nb - sel.recent);
  const int64_t top = std::max<int64_t>(0, want - sink - (nb - first_recent));
  const int64_t m = first_recent - sink;
  bound.resize(G * m);
  for (int64_t j = sink; j < first_recent; ++j) {
    TORCH_CHECK(row[j] >= 0 && row[j] < sel.num_blocks, "block id ", row[j], " out of range");
    const int64_t off = (row[j] * KVH + h) * D;
    for (int64_t g = 0; g < G; ++g) bound[g * m + j - sink] = quest_bound(qf + g * D, sel.kmin + off, sel.kmax + off, D);
  }
  scores.assign(m, {0.f, 0});
  for (int64_t g = 0; g < G && m > 0; ++g) {
    const float* bg = bound.data() + g * m;
    const float top = *std::max_element(bg, bg + m);
    for (int64_t i = 0; i < m; ++i) scores[i].first += std::exp(bg[i] - top);
  }
  for (int64_t i = 0; i < m; ++i) scores[i].second = sink + i;
  const int64_t k = std::min<int64_t>(top, static_cast<int64_t>(scores.size()));
  auto better = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  std::partial_sort(scores.begin(), scores.begin() + k, scores.end(), better);
  for (int64_t j = 0; j < sink; ++j) idx.push_back(j);
  for (int64_t i = 0; i < k; ++i) idx.push_back(scores[i].second);
  std::sort(idx.begin() + sink, idx.end());
  for (int64_t j = first_recent; j < nb; ++j) idx.push_back(j);
}

template <typename T, typename C = T>
void decode_impl(Tensor& out, const Tensor& q, const Tensor& kc, const Tensor& vc, const Tensor& bt,
                 const Tensor& lens, double scale, const float* ksp = nullptr, const float* vsp = nullptr,
                 const BlockSelect& sel = BlockSelect{}) {
  const int64_t S = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t KVH = kc.size(1), BS = kc.size(2), G = H / KVH;
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const C* kp = kc.data_ptr<C>();
  const C* vp = vc.data_ptr<C>();
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  const int64_t bts = bt.stride(0), num_blocks = kc.size(0);
  const float fscale = static_cast<float>(scale);
#if defined(KVPAGE_AVX512)
  // whole rows of 16-float vectors: the AVX-512 loops, which read bfloat16 blocks without widening them first
  const bool wide = D == 32 || D == 64 || D == 128;
#else
  constexpr bool wide = false;
#endif
  constexpr bool dots = bf16_dots<T, C>();
  const int64_t ahead = std::max<int64_t>(2, 16384 / std::max<int64_t>(1, BS * D * static_cast<int64_t>(sizeof(C))));
  at::parallel_for(0, S * KVH, 1, [&](int64_t begin, int64_t end) {
    // kf/vf: one block of K/V in float32 (bfloat16 and int8 caches are widened once per block)
    std::vector<float> qf(G * D), acc(G * D), m(G), l(G), sc(G * BS), kf, vf;
    std::vector<int64_t> idx;
    std::vector<std::pair<float, int64_t>> bscores;
    std::vector<float> bounds;
    if constexpr (!std::is_same_v<C, float>) kf.resize(BS * D), vf.resize(BS * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / KVH, h = task % KVH, n = lp[s];
      for (int64_t g = 0; g < G; ++g) {
        to_float(qp + s * qs0 + (h * G + g) * qs1, qf.data() + g * D, D);
        for (int64_t i = 0; i < D; ++i) qf[g * D + i] *= fscale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      choose_blocks(sel, s, h, KVH, G, D, qf.data(), btp + s * bts, (n + BS - 1) / BS, idx, bscores, bounds);
      const int64_t nidx = static_cast<int64_t>(idx.size());
      for (int64_t u = 0; u < nidx; ++u) {
        const int64_t j = idx[u];
        const int64_t blk = btp[s * bts + j], cnt = std::min(BS, n - j * BS);
        TORCH_CHECK(blk >= 0 && blk < num_blocks, "block id ", blk, " out of range");
        const int64_t base = (blk * KVH + h) * BS * D;
#if defined(__AVX2__)
        // the blocks ahead sit anywhere in the pool: ask for their K/V now, about 16 KiB of K ahead, into L2 (not
        // L1, whose few miss buffers a block's 64 lines overflow: T0 at 8 KiB read 1.5x slower, 64 decodes of 400
        // tokens in a 20,000-block pool, 2-core Zen 4), while this one is computed (no prefetcher guesses a table)
        for (int64_t un = u == 0 ? 1 : u + ahead; un <= u + ahead && un < nidx; ++un) {
          const int64_t jn = idx[un], nblk = btp[s * bts + jn];
          if (nblk >= 0 && nblk < num_blocks) {
            const char* nk = reinterpret_cast<const char*>(kp + (nblk * KVH + h) * BS * D);
            const char* nv = reinterpret_cast<const char*>(vp + (nblk * KVH + h) * BS * D);
            const int64_t bytes = std::min(BS, n - jn * BS) * D * static_cast<int64_t>(sizeof(C));
            for (int64_t off = 0; off < bytes; off += 64) {
              _mm_prefetch(nk + off, _MM_HINT_T1);
              _mm_prefetch(nv + off, _MM_HINT_T1);
            }
          }
        }
#endif
        // K and V as float rows: in place for a float cache, else widened once per block into kf / vf; on the
        // AVX-512 path a bfloat16 block's values are widened in registers and its keys, with AVX512_BF16, not at all
        const float *kb = nullptr, *vb = nullptr;
        if constexpr (std::is_same_v<C, float>) {
          kb = kp + base, vb = vp + base;
        } else if constexpr (std::is_same_v<C, int8_t>) {
          const int64_t sbase = (blk * KVH + h) * BS;
          widen_int8(kp + base, ksp + sbase, kf.data(), cnt, D);
          widen_int8(vp + base, vsp + sbase, vf.data(), cnt, D);
          kb = kf.data(), vb = vf.data();
        } else {
          if (!(dots && wide)) to_float(kp + base, kf.data(), cnt * D), kb = kf.data();
          if (!wide) to_float(vp + base, vf.data(), cnt * D), vb = vf.data();
        }
#if defined(KVPAGE_AVX512)
        if (wide) {
#if defined(__AVX512BF16__)
          if constexpr (dots)  // q's own bfloat16 values, the scale after the dot
            scores_bf16(qp + s * qs0 + h * G * qs1, G, D, kp + base, cnt, sc.data(), BS, fscale);
          else
#endif
            scores512(qf.data(), G, D, kb, cnt, sc.data(), BS, 1.f);  // (qf is scaled)
        } else
#endif
          block_scores(qf.data(), G, D, kb, cnt, sc.data(), BS);
        online_softmax_step(sc.data(), BS, G, cnt, m.data(), l.data(), acc.data(), D);
#if defined(KVPAGE_AVX512)
        if (wide) {
          if constexpr (std::is_same_v<C, c10::BFloat16>)
            accumulate512(acc.data(), G, D, vp + base, cnt, sc.data(), BS);  // widened in registers
          else
            accumulate512(acc.data(), G, D, vb, cnt, sc.data(), BS);
        } else
#endif
          block_accumulate(acc.data(), G, D, vb, cnt, sc.data(), BS);
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
        float* ag = acc.data() + g * D;
        for (int64_t i = 0; i < D; ++i) ag[i] *= inv;
        from_float(ag, op + s * os0 + (h * G + g) * os1, D);
      }
    }
  });
}

void check_decode(const Tensor& out, const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                  const Tensor& block_tables, const Tensor& seq_lens) {
  check_cache(k_cache, v_cache, "k_cache");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "q must be [seqs, heads, head_dim] with contiguous heads");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.stride(1) == out.size(2), "out must match q");
  TORCH_CHECK(out.scalar_type() == q.scalar_type(), "q and out must share a dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(1) == 0, "q heads do not match the cache");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "block_tables and seq_lens must be int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.stride(1) == 1 && block_tables.size(0) >= q.size(0), "block_tables must be [seqs, width]");
  TORCH_CHECK(seq_lens.is_contiguous() && seq_lens.numel() >= q.size(0), "seq_lens must hold one length per sequence");
  const int64_t* lp = seq_lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < q.size(0); ++s)
    TORCH_CHECK(lp[s] > 0 && lp[s] <= block_tables.size(1) * k_cache.size(2), "sequence ", s, " length ", lp[s], " exceeds its block table");
}

// The read budget's inputs checked and wrapped (none given: every block is read).
BlockSelect block_select(const Tensor& q, const Tensor& k_cache, const std::optional<Tensor>& k_min,
                         const std::optional<Tensor>& k_max, const std::optional<Tensor>& read_blocks, int64_t sink,
                         int64_t recent) {
  BlockSelect sel;
  if (!read_blocks.has_value() || !read_blocks->defined() || !k_min.has_value() || !k_min->defined() || k_min->numel() == 0)
    return sel;
  TORCH_CHECK(k_max.has_value() && k_max->defined(), "key bounds need k_max beside k_min");
  for (const Tensor* t : {&*k_min, &*k_max})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == k_cache.size(0) &&
                    t->size(1) == k_cache.size(1) && t->size(2) == k_cache.size(3),
                "key bounds must be contiguous float32 [blocks, kv_heads, head_dim]");
  TORCH_CHECK(read_blocks->scalar_type() == at::kLong && read_blocks->is_contiguous() && read_blocks->numel() >= q.size(0),
              "read_blocks must be int64, one per sequence");
  TORCH_CHECK(sink >= 0 && recent >= 0, "sink and recent must be >= 0");
  sel.kmin = k_min->data_ptr<float>(), sel.kmax = k_max->data_ptr<float>();
  sel.blocks = read_blocks->data_ptr<int64_t>(), sel.sink = sink, sel.recent = recent;
  sel.num_blocks = k_cache.size(0);
  return sel;
}

void paged_decode_attention(Tensor out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables,
                            Tensor seq_lens, double scale, std::optional<Tensor> k_min, std::optional<Tensor> k_max,
                            std::optional<Tensor> read_blocks, int64_t sink, int64_t recent) {
  check_decode(out, q, k_cache, v_cache, block_tables, seq_lens);
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type(), "q, out and the cache must share a dtype");
  const BlockSelect sel = block_select(q, k_cache, k_min, k_max, read_blocks, sink, recent);
  dispatch_float(q.scalar_type(), "paged_decode_attention", [&](auto tag) { decode_impl<decltype(tag)>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, nullptr, nullptr, sel); });
}

// --- One prefill chunk over a paged cache, query rows in the lanes of a register ---------------------------
// A chunk of M queries (positions n - M .. n - 1 of its sequence; its own keys already written to the cache)
// attends the keys 0 .. its position. One task takes 16 query rows of one query head: the rows' q is laid
// out once, transposed (qt[i] = element i of each row, one row a lane; for bfloat16 a pair of elements, for
// VDPBF16PS), so a key's scores for all 16 rows are 16 lanes of FMAs (or pair dots) with the key's values
// broadcast, and the online softmax (max, exp, sum) runs across the rows at once: no horizontal sums, and
// each K/V block is read once for 16 rows. The decode kernel instead reads the context once per row (what a
// chunk run as decodes does) and SDPA first gathers it into a copy. Scores, probabilities and sums in
// float32, the values widened from bfloat16.
#if defined(KVPAGE_AVX512)
inline __m512 exp16(__m512 x) {  // exp8's polynomial on 16 lanes
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                   _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// Whether the prefill kernel takes this dtype in this build: float32 on AVX-512, bfloat16 with AVX512_BF16.
template <typename T>
constexpr bool prefill_kernel() {
#if defined(__AVX512BF16__)
  return std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
#else
  return std::is_same_v<T, float>;
#endif
}

// 16 keys' scores (key t0 + t in sc[t], one row a lane; unscaled) against the transposed rows qt.
template <typename T>
inline void row_scores(const std::vector<__m512>& qt, const T* k, int64_t t0, int64_t D, __m512* sc) {
  for (int t = 0; t < 16; ++t) sc[t] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const int64_t P = D / 2;
    const uint32_t* kw = reinterpret_cast<const uint32_t*>(k) + t0 * P;  // key t's pair p: kw[t * P + p]
    for (int64_t p = 0; p < P; ++p) {
      const __m512bh qv = (__m512bh)qt[p];
      for (int t = 0; t < 16; ++t)
        sc[t] = _mm512_dpbf16_ps(sc[t], qv, (__m512bh)_mm512_set1_epi32(static_cast<int>(kw[t * P + p])));
    }
    return;
  }
#endif
  if constexpr (std::is_same_v<T, float>) {
    const float* kr = k + t0 * D;
    for (int64_t d = 0; d < D; ++d) {
      const __m512 qv = qt[d];
      for (int t = 0; t < 16; ++t) sc[t] = _mm512_fmadd_ps(qv, _mm512_set1_ps(kr[t * D + d]), sc[t]);
    }
  }
}

template <typename T>
void prefill_rows(Tensor& out, const Tensor& q, const Tensor& kc, const Tensor& vc, const int64_t* table,
                  int64_t width, int64_t n, float scale) {
  const int64_t M = q.size(0), H = q.size(1), D = q.size(2), KVH = kc.size(1), BS = kc.size(2), G = H / KVH;
  const int64_t tiles = (M + 15) / 16, first = n - M, num_blocks = kc.size(0);
  constexpr bool pairs = std::is_same_v<T, c10::BFloat16>;
  const int64_t Q = pairs ? D / 2 : D;  // registers of transposed q: pairs of elements, or elements
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), os0 = out.stride(0), os1 = out.stride(1);
  for (int64_t j = 0; j < (n + BS - 1) / BS; ++j)
    TORCH_CHECK(j < width && table[j] >= 0 && table[j] < num_blocks, "block id out of range in the prefill's table");
  at::parallel_for(0, H * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512> qt(Q), acc(D), pt(BS);
    std::vector<__mmask16> seen(BS);  // the block's keys each row sees (key position <= the row's)
    std::vector<float> vf(BS * D);
    alignas(64) float col[16];
    alignas(64) uint32_t buf[16];
    alignas(64) int32_t lane_pos[16];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t hq = task / tiles, r0 = (task % tiles) * 16, h = hq / G, R = std::min<int64_t>(16, M - r0);
      for (int64_t i = 0; i < Q; ++i) {  // lanes past the chunk repeat its last row (their results are dropped)
        for (int64_t r = 0; r < 16; ++r)
          buf[r] = reinterpret_cast<const uint32_t*>(qp + (r0 + std::min(r, R - 1)) * qs0 + hq * qs1)[i];
        qt[i] = _mm512_load_ps(reinterpret_cast<const float*>(buf));
      }
      for (int64_t r = 0; r < 16; ++r) lane_pos[r] = static_cast<int32_t>(first + r0 + std::min(r, R - 1));
      const __m512i pos = _mm512_load_si512(lane_pos);
      const int64_t last = first + r0 + R - 1;  // the tile's last position: its keys are 0 .. last
      __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), lv = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; ++d) acc[d] = _mm512_setzero_ps();
      for (int64_t j = 0; j * BS <= last; ++j) {
        const int64_t cnt = std::min(BS, last + 1 - j * BS), base = (table[j] * KVH + h) * BS * D;
        __m512 bm = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
        for (int64_t t0 = 0; t0 < cnt; t0 += 16) {  // 16 keys at a time (BS % 16 == 0: all inside the block)
          __m512 sc[16];
          row_scores<T>(qt, kp + base, t0, D, sc);
          for (int64_t t = 0; t < std::min<int64_t>(16, cnt - t0); ++t) {
            seen[t0 + t] = _mm512_cmp_epi32_mask(_mm512_set1_epi32(static_cast<int>(j * BS + t0 + t)), pos,
                                                 _MM_CMPINT_LE);
            pt[t0 + t] = _mm512_mask_mul_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), seen[t0 + t],
                                            sc[t], _mm512_set1_ps(scale));
            bm = _mm512_max_ps(bm, pt[t0 + t]);
          }
        }
        const __m512 mnew = _mm512_max_ps(mv, bm);  // finite: key 0 is seen by every row
        const __m512 corr = exp16(_mm512_sub_ps(mv, mnew));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t t = 0; t < cnt; ++t) {  // (exp16 clamps: an unseen key's -inf would give 1e-38, not 0)
          pt[t] = _mm512_maskz_mov_ps(seen[t], exp16(_mm512_sub_ps(pt[t], mnew)));
          sum = _mm512_add_ps(sum, pt[t]);
        }
        lv = _mm512_fmadd_ps(lv, corr, sum);
        mv = mnew;
        const float* vr0 = nullptr;
        if constexpr (std::is_same_v<T, float>) {
          vr0 = vp + base;
        } else {
          for (int64_t t = 0; t < cnt; ++t)
            for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(vf.data() + t * D + d, load16(vp + base + t * D + d));
          vr0 = vf.data();
        }
        for (int64_t d0 = 0; d0 < D; d0 += 16) {  // 16 columns of the rows' accumulators in registers
          __m512 a[16];
          for (int i = 0; i < 16; ++i) a[i] = _mm512_mul_ps(acc[d0 + i], corr);
          for (int64_t t = 0; t < cnt; ++t) {
            const __m512 pv = pt[t];
            const float* vr = vr0 + t * D + d0;
            for (int i = 0; i < 16; ++i) a[i] = _mm512_fmadd_ps(pv, _mm512_set1_ps(vr[i]), a[i]);
          }
          for (int i = 0; i < 16; ++i) acc[d0 + i] = a[i];
        }
      }
      const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), lv);
      for (int64_t d = 0; d < D; ++d) {
        _mm512_store_ps(col, _mm512_mul_ps(acc[d], inv));
        for (int64_t r = 0; r < R; ++r) op[(r0 + r) * os0 + hq * os1 + d] = static_cast<T>(col[r]);
      }
    }
  });
}
#endif

// Whether paged_prefill_attention runs in this build for q over a cache of this dtype and shape.
bool prefill_applies(const Tensor& q, const Tensor& k_cache) {
  bool dtype_ok = false;
#if defined(KVPAGE_AVX512)
  if (q.scalar_type() == k_cache.scalar_type() && (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16))
    dispatch_float(q.scalar_type(), "paged_prefill_attention", [&](auto tag) { dtype_ok = prefill_kernel<decltype(tag)>(); });
#endif
  return dtype_ok && q.size(2) % 32 == 0 && q.size(2) <= 256 && k_cache.size(2) % 16 == 0;
}

bool paged_prefill_available(Tensor q, Tensor k_cache) { return prefill_applies(q, k_cache); }

void paged_prefill_attention(Tensor out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, int64_t seq_len,
                             double scale) {
  check_cache(k_cache, v_cache, "k_cache");
  TORCH_CHECK(prefill_applies(q, k_cache), "paged_prefill_attention takes q and a cache of one dtype (float32 in an "
              "AVX-512 build, bfloat16 with AVX512_BF16), head_dim % 32 == 0, block_size % 16 == 0");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && out.sizes() == q.sizes() && out.stride(2) == 1 &&
                  out.scalar_type() == q.scalar_type(), "q and out must be [tokens, heads, head_dim], rows contiguous");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(1) == 0, "q heads do not match the cache");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 1 && block_table.is_contiguous(),
              "block_table must be one sequence's int64 table");
  TORCH_CHECK(seq_len >= q.size(0) && seq_len <= block_table.size(0) * k_cache.size(2), "seq_len ", seq_len,
              " does not fit the chunk and its table");
#if defined(KVPAGE_AVX512)
  if (q.size(0) > 0)
    dispatch_float(q.scalar_type(), "paged_prefill_attention", [&](auto tag) {
      using T = decltype(tag);
      if constexpr (prefill_kernel<T>())
        prefill_rows<T>(out, q, k_cache, v_cache, block_table.data_ptr<int64_t>(), block_table.size(0), seq_len,
                        static_cast<float>(scale));
    });
#endif
}

void check_scales(const Tensor& cache, const Tensor& ks, const Tensor& vs) {
  TORCH_CHECK(cache.scalar_type() == at::kChar, "an int8 cache must be int8");
  for (const Tensor* t : {&ks, &vs})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == cache.size(0) &&
                    t->size(1) == cache.size(1) && t->size(2) == cache.size(2),
                "scales must be contiguous float32 [blocks, kv_heads, block_size]");
}

// The same over an int8 cache: each key / value row is widened times its token's scale as its block is read.
void paged_decode_attention_int8(Tensor out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_scale, Tensor v_scale,
                                 Tensor block_tables, Tensor seq_lens, double scale, std::optional<Tensor> k_min,
                                 std::optional<Tensor> k_max, std::optional<Tensor> read_blocks, int64_t sink,
                                 int64_t recent) {
  check_decode(out, q, k_cache, v_cache, block_tables, seq_lens);
  check_scales(k_cache, k_scale, v_scale);
  const float* ks = k_scale.data_ptr<float>();
  const float* vs = v_scale.data_ptr<float>();
  const BlockSelect sel = block_select(q, k_cache, k_min, k_max, read_blocks, sink, recent);
  dispatch_float(q.scalar_type(), "paged_decode_attention_int8", [&](auto tag) {
    decode_impl<decltype(tag), int8_t>(out, q, k_cache, v_cache, block_tables, seq_lens, scale, ks, vs, sel);
  });
}

// --- per-block key bounds: k_min / k_max [blocks, kv_heads, D] float32, the elementwise min and max of
// every slot of each block the slots touch (all B of them: a block's bound is exact once it is full,
// whatever order its slots were written or copied in; the last, partial block is always read anyway).
// int8 keys are widened times their scales first, exactly as the decode reads them.
template <typename C>
void bounds_impl(const Tensor& kc, const float* ksp, Tensor& kmin, Tensor& kmax, const Tensor& slots) {
  const int64_t KVH = kc.size(1), BS = kc.size(2), D = kc.size(3), NB = kc.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  std::vector<int64_t> blocks;
  for (int64_t i = 0; i < slots.numel(); ++i) {
    TORCH_CHECK(sp[i] >= 0 && sp[i] / BS < NB, "slot ", sp[i], " out of range");
    blocks.push_back(sp[i] / BS);
  }
  std::sort(blocks.begin(), blocks.end());
  blocks.erase(std::unique(blocks.begin(), blocks.end()), blocks.end());
  const C* kp = kc.data_ptr<C>();
  float* mnp = kmin.data_ptr<float>();
  float* mxp = kmax.data_ptr<float>();
  std::vector<float> row(BS * D);
  for (int64_t blk : blocks) {
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t base = (blk * KVH + h) * BS * D;
      if constexpr (std::is_same_v<C, int8_t>)
        widen_int8(kp + base, ksp + (blk * KVH + h) * BS, row.data(), BS, D);
      else
        to_float(kp + base, row.data(), BS * D);
      float* mn = mnp + (blk * KVH + h) * D;
      float* mx = mxp + (blk * KVH + h) * D;
      for (int64_t d = 0; d < D; ++d) mn[d] = mx[d] = row[d];
      for (int64_t t = 1; t < BS; ++t)
        for (int64_t d = 0; d < D; ++d) mn[d] = std::min(mn[d], row[t * D + d]), mx[d] = std::max(mx[d], row[t * D + d]);
    }
  }
}

void refresh_key_bounds(Tensor k_cache, std::optional<Tensor> k_scale, Tensor k_min, Tensor k_max, Tensor slots) {
  TORCH_CHECK(k_cache.is_contiguous() && k_cache.dim() == 4, "k_cache must be contiguous [blocks, kv_heads, block_size, head_dim]");
  for (const Tensor* t : {&k_min, &k_max})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == k_cache.size(0) &&
                    t->size(1) == k_cache.size(1) && t->size(2) == k_cache.size(3),
                "key bounds must be contiguous float32 [blocks, kv_heads, head_dim]");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots must be int64");
  if (k_cache.scalar_type() == at::kChar) {
    TORCH_CHECK(k_scale.has_value() && k_scale->defined() && k_scale->scalar_type() == at::kFloat && k_scale->is_contiguous(), "an int8 cache needs its float32 scales");
    bounds_impl<int8_t>(k_cache, k_scale->data_ptr<float>(), k_min, k_max, slots);
  } else {
    dispatch_float(k_cache.scalar_type(), "refresh_key_bounds", [&](auto tag) { bounds_impl<decltype(tag)>(k_cache, nullptr, k_min, k_max, slots); });
  }
}

// --- K/V write: k, v [T, KVH, D] (rows may be strided) -> cache slot s = block * B + offset ----

template <typename T>
void write_impl(const Tensor& k, const Tensor& v, Tensor& kc, Tensor& vc, const Tensor& slots) {
  const int64_t T_ = k.size(0), KVH = k.size(1), D = k.size(2), BS = kc.size(2), NB = kc.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* kcp = kc.data_ptr<T>();
  T* vcp = vc.data_ptr<T>();
  for (int64_t i = 0; i < T_; ++i) {
    const int64_t blk = sp[i] / BS, off = sp[i] % BS;
    TORCH_CHECK(sp[i] >= 0 && blk < NB, "slot ", sp[i], " out of range");
    for (int64_t h = 0; h < KVH; ++h) {
      const int64_t dst = ((blk * KVH + h) * BS + off) * D;
      std::memcpy(kcp + dst, kp + i * k.stride(0) + h * k.stride(1), D * sizeof(T));
      std::memcpy(vcp + dst, vp + i * v.stride(0) + h * v.stride(1), D * sizeof(T));
    }
  }
}

void check_write(const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache, const Tensor& slot_mapping) {
  check_cache(k_cache, v_cache, "k_cache");
  TORCH_CHECK(k.dim() == 3 && k.stride(2) == 1 && v.stride(2) == 1 && k.sizes() == v.sizes(), "k and v must be [tokens, kv_heads, head_dim]");
  TORCH_CHECK(k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(3), "k does not match the cache");
  TORCH_CHECK(v.scalar_type() == k.scalar_type(), "k and v must share a dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == k.size(0), "slot_mapping must be int64, one per token");
}

void write_kv(Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor slot_mapping) {
  check_write(k, v, k_cache, v_cache, slot_mapping);
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type(), "k, v and the cache must share a dtype");
  dispatch_float(k.scalar_type(), "write_kv", [&](auto tag) { write_impl<decltype(tag)>(k, v, k_cache, v_cache, slot_mapping); });
}

// int8 K/V write: per token and kv head, scale = max|x| / 127 (at least 1e-12 / 127), q = round-half-even(x / scale):
// the same operations, in the same float32 order, as kvpage/attention/kv_quant.py, so both write the same bytes.
template <typename T>
void write_int8_impl(const Tensor& k, const Tensor& v, Tensor& kc, Tensor& vc, Tensor& ks, Tensor& vs, const Tensor& slots) {
  const int64_t T_ = k.size(0), KVH = k.size(1), D = k.size(2), BS = kc.size(2), NB = kc.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  std::vector<float> row(D);
  for (int64_t i = 0; i < T_; ++i) {
    const int64_t blk = sp[i] / BS, off = sp[i] % BS;
    TORCH_CHECK(sp[i] >= 0 && blk < NB, "slot ", sp[i], " out of range");
    for (int64_t h = 0; h < KVH; ++h) {
      for (int which = 0; which < 2; ++which) {
        const Tensor& x = which ? v : k;
        to_float(x.data_ptr<T>() + i * x.stride(0) + h * x.stride(1), row.data(), D);
        float amax = 0.f;
        for (int64_t c = 0; c < D; ++c) amax = std::max(amax, std::fabs(row[c]));
        const float sc = std::max(amax, 1e-12f) / 127.f;
        int8_t* dst = (which ? vc : kc).data_ptr<int8_t>() + ((blk * KVH + h) * BS + off) * D;
        for (int64_t c = 0; c < D; ++c) dst[c] = static_cast<int8_t>(std::clamp(std::nearbyint(row[c] / sc), -127.f, 127.f));
        (which ? vs : ks).data_ptr<float>()[(blk * KVH + h) * BS + off] = sc;
      }
    }
  }
}

void write_kv_int8(Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor k_scale, Tensor v_scale, Tensor slot_mapping) {
  check_write(k, v, k_cache, v_cache, slot_mapping);
  check_scales(k_cache, k_scale, v_scale);
  dispatch_float(k.scalar_type(), "write_kv_int8", [&](auto tag) { write_int8_impl<decltype(tag)>(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping); });
}

// --- the small per-layer ops, fused; rows in parallel ------------------------------------------

inline float round_to(float x, float) { return x; }
inline float round_to(float x, c10::BFloat16) { return static_cast<float>(c10::BFloat16(x)); }

// out = weight * (x / rms(x)) as Hugging Face's LlamaRMSNorm computes it: statistics in float32,
// the normalised row rounded to the input dtype before the weight multiplies it. With `delta`,
// x += delta first (rounded to the dtype, as torch's add would) and x is updated in place.
template <typename T>
void rms_impl(Tensor& x, const Tensor* delta, const Tensor& w, Tensor& out, double eps) {
  const int64_t rows = x.size(0), D = x.size(1);
  T* xp = x.data_ptr<T>();
  const T* dp = delta ? delta->data_ptr<T>() : nullptr;
  const int64_t xs = x.stride(0), ds = delta ? delta->stride(0) : 0, os = out.stride(0);
  const T* wp = w.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / D), [&](int64_t b, int64_t e) {
    std::vector<float> r(D), wf(D), dr(D);
    to_float(wp, wf.data(), D);
    for (int64_t i = b; i < e; ++i) {
      to_float(xp + i * xs, r.data(), D);
      if (dp) {
        to_float(dp + i * ds, dr.data(), D);
        for (int64_t j = 0; j < D; ++j) r[j] = round_to(r[j] + dr[j], T());
        from_float(r.data(), xp + i * xs, D);
      }
      float ss = 0.f;
      for (int64_t j = 0; j < D; ++j) ss += r[j] * r[j];
      const float inv = 1.f / std::sqrt(ss / D + static_cast<float>(eps));
      for (int64_t j = 0; j < D; ++j) r[j] = wf[j] * round_to(r[j] * inv, T());
      from_float(r.data(), op + i * os, D);
    }
  });
}

Tensor rms_norm_common(Tensor x, const Tensor* delta, Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous() && weight.numel() == x.size(1), "rms_norm: x [rows, dim] and weight [dim]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight and x dtypes differ");
  if (delta) TORCH_CHECK(delta->sizes() == x.sizes() && delta->stride(1) == 1 && delta->scalar_type() == x.scalar_type(), "add_rms_norm: delta must match x");
  Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  dispatch_float(x.scalar_type(), "rms_norm", [&](auto tag) { rms_impl<decltype(tag)>(x, delta, weight, out, eps); });
  return out;
}

Tensor rms_norm(Tensor x, Tensor weight, double eps) { return rms_norm_common(x, nullptr, weight, eps); }

Tensor add_rms_norm(Tensor x, Tensor delta, Tensor weight, double eps) { return rms_norm_common(x, &delta, weight, eps); }

// In place on the fused qkv rows [T, (H + 2 KVH) * D]: rotate the first H + KVH heads (q and k)
// by cos/sin [T, D] (Hugging Face's rotate-half layout; only the first D/2 columns are read).
template <typename T>
void rope_impl(Tensor& qkv, const Tensor& cos, const Tensor& sin, int64_t heads, int64_t D) {
  const int64_t rows = qkv.size(0), half = D / 2, qs = qkv.stride(0), cs = cos.stride(0), ss = sin.stride(0);
  T* p = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / (heads * D)), [&](int64_t b, int64_t e) {
    std::vector<float> c(half), s(half), x(D), y(D);
    for (int64_t i = b; i < e; ++i) {
      to_float(cp + i * cs, c.data(), half);
      to_float(sp + i * ss, s.data(), half);
      for (int64_t h = 0; h < heads; ++h) {
        T* row = p + i * qs + h * D;
        to_float(row, x.data(), D);
        for (int64_t j = 0; j < half; ++j) {
          y[j] = x[j] * c[j] - x[j + half] * s[j];
          y[j + half] = x[j + half] * c[j] + x[j] * s[j];
        }
        from_float(y.data(), row, D);
      }
    }
  });
}

void rope_(Tensor qkv, Tensor cos, Tensor sin, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= heads * head_dim && head_dim % 2 == 0, "rope_: qkv [tokens, width] with room for the heads");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == qkv.size(0) && cos.size(1) == head_dim && cos.stride(1) == 1 && sin.stride(1) == 1, "rope_: cos/sin [tokens, head_dim]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(), "rope_: dtypes differ");
  dispatch_float(qkv.scalar_type(), "rope_", [&](auto tag) { rope_impl<decltype(tag)>(qkv, cos, sin, heads, head_dim); });
}

// [T, 2I] (gate | up) -> [T, I]: silu(gate) * up, silu rounded to the dtype first as torch's would be.
template <typename T>
void silu_impl(const Tensor& gu, Tensor& out) {
  const int64_t rows = gu.size(0), I = out.size(1), gs = gu.stride(0);
  const T* gp = gu.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / I), [&](int64_t b, int64_t e) {
    std::vector<float> g(I), u(I);
    for (int64_t i = b; i < e; ++i) {
      to_float(gp + i * gs, g.data(), I);
      to_float(gp + i * gs + I, u.data(), I);
      silu_inplace(g.data(), I);
      for (int64_t j = 0; j < I; ++j) g[j] = round_to(g[j], T()) * u[j];
      from_float(g.data(), op + i * I, I);
    }
  });
}

Tensor silu_mul(Tensor gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0, "silu_mul: [tokens, 2 * intermediate]");
  Tensor out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  dispatch_float(gate_up.scalar_type(), "silu_mul", [&](auto tag) { silu_impl<decltype(tag)>(gate_up, out); });
  return out;
}

// --- y = x @ w.T (+ bias) for a few rows: memory-bound, so one pass over w, split over threads ----
// x [M, K], w [N, K] (rows contiguous), bias [N] or empty. Each thread owns a range of output
// columns and streams its rows of w once for all M rows of x; sums in float32.

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
// R rows of w against MM rows of x (float32, K a multiple of 8): out[m * ostride + r]
template <int R, int MM, typename T>
inline void tile(const float* xf, int64_t K, const T* w, int64_t ws, float* out, int64_t ostride) {
  __m256 acc[R][MM];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 xv[MM];
    for (int m = 0; m < MM; ++m) xv[m] = _mm256_loadu_ps(xf + m * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 wv = load8(w + r * ws + k);
      for (int m = 0; m < MM; ++m) acc[r][m] = _mm256_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) out[m * ostride + r] = hsum(acc[r][m]);
}
// one row of w against one x, four accumulators along K: a single sequential stream (the fastest
// way to read a weight for one row of x: ~15% faster than tile<4, 1>'s four streams)
template <typename T>
inline float row_dot(const float* xf, int64_t K, const T* w) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    a0 = _mm256_fmadd_ps(load8(w + k), _mm256_loadu_ps(xf + k), a0);
    a1 = _mm256_fmadd_ps(load8(w + k + 8), _mm256_loadu_ps(xf + k + 8), a1);
    a2 = _mm256_fmadd_ps(load8(w + k + 16), _mm256_loadu_ps(xf + k + 16), a2);
    a3 = _mm256_fmadd_ps(load8(w + k + 24), _mm256_loadu_ps(xf + k + 24), a3);
  }
  for (; k < K; k += 8) a0 = _mm256_fmadd_ps(load8(w + k), _mm256_loadu_ps(xf + k), a0);
  return hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}
// one_order: a single row of x takes tile's order too (one accumulator over K, eight floats at a time,
// then one horizontal sum), so a row gets the same bits alone as in a batch or a prefill chunk, where
// every output is summed that way (deterministic mode); otherwise one row takes row_dot.
// One row of w at a time (tile<1, MM>): a sequential stream per thread. Four or two rows at once read a
// float32 weight at 14-19 GB/s where one row reads it at 20-29 (2 / 3 / 4 rows of x, and one in one_order;
// 2-core Zen 4, gate/up of SmolLM2 from memory), with the same bits (each sum's order is the tile's).
template <int MM, typename T>
void rows_avx2(const float* xf, int64_t K, const T* w, int64_t ws, int64_t b, int64_t e, float* out, int64_t ostride,
               bool one_order) {
  if (MM == 1 && !one_order) {
    for (int64_t n = b; n < e; ++n) out[n - b] = row_dot(xf, K, w + n * ws);
    return;
  }
  for (int64_t n = b; n < e; ++n) tile<1, MM>(xf, K, w + n * ws, ws, out + (n - b), ostride);
}
#endif

// Rows of x (any dtype) widened to float32, one after the other: [M, K].
template <typename T>
std::vector<float> widen_rows(const T* x, int64_t M, int64_t K, int64_t stride) {
  std::vector<float> xf(M * K);
  for (int64_t m = 0; m < M; ++m) to_float(x + m * stride, xf.data() + m * K, K);
  return xf;
}

// f(std::integral_constant<int, MM>{}, m0) for each group of up to 4 rows of x: rows m0 .. m0 + MM - 1
// (the row kernels are templates on the group's size, which keeps their accumulators in registers).
template <typename F>
inline void for_each_row_group(int64_t M, F&& f) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    switch (std::min<int64_t>(4, M - m0)) {
      case 1: f(std::integral_constant<int, 1>{}, m0); break;
      case 2: f(std::integral_constant<int, 2>{}, m0); break;
      case 3: f(std::integral_constant<int, 3>{}, m0); break;
      default: f(std::integral_constant<int, 4>{}, m0); break;
    }
  }
}

// out[m * ostride + (n - n0)] = x_m . w_n for the M float32 rows of xf and the rows n in [n0, n1) of w.
// 64 rows of w at a time stay in L2 while every group of up to 4 rows of x passes over them.
template <typename T>
void rows_times_x(const float* xf, int64_t M, int64_t K, const T* w, int64_t ws, int64_t n0, int64_t n1, float* out,
                  int64_t ostride, bool one_order = false) {
#if defined(__AVX2__) && defined(__FMA__)
  if (K % 8 == 0) {
    for (int64_t nb = n0; nb < n1; nb += 64) {
      const int64_t ne = std::min(n1, nb + 64);
      for_each_row_group(M, [&](auto mm, int64_t m0) {
        rows_avx2<decltype(mm)::value>(xf + m0 * K, K, w, ws, nb, ne, out + m0 * ostride + (nb - n0), ostride,
                                       one_order);
      });
    }
    return;
  }
#endif
  std::vector<float> row(K);
  for (int64_t n = n0; n < n1; ++n) {
    to_float(w + n * ws, row.data(), K);
    for (int64_t m = 0; m < M; ++m) out[m * ostride + (n - n0)] = dot(xf + m * K, row.data(), K);
  }
}

// y[m, n0:n1] = out[m] (+ bias[n0:n1]), out holding M rows of n1 - n0 float32 sums.
template <typename B, typename T>
void store_rows(float* out, int64_t M, int64_t n0, int64_t n1, const B* bias, T* y, int64_t N) {
  const int64_t cols = n1 - n0;
  for (int64_t m = 0; m < M; ++m) {
    float* om = out + m * cols;
    if (bias)
      for (int64_t n = n0; n < n1; ++n) om[n - n0] += static_cast<float>(bias[n]);
    from_float(om, y + m * N + n0, cols);
  }
}

// Whether x's rows are multiplied as they are, not widened to float32 first: bfloat16 on AVX512_BF16.
template <typename T>
inline bool rows_direct(int64_t) { return false; }
template <typename T>
inline void rows_times_x_direct(const T*, int64_t, int64_t, int64_t, const T*, int64_t, int64_t, int64_t, float*,
                                int64_t) {}  // only where rows_direct<T> is true

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// bfloat16 x and w on CPUs with AVX512_BF16: VDPBF16PS multiplies 32 pairs of bfloat16 exactly and adds
// them into 16 float32 sums, one instruction per 64 bytes of w (the AVX2 path widens 8 at a time and
// streams at half the memory bus's speed). R rows of w against MM rows of x; K a multiple of 32.
template <int R, int MM>
inline void tile_bf16(const c10::BFloat16* x, int64_t xs, int64_t K, const c10::BFloat16* w, int64_t ws, float* out,
                      int64_t ostride) {
  __m512 acc[R][MM];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh xv[MM];
    for (int m = 0; m < MM; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(x + m * xs + k);
    for (int r = 0; r < R; ++r) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + r * ws + k);
      for (int m = 0; m < MM; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MM; ++m) out[m * ostride + r] = _mm512_reduce_add_ps(acc[r][m]);
}

// One row of w at a time: each thread reads w as one sequential stream. Four rows at once (four streams a row
// apart, x loaded once for them) read it at 21 GB/s where one row reads it at 25-33 (SmolLM2's gate/up, one row
// of x, 2-core Zen 4), and slower at 2-8 rows of x too. Each sum keeps its order (one accumulator along K), so
// the bits are the four-row tile's: batch invariance holds.
template <int MM>
void rows_bf16(const c10::BFloat16* x, int64_t xs, int64_t K, const c10::BFloat16* w, int64_t ws, int64_t b, int64_t e,
               float* out, int64_t ostride) {
  for (int64_t n = b; n < e; ++n) tile_bf16<1, MM>(x, xs, K, w + n * ws, ws, out + (n - b), ostride);
}

template <>
inline bool rows_direct<c10::BFloat16>(int64_t K) { return K % 32 == 0; }

// out as rows_times_x, for bfloat16 x (M rows, stride xs) and w, K a multiple of 32.
template <>
inline void rows_times_x_direct(const c10::BFloat16* x, int64_t xs, int64_t M, int64_t K, const c10::BFloat16* w,
                                int64_t ws, int64_t n0, int64_t n1, float* out, int64_t ostride) {
  for_each_row_group(M, [&](auto mm, int64_t m0) {
    rows_bf16<decltype(mm)::value>(x + m0 * xs, xs, K, w, ws, n0, n1, out + m0 * ostride, ostride);
  });
}
#endif

template <typename T>
void linear_rows_impl(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y, bool one_order) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const T* wp = w.data_ptr<T>();
  const T* bp = bias.defined() ? bias.data_ptr<T>() : nullptr;
  T* yp = y.data_ptr<T>();
  const bool direct = rows_direct<T>(K);
  const std::vector<float> xf = direct ? std::vector<float>() : widen_rows(x.data_ptr<T>(), M, K, x.stride(0));
  at::parallel_for(0, N, 64, [&](int64_t b, int64_t e) {
    std::vector<float> out(M * (e - b));
    if (direct)
      rows_times_x_direct(x.data_ptr<T>(), x.stride(0), M, K, wp, w.stride(0), b, e, out.data(), e - b);
    else
      rows_times_x(xf.data(), M, K, wp, w.stride(0), b, e, out.data(), e - b, one_order);
    store_rows(out.data(), M, b, e, bp, yp, N);
  });
}

// one_order: every row of x summed in the same order whatever the number of rows (see rows_avx2).
Tensor linear_rows(Tensor x, Tensor w, std::optional<Tensor> bias, bool one_order) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear_rows: x [rows, in] with contiguous rows");
  TORCH_CHECK(w.dim() == 2 && w.stride(1) == 1 && w.size(1) == x.size(1), "linear_rows: w [out, in] with contiguous rows");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "linear_rows: x and w dtypes differ");
  Tensor b = bias.has_value() ? *bias : Tensor();
  if (b.defined()) TORCH_CHECK(b.is_contiguous() && b.numel() == w.size(0) && b.scalar_type() == x.scalar_type(), "linear_rows: bias [out]");
  Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  if (x.size(0) == 0) return y;
  dispatch_float(x.scalar_type(), "linear_rows", [&](auto tag) { linear_rows_impl<decltype(tag)>(x, w, b, y, one_order); });
  return y;
}

// --- weight-only quantized linear: groups of 32 weights along K, float16 scales -------------------
// int8: q int8 [N, K], w = d * q (llama.cpp's Q8_0 scheme). int4: q uint8 [N, K / 2], w = d * q + min
// with q in 0..15 (the Q4_1 scheme); in group g, byte j holds element 32g + j (low nibble) and
// 32g + 16 + j (high nibble). Each thread widens 16 rows at a time to float32 in a small buffer that
// stays in cache, then runs the float32 row kernel over it for every row of x: the weights cross the
// memory bus at 1.06 or 0.63 bytes each (d and min float16, as llama.cpp stores them) instead of 4.

// Three streams per row (levels, scales, mins) and little work per byte: the hardware prefetcher
// alone left a one-row int4 product at ~5 GB/s from memory (~19 GB/s from cache; Sapphire Rapids,
// 2 cores). Asking for row n + 8 while row n computes keeps the bus busy (~15 GB/s).
constexpr int64_t kPrefetchRows = 8;

// A float16 scale (or min) as float.
inline float half_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
#endif
}

// (always inlined: as a call it left the product as slow as without it, ~3x)
__attribute__((always_inline)) inline void prefetch_quant_row(int bits, const uint8_t* q, const uint16_t* d, const uint16_t* mn, int64_t K, int64_t n) {
#if defined(__SSE__)
  const int64_t groups = K / 32, row_bytes = bits == 8 ? K : K / 2;
  for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(q + n * row_bytes + off), _MM_HINT_T0);
  for (int64_t off = 0; off < groups; off += 32) {  // 32 float16 scales a cache line
    _mm_prefetch(reinterpret_cast<const char*>(d + n * groups + off), _MM_HINT_T0);
    if (bits == 4) _mm_prefetch(reinterpret_cast<const char*>(mn + n * groups + off), _MM_HINT_T0);
  }
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
// The 32 levels of group g of weight row n as floats (int8: -127..127, int4: 0..15), in registers.
inline void widen_group(int bits, const uint8_t* q, int64_t K, int64_t n, int64_t g, __m256 lv[4]) {
  if (bits == 8) {
    const int8_t* qg = reinterpret_cast<const int8_t*>(q) + n * K + 32 * g;
    for (int j = 0; j < 4; ++j)
      lv[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qg + 8 * j))));
    return;
  }
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * (K / 2) + 16 * g));
  const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  lv[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  lv[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  lv[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  lv[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}
#endif

// Rows [n0, n1) of the weight, widened to float32 into buf ([n1 - n0, K]): d * q (+ min), as the reference.
inline void dequant_rows(int bits, const uint8_t* q, const uint16_t* d, const uint16_t* mn, int64_t K, int64_t n0,
                         int64_t n1, float* buf) {
  const int64_t groups = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    if (n + kPrefetchRows < n1) prefetch_quant_row(bits, q, d, mn, K, n + kPrefetchRows);
    for (int64_t g = 0; g < groups; ++g) {
      const float dg = half_float(d[n * groups + g]), mg = bits == 4 ? half_float(mn[n * groups + g]) : 0.f;
      float* o = buf + (n - n0) * K + 32 * g;
#if defined(__AVX2__) && defined(__FMA__)
      __m256 lv[4];
      widen_group(bits, q, K, n, g, lv);
      const __m256 dv = _mm256_set1_ps(dg), mv = _mm256_set1_ps(mg);
      for (int j = 0; j < 4; ++j) {
        const __m256 w = _mm256_mul_ps(dv, lv[j]);
        _mm256_storeu_ps(o + 8 * j, bits == 4 ? _mm256_add_ps(w, mv) : w);
      }
#else
      if (bits == 8) {
        const int8_t* qg = reinterpret_cast<const int8_t*>(q) + n * K + 32 * g;
        for (int j = 0; j < 32; ++j) o[j] = dg * static_cast<float>(qg[j]);
      } else {
        const uint8_t* qg = q + n * (K / 2) + 16 * g;
        for (int j = 0; j < 16; ++j) {
          o[j] = dg * static_cast<float>(qg[j] & 0x0F) + mg;
          o[j + 16] = dg * static_cast<float>(qg[j] >> 4) + mg;
        }
      }
#endif
    }
  }
}

Tensor dequantize_weight(Tensor q, Tensor scales, std::optional<Tensor> mins, int64_t bits) {
  TORCH_CHECK(bits == 8 || bits == 4, "dequantize_weight: bits must be 8 or 4");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2, "dequantize_weight: scales float16 [out, in / 32]");
  const int64_t N = scales.size(0), K = scales.size(1) * 32;
  TORCH_CHECK(q.is_contiguous() && q.dim() == 2 && q.size(0) == N && q.size(1) == (bits == 8 ? K : K / 2), "dequantize_weight: q shape");
  TORCH_CHECK(q.scalar_type() == (bits == 8 ? at::kChar : at::kByte), "dequantize_weight: q int8 for 8 bits, uint8 for 4");
  Tensor mn = mins.has_value() ? *mins : Tensor();
  TORCH_CHECK(bits == 8 || (mn.defined() && mn.sizes() == scales.sizes() && mn.is_contiguous() && mn.scalar_type() == at::kHalf), "dequantize_weight: 4 bits need mins");
  Tensor w = at::empty({N, K}, scales.options().dtype(at::kFloat));
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const uint16_t* dp = static_cast<const uint16_t*>(scales.data_ptr());
  const uint16_t* mp = mn.defined() ? static_cast<const uint16_t*>(mn.data_ptr()) : nullptr;
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t e) { dequant_rows(static_cast<int>(bits), qp, dp, mp, K, b, e, wp + b * K); });
  return w;
}

// The few-rows path without the float32 buffer: each group's levels are widened in registers and
// multiplied with x there; the scale is applied once per group, and int4's min through the group
// sums of x (sum_j x_j (d q_j + min) = d sum_j x_j q_j + min sum_j x_j). False where it does not
// apply (more than 4 rows, or no AVX2): the caller widens into a buffer instead.
#if defined(__AVX2__) && defined(__FMA__)
template <int MM>
void rows_quant_avx2(int bits, const float* xf, const float* xsum, int64_t K, const uint8_t* q, const uint16_t* d,
                     const uint16_t* mn, int64_t b, int64_t e, float* out, int64_t ostride) {
  const int64_t groups = K / 32;
  for (int64_t n = b; n < e; ++n) {
    if (n + kPrefetchRows < e) prefetch_quant_row(bits, q, d, mn, K, n + kPrefetchRows);
    __m256 acc[MM];
    float minterm[MM];
    for (int m = 0; m < MM; ++m) acc[m] = _mm256_setzero_ps(), minterm[m] = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      __m256 lv[4];
      widen_group(bits, q, K, n, g, lv);
      const __m256 dv = _mm256_set1_ps(half_float(d[n * groups + g]));
      const float mg = bits == 4 ? half_float(mn[n * groups + g]) : 0.f;
      for (int m = 0; m < MM; ++m) {
        const float* xg = xf + m * K + 32 * g;
        __m256 t = _mm256_mul_ps(lv[0], _mm256_loadu_ps(xg));
        t = _mm256_fmadd_ps(lv[1], _mm256_loadu_ps(xg + 8), t);
        t = _mm256_fmadd_ps(lv[2], _mm256_loadu_ps(xg + 16), t);
        t = _mm256_fmadd_ps(lv[3], _mm256_loadu_ps(xg + 24), t);
        acc[m] = _mm256_fmadd_ps(dv, t, acc[m]);
        if (bits == 4) minterm[m] += mg * xsum[m * groups + g];
      }
    }
    for (int m = 0; m < MM; ++m) out[m * ostride + (n - b)] = hsum(acc[m]) + minterm[m];
  }
}
#endif

inline bool few_rows_quant(int bits, int64_t M, const float* xf, const float* xsum, int64_t K, const uint8_t* q,
                           const uint16_t* d, const uint16_t* mn, int64_t b, int64_t e, float* out) {
#if defined(__AVX2__) && defined(__FMA__)
  switch (M) {
    case 1: rows_quant_avx2<1>(bits, xf, xsum, K, q, d, mn, b, e, out, e - b); return true;
    case 2: rows_quant_avx2<2>(bits, xf, xsum, K, q, d, mn, b, e, out, e - b); return true;
    case 3: rows_quant_avx2<3>(bits, xf, xsum, K, q, d, mn, b, e, out, e - b); return true;
    case 4: rows_quant_avx2<4>(bits, xf, xsum, K, q, d, mn, b, e, out, e - b); return true;
    default: return false;
  }
#else
  return false;
#endif
}

template <typename T>
void linear_quant_impl(const Tensor& x, int bits, const Tensor& q, const Tensor& d, const Tensor& mn,
                       const Tensor& bias, Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = d.size(0);
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const uint16_t* dp = static_cast<const uint16_t*>(d.data_ptr());
  const uint16_t* mp = mn.defined() ? static_cast<const uint16_t*>(mn.data_ptr()) : nullptr;
  const float* bp = bias.defined() ? bias.data_ptr<float>() : nullptr;
  T* yp = y.data_ptr<T>();
  const std::vector<float> xf = widen_rows(x.data_ptr<T>(), M, K, x.stride(0));
  std::vector<float> xsum(M * (K / 32), 0.f);
  for (int64_t i = 0; i < M * K; ++i) xsum[i / 32] += xf[i];  // rows are K = 32 * groups long
  constexpr int64_t kRows = 16;
  at::parallel_for(0, N, kRows, [&](int64_t b, int64_t e) {
    const int64_t cols = e - b;
    std::vector<float> out(M * cols);
    if (!few_rows_quant(bits, M, xf.data(), xsum.data(), K, qp, dp, mp, b, e, out.data())) {
      std::vector<float> buf(kRows * K);  // 16 rows widened at a time, still in cache when x passes
      for (int64_t nb = b; nb < e; nb += kRows) {
        const int64_t ne = std::min(e, nb + kRows);
        dequant_rows(bits, qp, dp, mp, K, nb, ne, buf.data());
        rows_times_x(xf.data(), M, K, buf.data(), K, 0, ne - nb, out.data() + (nb - b), cols);
      }
    }
    store_rows(out.data(), M, b, e, bp, yp, N);
  });
}

Tensor linear_quant(Tensor x, Tensor q, Tensor scales, std::optional<Tensor> mins, int64_t bits, std::optional<Tensor> bias) {
  TORCH_CHECK(bits == 8 || bits == 4, "linear_quant: bits must be 8 or 4");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 32 == 0, "linear_quant: x [rows, in], in a multiple of 32");
  const int64_t K = x.size(1), N = scales.size(0);
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.dim() == 2 && scales.size(1) == K / 32, "linear_quant: scales float16 [out, in / 32]");
  TORCH_CHECK(q.is_contiguous() && q.dim() == 2 && q.size(0) == N && q.size(1) == (bits == 8 ? K : K / 2), "linear_quant: q [out, in] (int8) or [out, in / 2] (int4)");
  TORCH_CHECK(q.scalar_type() == (bits == 8 ? at::kChar : at::kByte), "linear_quant: q int8 for 8 bits, uint8 for 4");
  Tensor mn = mins.has_value() ? *mins : Tensor();
  TORCH_CHECK(bits == 8 || (mn.defined() && mn.sizes() == scales.sizes() && mn.scalar_type() == at::kHalf && mn.is_contiguous()), "linear_quant: 4 bits need mins like scales");
  Tensor b = bias.has_value() ? *bias : Tensor();
  if (b.defined()) TORCH_CHECK(b.is_contiguous() && b.numel() == N && b.scalar_type() == at::kFloat, "linear_quant: bias float32 [out]");
  Tensor y = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0) return y;
  dispatch_float(x.scalar_type(), "linear_quant", [&](auto tag) { linear_quant_impl<decltype(tag)>(x, static_cast<int>(bits), q, scales, mn, b, y); });
  return y;
}

// --- every layer of a decode step in one call ---------------------------------------------------
// What kvpage/models/llama.py does per layer with KernelLayerOps and the CPU paged backend, op for op
// and in the same order (so the result is bit-identical), for steps whose every sequence decodes one
// token: at one to a few sequences the ~12 Python-side calls per layer cost ~15% of a step whose
// weights the memory bus reads in ~17 ms. x [T, hidden] is the residual stream (updated in place);
// returns the final norm of it. Per layer, `weights` holds 14 tensors: input norm, post-attention
// norm, then (w, scales, mins) for qkv, o, gate_up and down: w the weight itself when bits == 0,
// else the quantized q with its scales (and mins for 4 bits; empty tensors where unused).
// kernel_linear: the row kernels (linear_rows / linear_quant) rather than torch's GEMM, the choice
// KernelLayerOps.linear makes for this many rows. k_scales / v_scales: per layer for an int8 cache, else empty.

constexpr int64_t PER_LAYER = 14;

Tensor any_linear(const Tensor& x, const Tensor* w3, int64_t bits, const Tensor& bias, bool kernel, bool one_order) {
  const std::optional<Tensor> b = bias.defined() ? std::optional<Tensor>(bias) : std::nullopt;
  if (bits == 0) return kernel ? linear_rows(x, w3[0], b, one_order) : at::linear(x, w3[0], b);
  const std::optional<Tensor> mins = bits == 4 ? std::optional<Tensor>(w3[2]) : std::nullopt;
  if (kernel) return linear_quant(x.contiguous(), w3[0], w3[1], mins, bits, b ? std::optional<Tensor>(b->to(at::kFloat)) : std::nullopt);
  const Tensor w = dequantize_weight(w3[0], w3[1], mins, bits).to(x.scalar_type());
  return at::linear(x, w, b ? std::optional<Tensor>(b->to(x.scalar_type())) : std::nullopt);
}

// One layer's attention half: the input norm (of x + delta, x updated in place; of x alone for the first
// layer), q/k/v, RoPE, the new K/V written, paged attention, o_proj. Returns o_proj's output: the
// post-attention norm's delta (under tensor parallelism this rank's partial sum, all-reduced first).
// w: the layer's PER_LAYER weights; k_scale / v_scale undefined unless the cache is int8.
Tensor attention_part(Tensor& x, const Tensor& delta, const Tensor& cos, const Tensor& sin, const Tensor* w, int64_t bits,
                      const Tensor& bias, const Tensor& k_cache, const Tensor& v_cache, const Tensor& k_scale,
                      const Tensor& v_scale, const Tensor& block_tables, const Tensor& seq_lens, const Tensor& slot_mapping,
                      int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale, bool kernel_linear,
                      bool one_order, const std::optional<Tensor>& mn, const std::optional<Tensor>& mx,
                      const std::optional<Tensor>& read_blocks, int64_t sink, int64_t recent) {
  const int64_t T = x.size(0), qs = heads * head_dim, kvs = kv_heads * head_dim;
  Tensor h = delta.defined() ? add_rms_norm(x, delta, w[0], eps) : rms_norm(x, w[0], eps);
  Tensor qkv = any_linear(h, w + 2, bits, bias, kernel_linear, one_order);
  rope_(qkv, cos, sin, heads + kv_heads, head_dim);
  Tensor q = qkv.narrow(1, 0, qs).view({T, heads, head_dim});
  Tensor k = qkv.narrow(1, qs, kvs).view({T, kv_heads, head_dim});
  Tensor v = qkv.narrow(1, qs + kvs, kvs).view({T, kv_heads, head_dim});
  Tensor o = at::empty({T, heads, head_dim}, q.options());
  if (k_scale.defined()) {
    write_kv_int8(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping);
    if (mn) refresh_key_bounds(k_cache, k_scale, *mn, *mx, slot_mapping);
    paged_decode_attention_int8(o, q, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, scale, mn, mx,
                                read_blocks, sink, recent);
  } else {
    write_kv(k, v, k_cache, v_cache, slot_mapping);
    if (mn) refresh_key_bounds(k_cache, std::nullopt, *mn, *mx, slot_mapping);
    paged_decode_attention(o, q, k_cache, v_cache, block_tables, seq_lens, scale, mn, mx, read_blocks, sink, recent);
  }
  return any_linear(o.view({T, qs}), w + 5, bits, Tensor(), kernel_linear, one_order);
}

// The MLP half: x += attn, its post-attention norm, gate/up, SiLU, down. Returns down's output: the next
// layer's delta (under tensor parallelism this rank's partial sum, all-reduced first).
Tensor mlp_part(Tensor& x, const Tensor& attn, const Tensor* w, int64_t bits, double eps, bool kernel_linear,
                bool one_order) {
  Tensor h = add_rms_norm(x, attn, w[1], eps);
  return any_linear(silu_mul(any_linear(h, w + 8, bits, Tensor(), kernel_linear, one_order)), w + 11, bits, Tensor(),
                    kernel_linear, one_order);
}

Tensor decode_layers(Tensor x, Tensor cos, Tensor sin, at::TensorList weights, int64_t bits, at::TensorList qkv_bias,
                     at::TensorList k_caches, at::TensorList v_caches, at::TensorList k_scales, at::TensorList v_scales,
                     Tensor block_tables, Tensor seq_lens, Tensor slot_mapping, Tensor final_norm, int64_t heads,
                     int64_t kv_heads, int64_t head_dim, double eps, double scale, bool kernel_linear,
                     bool one_order, at::TensorList k_mins, at::TensorList k_maxs, std::optional<Tensor> read_blocks,
                     int64_t sink, int64_t recent) {
  const int64_t L = static_cast<int64_t>(k_caches.size()), T = x.size(0);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == L * PER_LAYER && static_cast<int64_t>(v_caches.size()) == L, "decode_layers: ", PER_LAYER, " weights and a K and V cache per layer");
  TORCH_CHECK(qkv_bias.empty() || static_cast<int64_t>(qkv_bias.size()) == L, "decode_layers: a qkv bias per layer or none");
  const bool int8 = !k_scales.empty();
  TORCH_CHECK(!int8 || (static_cast<int64_t>(k_scales.size()) == L && static_cast<int64_t>(v_scales.size()) == L), "decode_layers: int8 scales per layer");
  TORCH_CHECK(block_tables.size(0) == T && seq_lens.numel() == T, "decode_layers: one token per sequence");
  const bool bounded = !k_mins.empty();
  TORCH_CHECK(!bounded || (static_cast<int64_t>(k_mins.size()) == L && static_cast<int64_t>(k_maxs.size()) == L), "decode_layers: key bounds per layer (empty where a layer keeps none)");
  Tensor delta;
  for (int64_t l = 0; l < L; ++l) {
    const Tensor* w = weights.data() + l * PER_LAYER;
    // this layer's key bounds, if it keeps them (the first layers read densely and keep none)
    const bool lb = bounded && k_mins[l].numel() > 0;
    const std::optional<Tensor> mn = lb ? std::optional<Tensor>(k_mins[l]) : std::nullopt;
    const std::optional<Tensor> mx = lb ? std::optional<Tensor>(k_maxs[l]) : std::nullopt;
    Tensor attn = attention_part(x, delta, cos, sin, w, bits, qkv_bias.empty() ? Tensor() : qkv_bias[l], k_caches[l],
                                 v_caches[l], int8 ? k_scales[l] : Tensor(), int8 ? v_scales[l] : Tensor(), block_tables,
                                 seq_lens, slot_mapping, heads, kv_heads, head_dim, eps, scale, kernel_linear, one_order,
                                 mn, mx, read_blocks, sink, recent);
    delta = mlp_part(x, attn, w, bits, eps, kernel_linear, one_order);
  }
  return add_rms_norm(x, delta, final_norm, eps);
}

// decode_layers' two halves of one layer, for a tensor-parallel rank that all-reduces each half's
// output between them (kvpage/worker/fused_decode.py); the same functions, so the same bits.
Tensor decode_attention_part(Tensor x, std::optional<Tensor> delta, Tensor cos, Tensor sin, at::TensorList weights,
                             int64_t bits, std::optional<Tensor> qkv_bias, Tensor k_cache, Tensor v_cache,
                             std::optional<Tensor> k_scale, std::optional<Tensor> v_scale, Tensor block_tables,
                             Tensor seq_lens, Tensor slot_mapping, int64_t heads, int64_t kv_heads, int64_t head_dim,
                             double eps, double scale, bool kernel_linear, bool one_order, std::optional<Tensor> k_min,
                             std::optional<Tensor> k_max, std::optional<Tensor> read_blocks, int64_t sink, int64_t recent) {
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == PER_LAYER, "decode_attention_part: ", PER_LAYER, " weights of one layer");
  TORCH_CHECK(block_tables.size(0) == x.size(0) && seq_lens.numel() == x.size(0), "decode_attention_part: one token per sequence");
  TORCH_CHECK(k_scale.has_value() == v_scale.has_value(), "decode_attention_part: both int8 scales or neither");
  TORCH_CHECK(k_min.has_value() == k_max.has_value(), "decode_attention_part: both key bounds or neither");
  return attention_part(x, delta ? *delta : Tensor(), cos, sin, weights.data(), bits, qkv_bias ? *qkv_bias : Tensor(),
                        k_cache, v_cache, k_scale ? *k_scale : Tensor(), v_scale ? *v_scale : Tensor(), block_tables,
                        seq_lens, slot_mapping, heads, kv_heads, head_dim, eps, scale, kernel_linear, one_order, k_min,
                        k_max, read_blocks, sink, recent);
}

Tensor decode_mlp_part(Tensor x, Tensor attn, at::TensorList weights, int64_t bits, double eps, bool kernel_linear,
                       bool one_order) {
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == PER_LAYER, "decode_mlp_part: ", PER_LAYER, " weights of one layer");
  return mlp_part(x, attn, weights.data(), bits, eps, kernel_linear, one_order);
}

}  // namespace

TORCH_LIBRARY(kvpage, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, float scale, Tensor? k_min=None, Tensor? k_max=None, Tensor? read_blocks=None, int sink=1, int recent=2) -> ()");
  m.def("paged_prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, int seq_len, float scale) -> ()");
  m.def("paged_prefill_available(Tensor q, Tensor k_cache) -> bool");
  m.def("refresh_key_bounds(Tensor k_cache, Tensor? k_scale, Tensor(a!) k_min, Tensor(b!) k_max, Tensor slots) -> ()");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
  m.def("paged_decode_attention_int8(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor k_scale, Tensor v_scale, Tensor block_tables, Tensor seq_lens, float scale, Tensor? k_min=None, Tensor? k_max=None, Tensor? read_blocks=None, int sink=1, int recent=2) -> ()");
  m.def("write_kv_int8(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k_scale, Tensor(d!) v_scale, Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads, int head_dim) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("linear_rows(Tensor x, Tensor w, Tensor? bias, bool one_order=False) -> Tensor");
  m.def("linear_quant(Tensor x, Tensor q, Tensor scales, Tensor? mins, int bits, Tensor? bias) -> Tensor");
  m.def("dequantize_weight(Tensor q, Tensor scales, Tensor? mins, int bits) -> Tensor");
  m.def("decode_layers(Tensor(a!) x, Tensor cos, Tensor sin, Tensor[] weights, int bits, Tensor[] qkv_bias, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor(d!)[] k_scales, Tensor(e!)[] v_scales, Tensor block_tables, Tensor seq_lens, Tensor slot_mapping, Tensor final_norm, int heads, int kv_heads, int head_dim, float eps, float scale, bool kernel_linear, bool one_order, Tensor(f!)[] k_mins, Tensor(g!)[] k_maxs, Tensor? read_blocks, int sink, int recent) -> Tensor");
  m.def("decode_attention_part(Tensor(a!) x, Tensor? delta, Tensor cos, Tensor sin, Tensor[] weights, int bits, Tensor? qkv_bias, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor(d!)? k_scale, Tensor(e!)? v_scale, Tensor block_tables, Tensor seq_lens, Tensor slot_mapping, int heads, int kv_heads, int head_dim, float eps, float scale, bool kernel_linear, bool one_order, Tensor(f!)? k_min, Tensor(g!)? k_max, Tensor? read_blocks, int sink, int recent) -> Tensor");
  m.def("decode_mlp_part(Tensor(a!) x, Tensor attn, Tensor[] weights, int bits, float eps, bool kernel_linear, bool one_order) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvpage, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("paged_prefill_attention", &paged_prefill_attention);
  m.impl("paged_prefill_available", &paged_prefill_available);
  m.impl("write_kv", &write_kv);
  m.impl("refresh_key_bounds", &refresh_key_bounds);
  m.impl("paged_decode_attention_int8", &paged_decode_attention_int8);
  m.impl("write_kv_int8", &write_kv_int8);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
  m.impl("linear_rows", &linear_rows);
  m.impl("linear_quant", &linear_quant);
  m.impl("dequantize_weight", &dequantize_weight);
  m.impl("decode_layers", &decode_layers);
  m.impl("decode_attention_part", &decode_attention_part);
  m.impl("decode_mlp_part", &decode_mlp_part);
}
