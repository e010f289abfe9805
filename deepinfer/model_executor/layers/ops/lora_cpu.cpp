// Batched LoRA deltas for rows that use different adapters (multi-LoRA serving):
//
//   lora_delta(x fp32 [T, K], slot int64 [T], a fp32 [S, R, K], b fp32 [S, N, R], scale fp32 [S], isa)
//       -> y fp32 [T, N]
//
// y[t] = (scale[s] * x[t] @ a[s]^T) @ b[s]^T for a row with slot s >= 0 (shrink to R, then expand to N),
// and y[t] = 0 for slot -1 (lora_kernels.py states the op; ops/lora.py holds its torch reference).
// Ranks below R are zero-padded rows of a and columns of b: they add exact zeros.
//
// Per row, the computation is one fixed sequence of fp32 operations on 16 lanes:
//
//   shrink  acc[l] = +0;  for each block of 16 inputs k0 ascending:  acc[l] = fma(a[s,j,k0+l], x[t,k0+l], acc[l])
//           (lanes past K read 0);  h[j] = tree(acc) * scale[s]
//           tree: p[i] = acc[i] + acc[i+8], q[i] = p[i] + p[i+4], u[i] = q[i] + q[i+2], u[0] + u[1]
//   expand  y[t,n] = +0;  for j = 0 .. R-1:  y[t,n] = fma(h[j], b[s,n,j], y[t,n])
//
// so a row's result is the same bits whatever other rows share the call, their slots, the thread
// count or the instruction set: AVX-512 (one 16-lane vector), AVX2 + FMA (two 8-lane halves) or
// portable C++ (16 scalar fmaf).
//
// How: the rows with an adapter are grouped by slot (a counting sort that keeps row order within a
// slot: segments). Shrink tasks are (segment, 64 rows, 4 ranks): panels of MR rows times 4 rows of a
// share each loaded vector. Expand tasks are (segment, 64 rows, 64 outputs): the task first copies
// b[s]'s 64 x R tile transposed ([R, 64], in L1), then every row's 64 outputs are 4 vectors of fma
// chains over j with h[j] broadcast. The same body is compiled per instruction set by including this
// file into itself under `#pragma GCC target`.
//
//   rows  t:   0   1   2   3   4   5        order (grouped by slot):  1 4 | 0 3 5
//   slot:      1   0  -1   1   0   1        segments:  slot 0 rows [0, 2), slot 1 rows [2, 5) of order
//                                           h [5, R]: h[i] belongs to row order[i]; y[2] = 0

#ifndef DEEPINFER_LORA_BODY

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <cstring>
#include <vector>

// The kernels' thread pool (work_pool.cpp): fn(begin, end) over [0, n) in chunks of at most grain items.
namespace deepinfer_pool {
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);
}

namespace deepinfer_lora {

#define LORA_INLINE inline __attribute__((always_inline))

constexpr int64_t kLanes = 16;
constexpr int64_t kRowChunk = 64;  // rows per task
constexpr int64_t kRankTile = 4;   // ranks (rows of a) per shrink task
constexpr int64_t kOutTile = 64;   // outputs per expand task: 4 vectors

// Rows order[start .. start + count) use adapter `slot`.
struct Segment {
  int64_t slot, start, count;
};

// A task: rows [i0, i1) of `order` (within one segment) times columns [c0, c0 + tile) of its output.
struct Task {
  int64_t seg, i0, i1, c0;
};

// What a call reads and writes.
struct Problem {
  const float* x;        // [T, K]
  const float* a;        // [S, R, K]
  const float* b;        // [S, N, R]
  const float* scale;    // [S]
  const int64_t* order;  // [n]: the rows with an adapter, grouped by slot
  float* h;              // [n, R]: h[i] of row order[i]
  float* y;              // [T, N]
  int64_t K, R, N;
};

}  // namespace deepinfer_lora

#define DEEPINFER_LORA_BODY 1

// ---- AVX-512: one vector of 16 lanes ---------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
namespace deepinfer_lora::v512 {
struct V {
  __m512 v;
  static LORA_INLINE V zero() { return {_mm512_setzero_ps()}; }
  static LORA_INLINE V load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static LORA_INLINE V load_part(const float* p, int64_t n) {  // lanes >= n read 0
    return {_mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p)};
  }
  static LORA_INLINE V bcast(float f) { return {_mm512_set1_ps(f)}; }
  LORA_INLINE void store(float* p) const { _mm512_storeu_ps(p, v); }
  static LORA_INLINE V fma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  LORA_INLINE float sum() const {  // the tree of the header
    const __m256 p = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(p), _mm256_extractf128_ps(p, 1));
    const __m128 u = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));
  }
};
constexpr int64_t MR = 4;  // rows per panel

// r[i] = row i of a 16 x 16 block -> r[j] = column j (the block transposed).
LORA_INLINE void transpose16(__m512 r[16]) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane k: rows 2i, 2i+1 interleaved
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4i + c], lane k: column 4k + c of rows 4i .. 4i + 3
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int c = 0; c < 4; ++c) {  // gather lane k of u[c], u[4 + c], u[8 + c], u[12 + c]: column 4k + c
    const __m512 lo01 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x44), hi01 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xEE);
    const __m512 lo23 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x44);
    const __m512 hi23 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_f32x4(lo01, lo23, 0x88);
    r[4 + c] = _mm512_shuffle_f32x4(lo01, lo23, 0xDD);
    r[8 + c] = _mm512_shuffle_f32x4(hi01, hi23, 0x88);
    r[12 + c] = _mm512_shuffle_f32x4(hi01, hi23, 0xDD);
  }
}

// bt[j, o] = b[o, j] for o < n (rows of R values), 0 for n <= o < kOutTile: 16 x 16 blocks in registers.
void pack_tile(const float* b, int64_t R, int64_t n, float* bt) {
  for (int64_t o0 = 0; o0 < kOutTile; o0 += 16)
    for (int64_t j0 = 0; j0 < R; j0 += 16) {
      const int64_t jc = std::min<int64_t>(16, R - j0);
      const __mmask16 mask = static_cast<__mmask16>((1u << jc) - 1);
      __m512 r[16];
      for (int64_t i = 0; i < 16; ++i)
        r[i] = o0 + i < n ? _mm512_maskz_loadu_ps(mask, b + (o0 + i) * R + j0) : _mm512_setzero_ps();
      transpose16(r);
      for (int64_t j = 0; j < jc; ++j) _mm512_storeu_ps(bt + (j0 + j) * kOutTile + o0, r[j]);
    }
}
#include "lora_cpu.cpp"  // this file: its body below, for this instruction set
}  // namespace deepinfer_lora::v512
#pragma GCC pop_options

// ---- AVX2 + FMA: two 8-lane halves (lanes 0-7, 8-15) ------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace deepinfer_lora::avx2 {
struct V {
  __m256 a, b;
  static LORA_INLINE V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static LORA_INLINE V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static LORA_INLINE __m256i mask(int64_t n) {  // lane l of a half set when l < n
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static LORA_INLINE V load_part(const float* p, int64_t n) {  // lanes >= n read 0
    return {_mm256_maskload_ps(p, mask(n)), _mm256_maskload_ps(p + 8, mask(n - 8))};
  }
  static LORA_INLINE V bcast(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
  LORA_INLINE void store(float* p) const {
    _mm256_storeu_ps(p, a);
    _mm256_storeu_ps(p + 8, b);
  }
  static LORA_INLINE V fma(V x, V y, V z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
  LORA_INLINE float sum() const {  // the tree of the header: lanes i + i+8 first
    const __m256 p = _mm256_add_ps(a, b);
    const __m128 q = _mm_add_ps(_mm256_castps256_ps128(p), _mm256_extractf128_ps(p, 1));
    const __m128 u = _mm_add_ps(q, _mm_movehl_ps(q, q));
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_shuffle_ps(u, u, 1)));
  }
};
constexpr int64_t MR = 2;  // rows per panel (16 registers)

// r[i] = row i of an 8 x 8 block -> r[j] = column j.
LORA_INLINE void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // u[4i + c], 128-bit lane k: column 4k + c of rows 4i .. 4i + 3
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int c = 0; c < 4; ++c) {
    r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
    r[4 + c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
  }
}

// bt[j, o] = b[o, j] for o < n (rows of R values), 0 for n <= o < kOutTile: 8 x 8 blocks in registers.
void pack_tile(const float* b, int64_t R, int64_t n, float* bt) {
  for (int64_t o0 = 0; o0 < kOutTile; o0 += 8)
    for (int64_t j0 = 0; j0 < R; j0 += 8) {
      const int64_t jc = std::min<int64_t>(8, R - j0);
      const __m256i mask = V::mask(jc);
      __m256 r[8];
      for (int64_t i = 0; i < 8; ++i)
        r[i] = o0 + i < n ? _mm256_maskload_ps(b + (o0 + i) * R + j0, mask) : _mm256_setzero_ps();
      transpose8(r);
      for (int64_t j = 0; j < jc; ++j) _mm256_storeu_ps(bt + (j0 + j) * kOutTile + o0, r[j]);
    }
}
#include "lora_cpu.cpp"  // this file: its body below, for this instruction set
}  // namespace deepinfer_lora::avx2
#pragma GCC pop_options

// ---- portable C++: 16 scalar lanes ----------------------------------------------------------------
namespace deepinfer_lora::plain {
struct V {
  float l[16];
  static V zero() {
    V r;
    for (float& f : r.l) f = 0.0f;
    return r;
  }
  static V load(const float* p) {
    V r;
    std::memcpy(r.l, p, sizeof(r.l));
    return r;
  }
  static V load_part(const float* p, int64_t n) {
    V r = zero();
    std::memcpy(r.l, p, static_cast<size_t>(n) * sizeof(float));
    return r;
  }
  static V bcast(float f) {
    V r;
    for (float& g : r.l) g = f;
    return r;
  }
  void store(float* p) const { std::memcpy(p, l, sizeof(l)); }
  static V fma(const V& x, const V& y, const V& z) {
    V r;
    for (int i = 0; i < 16; ++i) r.l[i] = std::fmaf(x.l[i], y.l[i], z.l[i]);
    return r;
  }
  float sum() const {
    float p[8], q[4], u[2];
    for (int i = 0; i < 8; ++i) p[i] = l[i] + l[i + 8];
    for (int i = 0; i < 4; ++i) q[i] = p[i] + p[i + 4];
    for (int i = 0; i < 2; ++i) u[i] = q[i] + q[i + 2];
    return u[0] + u[1];
  }
};
constexpr int64_t MR = 1;

// bt[j, o] = b[o, j] for o < n (rows of R values), 0 for n <= o < kOutTile.
void pack_tile(const float* b, int64_t R, int64_t n, float* bt) {
  for (int64_t j = 0; j < R; ++j)
    for (int64_t o = 0; o < kOutTile; ++o) bt[j * kOutTile + o] = o < n ? b[o * R + j] : 0.0f;
}
#include "lora_cpu.cpp"  // this file: its body below, for this instruction set
}  // namespace deepinfer_lora::plain

#undef DEEPINFER_LORA_BODY

// ---- dispatch and the op ----------------------------------------------------------------------

namespace deepinfer_lora {
namespace {

bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

bool has_avx512() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

// The variants this CPU runs, bit `isa` set for each: 0 portable C++ (always), 1 AVX2 + FMA, 2 AVX-512.
int64_t lora_cpu_isas() { return 1 | (has_avx2() ? 2 : 0) | (has_avx512() ? 4 : 0); }

// Counting sort of the rows by slot (row order kept within a slot): `order` and the non-empty segments;
// rows with slot -1 are left out. Slots must lie in [-1, S).
std::vector<Segment> group_rows(const int64_t* slot, int64_t T, int64_t S, std::vector<int64_t>& order) {
  std::vector<int64_t> count(S + 1, 0);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK_VALUE(slot[t] >= -1 && slot[t] < S, "lora_delta: slot[", t, "] = ", slot[t],
                      " is outside [-1, ", S, ")");
    ++count[slot[t] + 1];
  }
  std::vector<Segment> segments;
  std::vector<int64_t> next(S + 1, 0);
  int64_t start = 0;
  for (int64_t s = 0; s < S; ++s) {
    next[s + 1] = start;
    if (count[s + 1]) segments.push_back({s, start, count[s + 1]});
    start += count[s + 1];
  }
  order.resize(start);
  for (int64_t t = 0; t < T; ++t)
    if (slot[t] >= 0) order[next[slot[t] + 1]++] = t;
  return segments;
}

// Tasks of up to kRowChunk rows of one segment times `cols` columns in tiles of `tile`.
std::vector<Task> make_tasks(const std::vector<Segment>& segments, int64_t cols, int64_t tile) {
  std::vector<Task> tasks;
  for (int64_t g = 0; g < static_cast<int64_t>(segments.size()); ++g) {
    const Segment& sg = segments[g];
    for (int64_t i0 = sg.start; i0 < sg.start + sg.count; i0 += kRowChunk)
      for (int64_t c0 = 0; c0 < cols; c0 += tile)
        tasks.push_back({g, i0, std::min(i0 + kRowChunk, sg.start + sg.count), c0});
  }
  return tasks;
}

// Run every task on the variant `isa`, `work` multiply-adds in all; a thread takes at least ~64 K of them (small
// calls stay on one thread).
template <typename Fn2, typename Fn1, typename Fn0>
void run(const std::vector<Task>& tasks, int64_t work, int64_t isa, Fn2 f512, Fn1 f256, Fn0 fplain) {
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  const int64_t grain = std::max<int64_t>(1, num_tasks * (int64_t{1} << 16) / std::max<int64_t>(work, 1));
  deepinfer_pool::parallel_for(num_tasks, grain, [&](int64_t k0, int64_t k1) {
    if (isa == 2) f512(k0, k1);
    else if (isa == 1) f256(k0, k1);
    else fplain(k0, k1);
  });
}

// ValueError naming the first argument whose shape or dtype does not fit.
void check_inputs(const at::Tensor& x, const at::Tensor& slot, const at::Tensor& a, const at::Tensor& b,
                  const at::Tensor& scale) {
  TORCH_CHECK_VALUE(x.dim() == 2, "lora_delta: x must be [T, in], got ", x.sizes());
  const int64_t T = x.size(0), K = x.size(1);
  TORCH_CHECK_VALUE(slot.dim() == 1 && slot.size(0) == T && slot.scalar_type() == at::kLong,
                    "lora_delta: slot must be int64 [", T, "], got ", slot.scalar_type(), " ", slot.sizes());
  TORCH_CHECK_VALUE(a.dim() == 3 && a.size(2) == K, "lora_delta: a must be [S, r_max, ", K, "], got ", a.sizes());
  const int64_t S = a.size(0), R = a.size(1);
  TORCH_CHECK_VALUE(b.dim() == 3 && b.size(0) == S && b.size(2) == R, "lora_delta: b must be [", S, ", out, ", R,
                    "], got ", b.sizes());
  TORCH_CHECK_VALUE(scale.dim() == 1 && scale.size(0) == S, "lora_delta: scale must be [", S, "], got ",
                    scale.sizes());
  for (const at::Tensor* t : {&x, &a, &b, &scale})
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat, "lora_delta: x, a, b and scale must be float32, got ",
                      t->scalar_type());
}

at::Tensor lora_delta(const at::Tensor& x, const at::Tensor& slot, const at::Tensor& a, const at::Tensor& b,
                      const at::Tensor& scale, int64_t isa) {
  TORCH_CHECK_VALUE(isa >= 0 && isa <= 2, "lora_delta: isa must be 0 (plain), 1 (AVX2) or 2 (AVX-512), got ", isa);
  TORCH_CHECK_VALUE(lora_cpu_isas() >> isa & 1, "lora_delta: this CPU cannot run isa ", isa);
  check_inputs(x, slot, a, b, scale);
  const int64_t T = x.size(0), K = x.size(1), S = a.size(0), R = a.size(1), N = b.size(1);
  const at::Tensor xc = x.contiguous(), sc = slot.contiguous(), ac = a.contiguous(), bc = b.contiguous();
  const at::Tensor scc = scale.contiguous();
  std::vector<int64_t> order;
  const std::vector<Segment> segments = group_rows(sc.data_ptr<int64_t>(), T, S, order);
  at::Tensor y = at::empty({T, N}, x.options());
  float* yp = y.data_ptr<float>();
  const int64_t* slots = sc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    if (slots[t] < 0) std::memset(yp + t * N, 0, static_cast<size_t>(N) * sizeof(float));
  if (order.empty() || N == 0) return y;
  if (R == 0) return y.zero_();  // rank 0: every delta is 0
  std::vector<float> h(order.size() * R);
  const Problem pb{xc.data_ptr<float>(), ac.data_ptr<float>(), bc.data_ptr<float>(), scc.data_ptr<float>(),
                   order.data(), h.data(), yp, K, R, N};
  const std::vector<Task> shrinks = make_tasks(segments, R, kRankTile);
  const int64_t rows = static_cast<int64_t>(order.size());
  run(shrinks, rows * R * K, isa,
      [&](int64_t k0, int64_t k1) { v512::shrink_tasks(pb, segments, shrinks, k0, k1); },
      [&](int64_t k0, int64_t k1) { avx2::shrink_tasks(pb, segments, shrinks, k0, k1); },
      [&](int64_t k0, int64_t k1) { plain::shrink_tasks(pb, segments, shrinks, k0, k1); });
  const std::vector<Task> expands = make_tasks(segments, N, kOutTile);
  run(expands, rows * N * R, isa,
      [&](int64_t k0, int64_t k1) { v512::expand_tasks(pb, segments, expands, k0, k1); },
      [&](int64_t k0, int64_t k1) { avx2::expand_tasks(pb, segments, expands, k0, k1); },
      [&](int64_t k0, int64_t k1) { plain::expand_tasks(pb, segments, expands, k0, k1); });
  return y;
}

}  // namespace
}  // namespace deepinfer_lora

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("lora_delta(Tensor x, Tensor slot, Tensor a, Tensor b, Tensor scale, int isa) -> Tensor");
  m.def("lora_cpu_isas() -> int", deepinfer_lora::lora_cpu_isas);
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) { m.impl("lora_delta", deepinfer_lora::lora_delta); }

#else  // DEEPINFER_LORA_BODY: the body, compiled once per instruction set with its `V` and `MR`

// h[i, j0 .. j0 + J) for rows i0 .. i0 + ROWS of `order`: the shrink's lanes over K, then the tree.
template <int64_t ROWS, int64_t J>
LORA_INLINE void shrink_panel(const Problem& pb, const float* a_s, float scale, int64_t i0, int64_t j0) {
  V acc[ROWS][J];
  const float* xr[ROWS];
  for (int64_t i = 0; i < ROWS; ++i) {
    xr[i] = pb.x + pb.order[i0 + i] * pb.K;
    for (int64_t j = 0; j < J; ++j) acc[i][j] = V::zero();
  }
  const float* ar = a_s + j0 * pb.K;
  const int64_t full = pb.K / kLanes * kLanes;
  for (int64_t k = 0; k < full; k += kLanes) {
    V xv[ROWS];
    for (int64_t i = 0; i < ROWS; ++i) xv[i] = V::load(xr[i] + k);
    for (int64_t j = 0; j < J; ++j) {
      const V av = V::load(ar + j * pb.K + k);
      for (int64_t i = 0; i < ROWS; ++i) acc[i][j] = V::fma(av, xv[i], acc[i][j]);
    }
  }
  if (full < pb.K) {  // the last block: lanes past K read 0, so fma(0, 0, acc) = acc
    const int64_t n = pb.K - full;
    V xv[ROWS];
    for (int64_t i = 0; i < ROWS; ++i) xv[i] = V::load_part(xr[i] + full, n);
    for (int64_t j = 0; j < J; ++j) {
      const V av = V::load_part(ar + j * pb.K + full, n);
      for (int64_t i = 0; i < ROWS; ++i) acc[i][j] = V::fma(av, xv[i], acc[i][j]);
    }
  }
  for (int64_t i = 0; i < ROWS; ++i)
    for (int64_t j = 0; j < J; ++j) pb.h[(i0 + i) * pb.R + j0 + j] = acc[i][j].sum() * scale;
}

// Rows [i0, i1) in panels of MR, then single rows; J ranks from j0.
template <int64_t J>
LORA_INLINE void shrink_rows(const Problem& pb, const float* a_s, float scale, int64_t i0, int64_t i1, int64_t j0) {
  for (; i0 + MR <= i1; i0 += MR) shrink_panel<MR, J>(pb, a_s, scale, i0, j0);
  for (; i0 < i1; ++i0) shrink_panel<1, J>(pb, a_s, scale, i0, j0);
}

void shrink_tasks(const Problem& pb, const std::vector<Segment>& segments, const std::vector<Task>& tasks,
                  int64_t k0, int64_t k1) {
  for (int64_t k = k0; k < k1; ++k) {
    const Task& tk = tasks[k];
    const int64_t s = segments[tk.seg].slot;
    const float* a_s = pb.a + s * pb.R * pb.K;
    const float scale = pb.scale[s];
    switch (std::min(kRankTile, pb.R - tk.c0)) {
      case 4: shrink_rows<4>(pb, a_s, scale, tk.i0, tk.i1, tk.c0); break;
      case 3: shrink_rows<3>(pb, a_s, scale, tk.i0, tk.i1, tk.c0); break;
      case 2: shrink_rows<2>(pb, a_s, scale, tk.i0, tk.i1, tk.c0); break;
      default: shrink_rows<1>(pb, a_s, scale, tk.i0, tk.i1, tk.c0); break;
    }
  }
}

// y[order[i], o0 .. o0 + n) for rows i0 .. i0 + ROWS: fma chains over j with h[i, j] broadcast; `bt` [R, kOutTile].
template <int64_t ROWS>
LORA_INLINE void expand_panel(const Problem& pb, const float* bt, int64_t i0, int64_t o0, int64_t n) {
  constexpr int64_t NV = kOutTile / kLanes;
  V acc[ROWS][NV];
  for (int64_t i = 0; i < ROWS; ++i)
    for (int64_t v = 0; v < NV; ++v) acc[i][v] = V::zero();
  for (int64_t j = 0; j < pb.R; ++j) {
    V hb[ROWS];
    for (int64_t i = 0; i < ROWS; ++i) hb[i] = V::bcast(pb.h[(i0 + i) * pb.R + j]);
    for (int64_t v = 0; v < NV; ++v) {
      const V bv = V::load(bt + j * kOutTile + v * kLanes);
      for (int64_t i = 0; i < ROWS; ++i) acc[i][v] = V::fma(hb[i], bv, acc[i][v]);
    }
  }
  for (int64_t i = 0; i < ROWS; ++i) {
    float* out = pb.y + pb.order[i0 + i] * pb.N + o0;
    if (n == kOutTile) {
      for (int64_t v = 0; v < NV; ++v) acc[i][v].store(out + v * kLanes);
    } else {
      alignas(64) float tmp[kOutTile];
      for (int64_t v = 0; v < NV; ++v) acc[i][v].store(tmp + v * kLanes);
      std::memcpy(out, tmp, static_cast<size_t>(n) * sizeof(float));
    }
  }
}

void expand_tasks(const Problem& pb, const std::vector<Segment>& segments, const std::vector<Task>& tasks,
                  int64_t k0, int64_t k1) {
  std::vector<float> bt(pb.R * kOutTile);
  for (int64_t k = k0; k < k1; ++k) {
    const Task& tk = tasks[k];
    const int64_t n = std::min(kOutTile, pb.N - tk.c0);
    const float* b_s = pb.b + (segments[tk.seg].slot * pb.N + tk.c0) * pb.R;  // [n, R]
    pack_tile(b_s, pb.R, n, bt.data());  // the tile transposed: bt[j, o] = b[s, c0 + o, j], 0 past N
    int64_t i0 = tk.i0;
    for (; i0 + MR <= tk.i1; i0 += MR) expand_panel<MR>(pb, bt.data(), i0, tk.c0, n);
    for (; i0 < tk.i1; ++i0) expand_panel<1>(pb, bt.data(), i0, tk.c0, n);
  }
}

#endif  // DEEPINFER_LORA_BODY
