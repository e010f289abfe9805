// Row-independent CPU kernels of the batch-invariant path (the CPU default): a query's or a row's
// result depends on its own inputs alone, never on how many rows share the call, where the row
// sits in it, how a prompt was chunked or how threads split the work.
//
//   invariant_decode_attn    q [N, H, D] over the cache rows each index row [N, L] names
//                            (column c = absolute position first[n] + c; -1: not visible)
//   invariant_prefill_attn   q [n, H, D] of a chunk over [loaded | chunk] rows: loaded
//                            [n_old, 2, H_kv, D] in the cache's element type, the chunk's k, v
//                            [n, H_kv, D] fp32 (rounded to that type, as a later cache read returns
//                            them); query p sees positions max(0, p - W + 1) .. p (W: window)
//
// Attention, decode and prefill alike, is one computation per (query, KV head) over the query's
// visible keys, cut into chunks of kChunk = 512 keys at absolute positions (position x in chunk
// x / 512). Per chunk c (`chunk_partial`), over its visible keys in position order:
//
//   s_j   = dot(q_h, k_j) * scale     16 lanes over D (element d in lane d % 16), then a fixed tree;
//                                     with a soft-cap c > 0: c * tanh(s_j / c) (std::tanh, elementwise)
//   m_c   = max_j s_j                 exact in any order
//   w_j   = exp(s_j - m_c)            elementwise (a polynomial, the same bits at any position)
//   per block b of KEY_BLOCK = 64 keys at absolute position offsets (position x in block x / 64):
//     S_b = sum of w_j                16 lanes keyed by x % 16 (each lane its 4 positions in order),
//                                     then a fixed tree over the lanes
//     P_b = sum of w_j * v_j          per element, the block's keys in position order
//   S_c, P_c = the blocks' S_b, P_b added in position order (blocks without a visible key skipped)
//
// then the chunks with a visible key, merged in chunk order (`merge_partials`):
//
//   M     = max(sink, max_c m_c)      exact (no sink: max_c m_c)
//   f_c   = exp(m_c - M)              1 exactly for a query's only chunk
//   S     = exp(sink - M) + S_0 f_0 + S_1 f_1 + ...      (0 + ... without sinks), fused multiply-adds
//   P     = P_0 f_0 + P_1 f_1 + ...   per element, fused multiply-adds from P_0 f_0
//   out   = P / S                     (a query that sees nothing gets zeros)
//
// Nothing in it depends on the call: the same query reads the same keys in the same chunks and order
// from a decode index row (whatever its padding) or from a prefill chunk (wherever it was cut), so a
// query's output has the same bits in both and in any batch. Threads take (query, KV head) tasks,
// each running its chunks in order then the merge; when those are fewer than four per thread and a
// query spans more than one chunk (batch-1 decode over a long cache), (query, KV head, chunk) tasks
// instead, their partials kept, the task finishing a pair's last chunk merging them: the same
// functions in the same order, the same bits (`run_attention`). The bits are those of one build and instruction set; `isa` (2: AVX-512, 1:
// AVX2 + FMA, as in fused_cpu.cpp) picks a variant per call. With AVX-512 and a head size that is a
// multiple of 16, the two inner loops run from registers: the dot products of sixteen keys at once
// (their lane trees transposed across the keys), and each block's weighted values summed in
// registers for up to four heads (each element's terms in position order, fused multiply-adds).
//
// Cache rows: `rows` [lines, (1 or 2) * H_kv * D] fp32 or bf16, or uint8 q8 rows ((1 or 2) * H_kv *
// D / 32 blocks of an fp32 scale and 32 int8 values, `Q8Block`; dequantized in registers, value =
// q * scale, so attention over q8 rows has the bits of attention over fp32 rows holding those
// values); one line per (unit, layer, row): flat slot u * R + r of the layer at `offset` is line
// u * LPU + offset + r (fused_cpu.cpp's layout). A shared K = V row (parts = 1) serves as both K and
// V. Prefill reads loaded rows as fp32 / bf16 (a q8 cache's loads are dequantized by the caller).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <vector>

// The kernels' thread pool (work_pool.cpp): fn(begin, end) over [0, n) in chunks of at most grain items.
namespace deepinfer_pool {
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);
int64_t num_threads();
}

namespace {

#define INLINE inline __attribute__((always_inline))
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define AVX2_TARGET __attribute__((target("avx2,fma")))

constexpr int64_t kKeyBlock = 64;  // keys per block, at absolute position offsets
constexpr int64_t kChunk = 512;  // keys per chunk, at absolute position offsets: a constant of the format
static_assert(kChunk % kKeyBlock == 0, "a chunk holds whole blocks");
constexpr int kLanes = 16;  // lanes of the dot products and block sums

// One block of an 8-bit (q8) cache row: an fp32 scale, then 32 int8 values; value i is q[i] * scale,
// one fp32 product (fused_cpu.cpp's store writes the blocks). A head's D values are D / 32 blocks.
struct Q8Block {
  float scale;
  int8_t q[32];
};
static_assert(sizeof(Q8Block) == 36, "a q8 block is 4 + 32 bytes");
constexpr int64_t kQ8Values = 32;

template <class T>
constexpr int64_t kValuesPer = 1;  // model values per element of a row of T
template <>
constexpr int64_t kValuesPer<Q8Block> = kQ8Values;

// value i of a head's row at p, as fp32
INLINE float value_at(const float* p, int64_t i) { return p[i]; }
INLINE float value_at(const c10::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }
INLINE float value_at(const Q8Block* p, int64_t i) {
  const Q8Block& b = p[i / kQ8Values];
  return static_cast<float>(b.q[i % kQ8Values]) * b.scale;
}

INLINE int64_t line_of(int64_t slot, int64_t R, int64_t lpu, int64_t offset) {
  return slot + slot / R * (lpu - R) + offset;
}

// x[0] + ... + x[15] as a fixed tree (x is overwritten).
INLINE float lane_tree(float* x) {
  static_assert(kLanes == 16, "the tree below adds 16 lanes");
  for (int l = 0; l < 8; ++l) x[l] += x[l + 8];
  for (int l = 0; l < 4; ++l) x[l] += x[l + 4];
  for (int l = 0; l < 2; ++l) x[l] += x[l + 2];
  return x[0] + x[1];
}

// sum_d a[d] * b[d]: element d in lane d % 16, each lane in order of d, then the lane tree.
template <int DC, class T>
INLINE float dot_lanes(const float* a, const T* b, int64_t head_dim) {
  const int64_t D = DC ? DC : head_dim;
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= D; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * value_at(b, i + l);
  for (int l = 0; i + l < D; ++l) acc[l] += a[i + l] * value_at(b, i + l);
  return lane_tree(acc);
}

template <int DC, class T>
INLINE void axpy(float* y, float a, const T* x, int64_t head_dim) {
  const int64_t D = DC ? DC : head_dim;
#pragma omp simd
  for (int64_t i = 0; i < D; ++i) y[i] += a * value_at(x, i);
}

// The same two loops over q8 rows, a block at a time (the same operations in the same order as above
// on the dequantized values, in loops the compiler vectorizes): D is a multiple of 32.
template <int DC>
INLINE float dot_lanes(const float* a, const Q8Block* b, int64_t head_dim) {
  const int64_t D = DC ? DC : head_dim;
  float acc[kLanes] = {};
  for (int64_t k = 0; k < D / kQ8Values; ++k, a += kQ8Values) {
    const float s = b[k].scale;
    for (int half = 0; half < 2; ++half)
      for (int l = 0; l < kLanes; ++l) acc[l] += a[half * kLanes + l] * (float(b[k].q[half * kLanes + l]) * s);
  }
  return lane_tree(acc);
}

template <int DC>
INLINE void axpy(float* y, float a, const Q8Block* x, int64_t head_dim) {
  const int64_t D = DC ? DC : head_dim;
  for (int64_t k = 0; k < D / kQ8Values; ++k, y += kQ8Values) {
    const float s = x[k].scale;
#pragma omp simd
    for (int l = 0; l < kQ8Values; ++l) y[l] += a * (float(x[k].q[l]) * s);
  }
}

// e^x for x <= 0 (an exact 0 below -87), within 2 ulp (fused_cpu.cpp's function, branch-free, so
// loops over it vectorize and every position gets the same bits).
INLINE float exp_nonpositive(float x) {
  const float xc = x < -87.f ? -87.f : x;
  const float u = xc * 1.44269504f + 12582912.f;  // 1.5 * 2^23 + n, n = round(x / ln2) in -126 .. 0
  const float t = u - 12582912.f;  // n
  const float r = xc - t * 0.693359375f + t * 2.12194440e-4f;  // x - n ln2 in two parts
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t n = __builtin_bit_cast(int32_t, u) - 0x4B400000;  // the bits of 1.5 * 2^23 are 0x4B400000
  const float v = p * __builtin_bit_cast(float, (n + 127) << 23);  // p * 2^n
  return x < -87.f ? 0.f : v;
}

// ---- AVX-512 forms of the two inner loops (head sizes that are multiples of 16) ------------------
// The same operations as dot_lanes / axpy, arranged for registers: sixteen keys' dot products at once
// (each key's 16 lane sums in order of d, then the lane tree run transposed across the keys: the same
// additions of the same pairs), and a block's weighted values summed in registers for a few heads.

// values i .. i + 15 (i a multiple of 16) of a head's row at p, as fp32
AVX512_TARGET INLINE __m512 load16(const float* p, int64_t i) { return _mm512_loadu_ps(p + i); }
AVX512_TARGET INLINE __m512 load16(const c10::BFloat16* p, int64_t i) {  // bf16 -> fp32: the bits shifted up
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
AVX512_TARGET INLINE __m512 load16(const Q8Block* p, int64_t i) {  // int8 -> fp32, times the block's scale
  const Q8Block& b = p[i / kQ8Values];
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.q + i % kQ8Values));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(x)), _mm512_set1_ps(b.scale));
}

// lane_tree of each of a[0..15], as one vector: out lane c = the tree of a[c]'s lanes.
AVX512_TARGET INLINE __m512 lane_trees16(const __m512* a) {
  __m512 b[8], c[4], e[2];
  for (int i = 0; i < 8; ++i)  // x[l] + x[l + 8]: two keys' 8 sums per vector
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)  // x[l] + x[l + 4]: block k of c[i] holds key 4i + k's 4 sums
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i) {  // x[l] + x[l + 2]: block k holds keys 8i + k and 8i + 4 + k, 2 sums each
    const __m512d x = _mm512_castps_pd(c[2 * i]), y = _mm512_castps_pd(c[2 * i + 1]);
    e[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // x[0] + x[1]: lane 4k + t holds key 4t + k; then each key to its own lane
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(e[0], e[1], 0x88), _mm512_shuffle_ps(e[0], e[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}

// s[c] = dot(q, k_c) for the 16 keys k_c (each D = DC values), as dot_lanes computes each.
// The keys' chains run KB at a time, interleaved (independent multiply-adds in flight), with q's P
// vectors in registers beside them.
template <int DC, class T>
AVX512_TARGET INLINE __m512 dots16(const float* q, const T* const* keys) {
  constexpr int P = DC / 16, KB = P > 8 ? 4 : 16;
  __m512 qv[P], acc[16];
  for (int i = 0; i < P; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i);
  for (int c0 = 0; c0 < 16; c0 += KB) {
    for (int c = 0; c < KB; ++c) acc[c0 + c] = _mm512_mul_ps(qv[0], load16(keys[c0 + c], 0));
    for (int i = 1; i < P; ++i)
      for (int c = 0; c < KB; ++c) acc[c0 + c] = _mm512_fmadd_ps(qv[i], load16(keys[c0 + c], 16 * i), acc[c0 + c]);
  }
  return lane_trees16(acc);
}

// dots16 for HB heads of one KV group at once (q_h at q + h * qs): in passes of KB keys, each key
// vector loaded once serves the HB heads, so HB x KB independent chains are in flight; every dot
// is the same chain of operations as dots16's.
template <int DC, int HB, class T>
AVX512_TARGET INLINE void dots16_heads(const float* q, int64_t qs, const T* const* keys, __m512* out) {
  constexpr int P = DC / 16, KB = HB == 3 ? 4 : 16 / HB;  // at most 16 chains
  alignas(64) float done[HB][16][16];  // finished chains, for the lane trees
#pragma GCC unroll 1
  for (int c0 = 0; c0 < 16; c0 += KB) {
    __m512 acc[HB][KB];
#pragma GCC unroll 16
    for (int i = 0; i < P; ++i) {
      __m512 qv[HB];
#pragma GCC unroll 4
      for (int h = 0; h < HB; ++h) qv[h] = _mm512_loadu_ps(q + h * qs + 16 * i);
#pragma GCC unroll 16
      for (int c = 0; c < KB; ++c) {
        const __m512 k = load16(keys[c0 + c], 16 * i);
#pragma GCC unroll 4
        for (int h = 0; h < HB; ++h) acc[h][c] = i == 0 ? _mm512_mul_ps(qv[h], k) : _mm512_fmadd_ps(qv[h], k, acc[h][c]);
      }
    }
    for (int h = 0; h < HB; ++h)
      for (int c = 0; c < KB; ++c) _mm512_store_ps(done[h][c0 + c], acc[h][c]);
  }
  for (int h = 0; h < HB; ++h) {
    __m512 a[16];
    for (int c = 0; c < 16; ++c) a[c] = _mm512_load_ps(done[h][c]);
    out[h] = lane_trees16(a);
  }
}

// Scores of heads h .. h + HB - 1 for the 16 keys at columns j0 .. j0 + m - 1, into s [G, n].
template <int DC, int HB, class T>
AVX512_TARGET INLINE void scores_heads(const float* q, int64_t qs, const T* const* keys, int64_t n, int64_t j0,
                                       int64_t m, float scale, float* s) {
  __m512 dots[HB];
  if constexpr (HB == 1) dots[0] = dots16<DC>(q, keys);
  else dots16_heads<DC, HB>(q, qs, keys, dots);
  for (int h = 0; h < HB; ++h) {
    alignas(64) float out[16];
    _mm512_store_ps(out, _mm512_mul_ps(dots[h], _mm512_set1_ps(scale)));
    for (int64_t c = 0; c < m; ++c) s[h * n + j0 + c] = out[c];
  }
}

// Scores of the G heads over columns 0 .. n-1, sixteen at a time (hidden or missing columns read
// the zero row and are set to -inf by the caller); up to four heads share each key load.
template <int DC, class T>
AVX512_TARGET void scores512(const float* q, int64_t qs, int64_t G, const T* const* kp, int64_t n, float scale,
                             float* s) {
  alignas(64) static const T zeros[DC] = {};
  const T* keys[16];
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t m = std::min<int64_t>(16, n - j0);
    for (int c = 0; c < 16; ++c) keys[c] = c < m && kp[j0 + c] ? kp[j0 + c] : zeros;
    int64_t h = 0;
    for (; h + 4 <= G; h += 4) scores_heads<DC, 4>(q + h * qs, qs, keys, n, j0, m, scale, s + h * n);
    switch (G - h) {
      case 3: scores_heads<DC, 3>(q + h * qs, qs, keys, n, j0, m, scale, s + h * n); break;
      case 2: scores_heads<DC, 2>(q + h * qs, qs, keys, n, j0, m, scale, s + h * n); break;
      case 1: scores_heads<DC, 1>(q + h * qs, qs, keys, n, j0, m, scale, s + h * n); break;
    }
  }
}

// acc[h] (D = DC values each, heads 0 .. G-1 at stride DC) = sum over the visible columns j in
// [a, b) of w[h * n + j] * v_j, each element's terms in order of j (fused multiply-adds from 0).
// Registers hold HB heads x PB vectors at a time (at most 16 sums): each pass reads that slice of
// the block's value rows once for HB heads.
constexpr int divisor_at_most(int p, int cap) {  // the largest divisor of p that is at most cap
  return cap <= 1 || p % cap == 0 ? (cap < 1 ? 1 : cap) : divisor_at_most(p, cap - 1);
}

template <int DC, int HB, class T>
AVX512_TARGET INLINE void values_heads(const float* w, int64_t n, const T* const* vp, int64_t a, int64_t b,
                                       float* acc) {
  constexpr int P = DC / 16, PB = divisor_at_most(P, 16 / HB);  // passes of PB vectors cover the row exactly
  for (int p0 = 0; p0 < P; p0 += PB) {
    __m512 sum[HB][PB];
    for (int h = 0; h < HB; ++h)
      for (int i = 0; i < PB; ++i) sum[h][i] = _mm512_setzero_ps();
    for (int64_t j = a; j < b; ++j) {
      if (vp[j] == nullptr) continue;
      __m512 wj[HB];
      for (int h = 0; h < HB; ++h) wj[h] = _mm512_set1_ps(w[h * n + j]);
      for (int i = 0; i < PB; ++i) {
        const __m512 v = load16(vp[j], 16 * (p0 + i));
        for (int h = 0; h < HB; ++h) sum[h][i] = _mm512_fmadd_ps(wj[h], v, sum[h][i]);
      }
    }
    for (int h = 0; h < HB; ++h)
      for (int i = 0; i < PB; ++i) _mm512_storeu_ps(acc + h * DC + 16 * (p0 + i), sum[h][i]);
  }
}

template <int DC, class T>
AVX512_TARGET void values512(const float* w, int64_t n, int64_t G, const T* const* vp, int64_t a, int64_t b,
                             float* acc) {
  int64_t h = 0;
  for (; h + 4 <= G; h += 4) values_heads<DC, 4>(w + h * n, n, vp, a, b, acc + h * DC);
  switch (G - h) {  // the last 1 to 3 heads in one pass
    case 3: return values_heads<DC, 3>(w + h * n, n, vp, a, b, acc + h * DC);
    case 2: return values_heads<DC, 2>(w + h * n, n, vp, a, b, acc + h * DC);
    case 1: return values_heads<DC, 1>(w + h * n, n, vp, a, b, acc + h * DC);
  }
}

// One chunk of one query's KV-head group: the G heads at q (head stride qs) over columns j = 0 .. n-1,
// all inside one chunk of kChunk positions, column j the key at absolute position first + j, read at
// kp[j] / vp[j] (nullptr: not visible). softcap > 0 caps the logits. Scratch: s [G * n], wb [G * (64 + D)].
// part = [m (G) | S (G) | P (G x D)]: per head the chunk's max logit m, S = sum of exp(s_j - m) and
// P = sum of exp(s_j - m) v_j, both in 64-key blocks as the header says. False (part unwritten): no
// column is visible.
template <int DC, bool V512, class T>
INLINE bool chunk_partial(const float* q, int64_t qs, int64_t G, int64_t head_dim, const T* const* kp,
                          const T* const* vp, int64_t n, int64_t first, float scale, float softcap, float* s,
                          float* wb, float* part) {
  const int64_t D = DC ? DC : head_dim;
  if constexpr (V512) scores512<DC>(q, qs, G, kp, n, scale, s);
  int64_t lo = n, hi = -1;  // first and last visible column
  for (int64_t j = 0; j < n; ++j) {
    if (kp[j] == nullptr) {  // e^-inf = 0 below: a hidden column weighs exactly 0
      for (int64_t h = 0; h < G; ++h) s[h * n + j] = -std::numeric_limits<float>::infinity();
      continue;
    }
    lo = std::min(lo, j);
    hi = j;
    for (int64_t h = 0; h < G; ++h) {
      const float dot = V512 ? s[h * n + j] : dot_lanes<DC>(q + h * qs, kp[j], D) * scale;
      s[h * n + j] = softcap > 0.f ? softcap * std::tanh(dot / softcap) : dot;
    }
  }
  if (hi < 0) return false;
  float *m = part, *total = part + G, *out = part + 2 * G;
  for (int64_t h = 0; h < G; ++h) {  // w = exp(s - m)
    float* sh = s + h * n;
    float mh = -std::numeric_limits<float>::infinity();
    for (int64_t j = lo; j <= hi; ++j) mh = std::max(mh, sh[j]);
#pragma omp simd
    for (int64_t j = lo; j <= hi; ++j) sh[j] = exp_nonpositive(sh[j] - mh);
    m[h] = mh;
    total[h] = 0.f;  // 0 + S_0 is S_0 exactly
  }
  bool started = false;
  int64_t j0 = lo - (first + lo) % kKeyBlock;  // column of the first block's boundary (may be < 0)
  for (; j0 <= hi; j0 += kKeyBlock) {
    const int64_t a = std::max<int64_t>(j0, lo), b = std::min<int64_t>(j0 + kKeyBlock, hi + 1);
    bool any = false;
    for (int64_t j = a; j < b && !any; ++j) any = kp[j] != nullptr;
    if (!any) continue;
    // S_b per head: the block's weights laid out at x % 64 (zeros elsewhere), 16 lanes keyed by x % 16
    for (int64_t h = 0; h < G; ++h) {
      const float* w = s + h * n + j0;  // a whole block: its weights in place
      if (a != j0 || b != j0 + kKeyBlock) {  // a partial one: laid out at x % 64, zeros elsewhere
        float* c = wb + h * kKeyBlock;
        for (int64_t x = 0; x < kKeyBlock; ++x) c[x] = 0.f;
        for (int64_t j = a; j < b; ++j) c[j - j0] = s[h * n + j];
        w = c;
      }
      float lanes[kLanes] = {};
      for (int64_t r = 0; r < kKeyBlock; r += kLanes)
        for (int l = 0; l < kLanes; ++l) lanes[l] += w[r + l];
      total[h] += lane_tree(lanes);
    }
    // P_b per head (wb after the weights: [G, D]), the block's keys outer so each v row is read once
    if constexpr (V512) {
      values512<DC>(s, n, G, vp, a, b, wb + G * kKeyBlock);
    } else {
      for (int64_t h = 0; h < G; ++h) {
        float* acc = wb + G * kKeyBlock + h * D;
        for (int64_t d = 0; d < D; ++d) acc[d] = 0.f;
      }
      for (int64_t j = a; j < b; ++j) {
        if (vp[j] == nullptr) continue;
        for (int64_t h = 0; h < G; ++h) axpy<DC>(wb + G * kKeyBlock + h * D, s[h * n + j], vp[j], D);
      }
    }
    for (int64_t h = 0; h < G; ++h) {
      const float* acc = wb + G * kKeyBlock + h * D;
      float* o = out + h * D;
      if (started) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] += acc[d];
      } else {
        for (int64_t d = 0; d < D; ++d) o[d] = acc[d];
      }
    }
    started = true;
  }
  return true;
}

// out [G, D] (head stride os) from a query's C chunk partials parts[0 .. C-1], in chunk order:
//   M = max(sink, m_c),  f_c = exp(m_c - M),  S = exp(sink - M) + sum_c S_c f_c,  out = (sum_c P_c f_c) / S
// (no sink: M = max m_c and S starts from 0), the sums in chunk order with fused multiply-adds from
// P_0 f_0. One chunk: f_0 = 1 exactly. No partial (nothing visible): zeros.
template <int DC>
INLINE void merge_partials(const float* const* parts, int64_t C, int64_t G, int64_t head_dim, const float* sinks,
                           float* out, int64_t os) {
  const int64_t D = DC ? DC : head_dim;
  for (int64_t h = 0; h < G; ++h) {
    float* o = out + h * os;
    if (C == 0) {
      for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
      continue;
    }
    float M = sinks ? sinks[h] : -std::numeric_limits<float>::infinity();
    for (int64_t c = 0; c < C; ++c) M = std::max(M, parts[c][h]);
    float S = sinks ? exp_nonpositive(sinks[h] - M) : 0.f;
    for (int64_t c = 0; c < C; ++c) {
      const float f = exp_nonpositive(parts[c][h] - M), *P = parts[c] + 2 * G + h * D;
      S = std::fma(parts[c][G + h], f, S);
      if (c == 0) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] = P[d] * f;
      } else {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) o[d] = std::fma(P[d], f, o[d]);
      }
    }
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] = o[d] / S;
  }
}

// ---- one wrapper per instruction set ------------------------------------------------------

#define DEFINE_FOR(SUFFIX, TARGET, V512)                                                                        \
  template <int DC, class T>                                                                                    \
  TARGET bool partial_##SUFFIX(const float* q, int64_t qs, int64_t G, int64_t D, const T* const* kp,            \
                               const T* const* vp, int64_t n, int64_t first, float scale, float softcap,        \
                               float* s, float* wb, float* part) {                                              \
    return chunk_partial<DC, V512>(q, qs, G, D, kp, vp, n, first, scale, softcap, s, wb, part);                 \
  }                                                                                                             \
  template <int DC>                                                                                             \
  TARGET void merge_##SUFFIX(const float* const* parts, int64_t C, int64_t G, int64_t D, const float* sinks,    \
                             float* out, int64_t os) {                                                          \
    merge_partials<DC>(parts, C, G, D, sinks, out, os);                                                         \
  }

DEFINE_FOR(512, AVX512_TARGET, (DC > 0 && DC % 16 == 0))
DEFINE_FOR(256, AVX2_TARGET, false)

template <class T>
using PartialFn = bool (*)(const float*, int64_t, int64_t, int64_t, const T* const*, const T* const*, int64_t,
                           int64_t, float, float, float*, float*, float*);
using MergeFn = void (*)(const float* const*, int64_t, int64_t, int64_t, const float*, float*, int64_t);

template <class T>
struct Kernels {
  PartialFn<T> partial;
  MergeFn merge;
};

template <int DC, class T>
Kernels<T> kernels_for(int64_t isa) {
  if (isa >= 2) return {partial_512<DC, T>, merge_512<DC>};
  return {partial_256<DC, T>, merge_256<DC>};
}

// Head sizes of the supported models get unrolled code; any other runs the generic loops.
template <class T>
Kernels<T> kernels(int64_t isa, int64_t D) {
  return D == 64 ? kernels_for<64, T>(isa) : D == 128 ? kernels_for<128, T>(isa) : D == 256 ? kernels_for<256, T>(isa)
                                                                                            : kernels_for<0, T>(isa);
}

// ---- the driver: (query, KV head, chunk) tasks, then the merge --------------------------------
//
// A `Source` names a call's queries: size(), order(t) (the query of the t-th task), first(i) (the
// position of column 0), lo(i) / hi(i) (first and last column that may be visible; hi < lo: none),
// q(i, g) / out(i, g) (the head group's query and output) and fill(i, g, a, b, kp, vp) (the key and
// value pointers of columns a .. b-1). Chunk c of query i covers its columns inside positions
// [c0 + c * kChunk, c0 + (c + 1) * kChunk), c0 the chunk boundary at or before its first column.
//
// Whole queries (one task per (query, KV head), its chunks in order) when there are enough of them for
// the threads; else one task per (query, KV head, chunk) with the partials kept, merged by the task
// that finishes the pair's last chunk. Both run the same partial and merge functions: the same bits.

// One thread's scratch for chunks of at most `width` columns (sized to the call: a short cache's
// decode allocates little).
template <class T>
struct Scratch {
  std::vector<float> s, wb, parts;
  std::vector<const float*> used;  // the visible chunks' partials, in chunk order
  std::vector<const T*> kp, vp;  // a chunk's key and value pointers
  Scratch(int64_t G, int64_t D, int64_t width, int64_t max_chunks)
      : s(G * width), wb(G * (kKeyBlock + D)), parts(max_chunks * G * (D + 2)), used(max_chunks), kp(width),
        vp(width) {}
};

template <class T, class Source>
struct Driver {
  const Source& src;
  const Kernels<T> fn;
  int64_t Hkv, G, D, qs;
  float scale, softcap;
  const float* sinks;
  int64_t part_size = G * (D + 2), max_chunks = 1, width = 1;  // width: the widest chunk's columns
  std::vector<int64_t> c0, chunks;  // per query: column of its first chunk boundary, number of chunks

  void plan() {
    const int64_t N = src.size();
    c0.resize(N), chunks.resize(N);
    for (int64_t i = 0; i < N; ++i) {
      const int64_t lo = src.lo(i), hi = src.hi(i);
      c0[i] = lo - (src.first(i) + lo) % kChunk;
      chunks[i] = hi < lo ? 0 : (hi - c0[i]) / kChunk + 1;
      max_chunks = std::max(max_chunks, chunks[i]);
      width = std::max(width, std::min(kChunk, hi - lo + 1));
    }
  }

  // chunk c of (query i, KV head g): its partial at part; false when nothing in it is visible
  bool chunk(Scratch<T>& sc, int64_t i, int64_t g, int64_t c, float* part) const {
    const int64_t a = std::max(c0[i] + c * kChunk, src.lo(i)), b = std::min(c0[i] + (c + 1) * kChunk, src.hi(i) + 1);
    src.fill(i, g, a, b, sc.kp.data(), sc.vp.data());
    return fn.partial(src.q(i, g), qs, G, D, sc.kp.data(), sc.vp.data(), b - a, src.first(i) + a, scale, softcap,
                      sc.s.data(), sc.wb.data(), part);
  }

  void merge(const float* const* used, int64_t n, int64_t i, int64_t g) const {
    fn.merge(used, n, G, D, sinks ? sinks + g * G : nullptr, src.out(i, g), D);
  }

  // one task per (query, KV head): its chunks in order, then the merge
  void run_whole() const {
    const int64_t tasks = src.size() * Hkv;
    std::atomic<int64_t> next{0};  // tasks taken one by one: a thread the OS pauses holds up one task
    // one call per thread, each taking tasks from `next` until none is left (a call whose thread
    // never ran is taken by another and finds nothing)
    deepinfer_pool::parallel_for(std::min(tasks, deepinfer_pool::num_threads()), 1, [&](int64_t, int64_t) {
      Scratch<T> sc(G, D, width, max_chunks);
      for (int64_t t; (t = next.fetch_add(1)) < tasks;) {
        const int64_t i = src.order(t / Hkv), g = t % Hkv;
        int64_t used = 0;
        for (int64_t c = 0; c < chunks[i]; ++c) {
          float* part = sc.parts.data() + c * part_size;
          if (chunk(sc, i, g, c, part)) sc.used[used++] = part;
        }
        merge(sc.used.data(), used, i, g);
      }
    });
  }

  // one task per (query, KV head, chunk), the partials kept; the task that finishes a (query, KV head)'s
  // last chunk merges its partials (in chunk order, whichever thread it runs on)
  void run_split() const {
    const int64_t N = src.size();
    std::vector<int64_t> base(N + 1, 0);  // task base[i] + g * chunks[i] + c: chunk c of (query i, KV head g)
    for (int64_t i = 0; i < N; ++i) base[i + 1] = base[i] + Hkv * chunks[i];
    std::vector<float> parts(base[N] * part_size);
    std::vector<char> visible(base[N]);
    std::unique_ptr<std::atomic<int64_t>[]> done(new std::atomic<int64_t>[N * Hkv]());  // chunks finished
    std::atomic<int64_t> next{0};
    deepinfer_pool::parallel_for(std::min(base[N], deepinfer_pool::num_threads()), 1, [&](int64_t, int64_t) {
      Scratch<T> sc(G, D, width, 0);
      std::vector<const float*> used(max_chunks);
      for (int64_t t; (t = next.fetch_add(1)) < base[N];) {
        const int64_t i = std::upper_bound(base.begin(), base.end(), t) - base.begin() - 1, r = t - base[i];
        const int64_t g = r / chunks[i], first = base[i] + g * chunks[i];
        visible[t] = chunk(sc, i, g, r % chunks[i], parts.data() + t * part_size);
        if (done[i * Hkv + g].fetch_add(1, std::memory_order_acq_rel) + 1 < chunks[i]) continue;
        int64_t n = 0;  // the last chunk of (i, g): every partial is written (acquire above)
        for (int64_t c = 0; c < chunks[i]; ++c)
          if (visible[first + c]) used[n++] = parts.data() + (first + c) * part_size;
        merge(used.data(), n, i, g);
      }
    });
    for (int64_t i = 0; i < N; ++i)  // queries that see nothing: zeros
      for (int64_t g = 0; g < Hkv && chunks[i] == 0; ++g) merge(nullptr, 0, i, g);
  }
};

template <class T, class Source>
void run_attention(const Source& src, int64_t Hkv, int64_t G, int64_t D, int64_t qs, float scale, float softcap,
                   const float* sinks, const Kernels<T>& fn) {
  Driver<T, Source> driver{src, fn, Hkv, G, D, qs, scale, softcap, sinks};
  driver.plan();
  // split when a query spans chunks and the (query, KV head) tasks are too few to keep the threads busy
  if (driver.max_chunks > 1 && src.size() * Hkv < 4 * deepinfer_pool::num_threads())
    driver.run_split();
  else
    driver.run_whole();
}

// ---- ops ----------------------------------------------------------------------------------

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

void check_q(const at::Tensor& q, int64_t num_kv_heads) {
  check_f32(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [N, H, D] with contiguous heads");
  TORCH_CHECK(num_kv_heads > 0 && q.size(1) % num_kv_heads == 0, "H = ", q.size(1),
              " is not a multiple of H_kv = ", num_kv_heads);
}

// The attention options as the kernels read them: the soft-cap (0: none) checked, and the sink
// logits: nullptr, or H contiguous floats.
const float* sink_logits(double softcap, const std::optional<at::Tensor>& sinks, int64_t H) {
  TORCH_CHECK(softcap >= 0, "softcap must be positive (0: none), got ", softcap);
  if (!sinks.has_value()) return nullptr;
  check_f32(*sinks, "sinks");
  TORCH_CHECK(sinks->dim() == 1 && sinks->numel() == H && sinks->is_contiguous(), "sinks must be [H] contiguous for ",
              H, " query heads, got ", sinks->sizes());
  return sinks->data_ptr<float>();
}

// Decode: query i's column c is the key at position first[i] + c, in cache line lines[i * L + c] (-1: none).
// A line holds parts x H_kv heads of U elements of T each (U = D / kValuesPer<T>), K heads first.
template <class T>
struct DecodeSource {
  const int64_t *lines, *fp;
  int64_t N, L;
  const T* rows;
  int64_t ld, U, parts, Hkv, G;  // ld: elements of T per line
  const float* qp;
  int64_t q0, q1;  // q's strides
  float* op;
  int64_t H, D;
  std::vector<int64_t> lo_, hi_;

  void find_visible() {
    lo_.assign(N, L);
    hi_.assign(N, -1);
    for (int64_t i = 0; i < N; ++i)
      for (int64_t c = 0; c < L; ++c)
        if (lines[i * L + c] >= 0) lo_[i] = std::min(lo_[i], c), hi_[i] = c;
  }
  int64_t size() const { return N; }
  int64_t order(int64_t t) const { return t; }
  int64_t first(int64_t i) const { return fp[i]; }
  int64_t lo(int64_t i) const { return lo_[i]; }
  int64_t hi(int64_t i) const { return hi_[i]; }
  const float* q(int64_t i, int64_t g) const { return qp + i * q0 + g * G * q1; }
  float* out(int64_t i, int64_t g) const { return op + (i * H + g * G) * D; }
  void fill(int64_t i, int64_t g, int64_t a, int64_t b, const T** kp, const T** vp) const {
    for (int64_t j = a; j < b; ++j) {
      const int64_t line = lines[i * L + j];
      const T* row = line >= 0 ? rows + line * ld : nullptr;
      kp[j - a] = row ? row + g * U : nullptr;
      vp[j - a] = row ? row + ((parts - 1) * Hkv + g) * U : nullptr;
    }
  }
};

template <class T>
void decode_typed(const at::Tensor& q, const T* rows, int64_t ld, const int64_t* lines, int64_t L, const int64_t* fp,
                  int64_t parts, int64_t Hkv, double scale, float softcap, const float* sinks, int64_t isa,
                  at::Tensor& out) {
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), G = H / Hkv;
  DecodeSource<T> src{lines, fp, N, L, rows, ld, D / kValuesPer<T>, parts, Hkv, G, q.data_ptr<float>(), q.stride(0),
                      q.stride(1), out.data_ptr<float>(), H, D, {}, {}};
  src.find_visible();
  run_attention<T>(src, Hkv, G, D, q.stride(1), float(scale), softcap, sinks, kernels<T>(isa, D));
}

at::Tensor invariant_decode_attn(const at::Tensor& q, const at::Tensor& rows, const at::Tensor& index,
                                 const at::Tensor& first, int64_t num_kv_heads, int64_t rows_per_unit,
                                 int64_t lines_per_unit, int64_t offset, double scale, int64_t isa,
                                 double softcap, const std::optional<at::Tensor>& sinks) {
  check_q(q, num_kv_heads);
  const float* sp = sink_logits(softcap, sinks, q.size(1));
  const int64_t D = q.size(2), Hkv = num_kv_heads;
  const at::ScalarType type = rows.scalar_type();
  TORCH_CHECK(type == at::kFloat || type == at::kBFloat16 || type == at::kByte,
              "cache rows must be float32, bfloat16 or uint8 (q8 blocks), got ", type);
  TORCH_CHECK(type != at::kByte || D % kQ8Values == 0, "q8 cache rows need a head size that is a multiple of ",
              kQ8Values, ", got ", D);
  // a head's elements of the row type: D values, or D / 32 q8 blocks of 36 bytes
  const int64_t head_bytes = type == at::kByte ? D / kQ8Values * int64_t(sizeof(Q8Block)) : D * rows.element_size();
  TORCH_CHECK(rows.dim() == 2 && rows.stride(1) == 1 && rows.size(1) * rows.element_size() % (Hkv * head_bytes) == 0,
              "cache rows must be [lines, parts * H_kv * head] with contiguous lines");
  TORCH_CHECK(rows.stride(0) * rows.element_size() % (type == at::kByte ? int64_t(sizeof(Q8Block)) : 1) == 0,
              "q8 cache lines must be whole blocks apart");
  const int64_t parts = rows.size(1) * rows.element_size() / (Hkv * head_bytes);
  TORCH_CHECK(parts == 1 || parts == 2, "cache rows hold ", parts, " parts per head (1 or 2)");
  const at::Tensor idx = index.to(at::kLong).contiguous(), fst = first.to(at::kLong).contiguous();
  TORCH_CHECK(idx.dim() == 2 && idx.size(0) == q.size(0), "index must be [N, L] for N queries");
  TORCH_CHECK(fst.dim() == 1 && fst.size(0) == q.size(0), "first must be [N] for N queries");
  const int64_t *ip = idx.data_ptr<int64_t>(), *fp = fst.data_ptr<int64_t>();
  std::vector<int64_t> lines(idx.numel());
  for (int64_t i = 0; i < idx.numel(); ++i) {
    lines[i] = ip[i] < 0 ? -1 : line_of(ip[i], rows_per_unit, lines_per_unit, offset);
    TORCH_CHECK(lines[i] < rows.size(0), "slot ", ip[i], " is past the cache");
  }
  for (int64_t i = 0; i < fst.numel(); ++i) TORCH_CHECK(fp[i] >= 0, "first position ", fp[i], " is negative");
  at::Tensor out = at::empty({q.size(0), q.size(1), D}, q.options());
  const int64_t L = idx.size(1);
  const float cap = float(softcap);
  if (type == at::kFloat)
    decode_typed(q, rows.data_ptr<float>(), rows.stride(0), lines.data(), L, fp, parts, Hkv, scale, cap, sp, isa, out);
  else if (type == at::kBFloat16)
    decode_typed(q, rows.data_ptr<c10::BFloat16>(), rows.stride(0), lines.data(), L, fp, parts, Hkv, scale, cap, sp,
                 isa, out);
  else
    decode_typed(q, reinterpret_cast<const Q8Block*>(rows.data_ptr<uint8_t>()), rows.stride(0) / int64_t(sizeof(Q8Block)),
                 lines.data(), L, fp, parts, Hkv, scale, cap, sp, isa, out);
  return out;
}

// Prefill: query i at p = pos[i] over rows [loaded | chunk], row r at position start + r; its column c
// is the key at position first + c, first = max(0, p - W + 1) (0 without a window).
template <class T>
struct PrefillSource {
  const T *const *kp_all, *const *vp_all;  // [H_kv, L] row pointers per KV head
  int64_t L, n;
  const int64_t* pos;
  int64_t start, window, G;
  const float* qp;
  int64_t q0, q1;
  float* op;
  int64_t H, D;

  int64_t size() const { return n; }
  // long and short queries alternate (0, n-1, 1, n-2, ...), so the last tasks taken are short ones
  int64_t order(int64_t t) const { return t % 2 == 0 ? t / 2 : n - 1 - t / 2; }
  int64_t first(int64_t i) const { return window > 0 ? std::max<int64_t>(0, pos[i] - window + 1) : 0; }
  int64_t lo(int64_t) const { return 0; }
  int64_t hi(int64_t i) const { return pos[i] - first(i); }
  const float* q(int64_t i, int64_t g) const { return qp + i * q0 + g * G * q1; }
  float* out(int64_t i, int64_t g) const { return op + (i * H + g * G) * D; }
  void fill(int64_t i, int64_t g, int64_t a, int64_t b, const T** kp, const T** vp) const {
    const int64_t row = g * L + first(i) - start;  // the query's column 0
    std::copy(kp_all + row + a, kp_all + row + b, kp);
    std::copy(vp_all + row + a, vp_all + row + b, vp);
  }
};

template <class T>
void prefill_typed(const at::Tensor& q, const at::Tensor& loaded, const at::Tensor& k, const at::Tensor& v,
                   const int64_t* pos, int64_t start, int64_t window, double scale, float softcap, const float* sinks,
                   int64_t isa, at::Tensor& out) {
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1), G = H / Hkv;
  const int64_t n_old = loaded.size(0), L = n_old + n;
  // the chunk's rows as the cache stores them (T), then one pointer per (KV head, row)
  const at::Tensor ck = k.to(loaded.scalar_type()).contiguous(), cv = v.to(loaded.scalar_type()).contiguous();
  std::vector<const T*> kp(Hkv * L), vp(Hkv * L);
  const T* lp = loaded.data_ptr<T>();
  for (int64_t g = 0; g < Hkv; ++g) {
    for (int64_t r = 0; r < n_old; ++r) {
      kp[g * L + r] = lp + r * loaded.stride(0) + g * loaded.stride(2);
      vp[g * L + r] = lp + r * loaded.stride(0) + loaded.stride(1) + g * loaded.stride(2);
    }
    for (int64_t r = 0; r < n; ++r) {
      kp[g * L + n_old + r] = ck.data_ptr<T>() + (r * Hkv + g) * D;
      vp[g * L + n_old + r] = cv.data_ptr<T>() + (r * Hkv + g) * D;
    }
  }
  PrefillSource<T> src{kp.data(), vp.data(), L, n, pos, start, window, G, q.data_ptr<float>(), q.stride(0),
                       q.stride(1), out.data_ptr<float>(), H, D};
  run_attention<T>(src, Hkv, G, D, q.stride(1), float(scale), softcap, sinks, kernels<T>(isa, D));
}

at::Tensor invariant_prefill_attn(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& loaded, const at::Tensor& positions, int64_t start,
                                  int64_t window, double scale, int64_t isa, double softcap,
                                  const std::optional<at::Tensor>& sinks) {
  check_f32(k, "k");
  check_f32(v, "v");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) == q.size(0), "k and v must both be [n, H_kv, D]");
  check_q(q, k.size(1));
  const float* sp = sink_logits(softcap, sinks, q.size(1));
  const int64_t n = q.size(0), Hkv = k.size(1), D = q.size(2);
  TORCH_CHECK(k.size(2) == D, "k has head size ", k.size(2), ", q ", D);
  TORCH_CHECK(loaded.scalar_type() == at::kFloat || loaded.scalar_type() == at::kBFloat16,
              "loaded rows must be float32 or bfloat16, got ", loaded.scalar_type());
  TORCH_CHECK(loaded.dim() == 4 && loaded.size(1) == 2 && loaded.size(2) == Hkv && loaded.size(3) == D &&
                  loaded.stride(3) == 1, "loaded must be [n_old, 2, H_kv, D] with contiguous heads");
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(pos.dim() == 1 && pos.size(0) == n, "positions must be [n] for n queries");
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t n_old = loaded.size(0);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(pp[i] == start + n_old + i, "the chunk's positions must follow the loaded rows: query ", i, " at ",
                pp[i], ", expected ", start + n_old + i);
    const int64_t first = window > 0 ? std::max<int64_t>(0, pp[i] - window + 1) : 0;
    TORCH_CHECK(first >= start, "query at ", pp[i], " sees position ", first, ", before the first row (", start, ")");
  }
  at::Tensor out = at::empty({n, q.size(1), D}, q.options());
  if (n == 0) return out;
  if (loaded.scalar_type() == at::kFloat)
    prefill_typed<float>(q, loaded, k, v, pp, start, window, scale, float(softcap), sp, isa, out);
  else
    prefill_typed<c10::BFloat16>(q, loaded, k, v, pp, start, window, scale, float(softcap), sp, isa, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("invariant_decode_attn(Tensor q, Tensor rows, Tensor index, Tensor first, int num_kv_heads, "
        "int rows_per_unit, int lines_per_unit, int offset, float scale, int isa, float softcap=0., "
        "Tensor? sinks=None) -> Tensor");
  m.def("invariant_prefill_attn(Tensor q, Tensor k, Tensor v, Tensor loaded, Tensor positions, int start, "
        "int window, float scale, int isa, float softcap=0., Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("invariant_decode_attn", invariant_decode_attn);
  m.impl("invariant_prefill_attn", invariant_prefill_attn);
}
