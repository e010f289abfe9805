// Quantized-weight matmul on the CPU: y[M, N] = x[M, K] @ W[N, K]^T, W kept as packed integers.
//
// One packed layout for every source format (repacked once at load, see qmatmul.py):
//
//   bits 4   q uint8 [N, K/2]   group g (32 values): bytes g*16 .. g*16+15,
//                               low nibble of byte j = value g*32 + j, high nibble = g*32 + 16 + j
//   bits 8   q int8  [N, K]     natural order, groups of 16 or 32 values
//   scale, minv  [N, K/G]       w = q * scale + minv  (q unsigned for 4 bits, signed for 8), both
//                               float32, or both float16 (half the bytes; GGUF's d and m are fp16)
//
// Each group is widened to fp32 in registers and multiplied with fp32 activations; nothing of W
// is materialized. A weight row is dequantized once per tile of MR activation rows, so a batch
// of M rows costs one read of W per tile. Threads split the N output rows (at::parallel_for,
// torch's own pool). Two instruction sets are compiled into one library (function-level target
// attributes) and chosen per call: `isa` 2 = AVX-512, 1 = AVX2 + FMA. Per output, the products
// are summed lane-wise in group order and then across lanes, whatever M or the thread count is.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kGrainRows = 16;  // output rows per parallel task, at least
constexpr int64_t kBlockBytes = 16 * 1024;  // weight bytes a row block keeps in cache

inline int64_t rows_per_block(int64_t row_bytes) { return std::max<int64_t>(1, kBlockBytes / row_bytes); }

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c")))
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

// A scale or min as fp32: stored as fp32, or as fp16 bits where fp16 holds it exactly (GGUF's own
// d and m); F16C converts one in a single instruction.
inline float f32(float v) { return v; }
__attribute__((target("f16c"))) inline float f32(uint16_t h) { return _cvtsh_ss(h); }

// ---- AVX-512: 16 lanes --------------------------------------------------------------------

// Values 16c .. 16c+15 of group g as fp32.
template <int BITS, int G>
AVX512_TARGET inline __m512 deq16(const uint8_t* q, int64_t g, int c, __m512 s, __m512 m) {
  __m512i v;
  if constexpr (BITS == 4) {
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * 16)));
    v = c == 0 ? _mm512_and_si512(b, _mm512_set1_epi32(0xF)) : _mm512_srli_epi32(b, 4);
  } else {
    v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + g * G + c * 16)));
  }
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), s, m);
}

// MR activation rows times one weight row: y[r * ldy] for r < MR.
template <int BITS, int G, int MR, typename S>
AVX512_TARGET void tile512(const float* x, int64_t ldx, const uint8_t* q, const S* scale, const S* minv,
                           int64_t K, float* y, int64_t ldy) {
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / G; ++g) {
    const __m512 s = _mm512_set1_ps(f32(scale[g])), m = _mm512_set1_ps(f32(minv[g]));
    for (int c = 0; c < G / 16; ++c) {
      const __m512 w = deq16<BITS, G>(q, g, c, s, m);
      const float* xc = x + g * G + c * 16;
      for (int r = 0; r < MR; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(xc + r * ldx), w, acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) y[r * ldy] = _mm512_reduce_add_ps(acc[r]);
}

// Output rows in blocks of `rows_per_block(ldq)` weight rows (about 16 KB of weight): each tile
// of 8 activation rows (in L1) runs over the whole block (in L1/L2) before the next tile starts.
template <int BITS, int G, typename S>
AVX512_TARGET void rows512(const float* x, int64_t M, int64_t K, const uint8_t* q, int64_t ldq, const S* scale,
                           const S* minv, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t ngroups = K / G, block = rows_per_block(ldq);
  for (int64_t b0 = n0; b0 < n1; b0 += block) {
    const int64_t b1 = std::min(b0 + block, n1);
    for (int64_t m = 0; m < M;) {
      const int64_t mr = M - m >= 8 ? 8 : M - m >= 4 ? 4 : M - m >= 2 ? 2 : 1;
      for (int64_t n = b0; n < b1; ++n) {
        const uint8_t* qn = q + n * ldq;
        const S *sn = scale + n * ngroups, *mn = minv + n * ngroups;
        const float* xm = x + m * K;
        float* yn = y + m * N + n;
        if (mr == 8) tile512<BITS, G, 8, S>(xm, K, qn, sn, mn, K, yn, N);
        else if (mr == 4) tile512<BITS, G, 4, S>(xm, K, qn, sn, mn, K, yn, N);
        else if (mr == 2) tile512<BITS, G, 2, S>(xm, K, qn, sn, mn, K, yn, N);
        else tile512<BITS, G, 1, S>(xm, K, qn, sn, mn, K, yn, N);
      }
      m += mr;
    }
  }
}

// fp32 out, or bf16 (round to nearest even, as torch's .to(bfloat16) rounds finite values).
AVX512_TARGET inline void store16(float* out, __m512 v) { _mm512_storeu_ps(out, v); }

AVX512_TARGET inline void store16(uint16_t* out, __m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i top = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(top));
}

template <int BITS, int G, typename OUT, typename S>
AVX512_TARGET void dequant512(const uint8_t* q, int64_t ldq, const S* scale, const S* minv, int64_t K,
                              OUT* out, int64_t n0, int64_t n1) {
  const int64_t ngroups = K / G;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t g = 0; g < ngroups; ++g) {
      const __m512 s = _mm512_set1_ps(f32(scale[n * ngroups + g])), m = _mm512_set1_ps(f32(minv[n * ngroups + g]));
      for (int c = 0; c < G / 16; ++c) store16(out + n * K + g * G + c * 16, deq16<BITS, G>(q + n * ldq, g, c, s, m));
    }
  }
}

// ---- AVX2: 8 lanes ------------------------------------------------------------------------

// Values 8c .. 8c+7 of group g as fp32.
template <int BITS, int G>
AVX2_TARGET inline __m256 deq8(const uint8_t* q, int64_t g, int c, __m256 s, __m256 m) {
  __m256i v;
  if constexpr (BITS == 4) {
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + g * 16 + (c & 1) * 8));
    const __m256i b = _mm256_cvtepu8_epi32(raw);
    v = c < 2 ? _mm256_and_si256(b, _mm256_set1_epi32(0xF)) : _mm256_srli_epi32(b, 4);
  } else {
    v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + g * G + c * 8)));
  }
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), s, m);
}

AVX2_TARGET inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int BITS, int G, int MR, typename S>
AVX2_TARGET void tile256(const float* x, int64_t ldx, const uint8_t* q, const S* scale, const S* minv,
                         int64_t K, float* y, int64_t ldy) {
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < K / G; ++g) {
    const __m256 s = _mm256_set1_ps(f32(scale[g])), m = _mm256_set1_ps(f32(minv[g]));
    for (int c = 0; c < G / 8; ++c) {
      const __m256 w = deq8<BITS, G>(q, g, c, s, m);
      // 4-bit chunk c holds values 8c .. 8c+7 too: low nibbles of bytes 0..15, then high nibbles.
      const float* xc = x + g * G + c * 8;
      for (int r = 0; r < MR; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xc + r * ldx), w, acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) y[r * ldy] = hsum256(acc[r]);
}

template <int BITS, int G, typename S>
AVX2_TARGET void rows256(const float* x, int64_t M, int64_t K, const uint8_t* q, int64_t ldq, const S* scale,
                           const S* minv, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t ngroups = K / G, block = rows_per_block(ldq);
  for (int64_t b0 = n0; b0 < n1; b0 += block) {
    const int64_t b1 = std::min(b0 + block, n1);
    for (int64_t m = 0; m < M;) {
      const int64_t mr = M - m >= 8 ? 8 : M - m >= 4 ? 4 : M - m >= 2 ? 2 : 1;
      for (int64_t n = b0; n < b1; ++n) {
        const uint8_t* qn = q + n * ldq;
        const S *sn = scale + n * ngroups, *mn = minv + n * ngroups;
        const float* xm = x + m * K;
        float* yn = y + m * N + n;
        if (mr == 8) tile256<BITS, G, 8, S>(xm, K, qn, sn, mn, K, yn, N);
        else if (mr == 4) tile256<BITS, G, 4, S>(xm, K, qn, sn, mn, K, yn, N);
        else if (mr == 2) tile256<BITS, G, 2, S>(xm, K, qn, sn, mn, K, yn, N);
        else tile256<BITS, G, 1, S>(xm, K, qn, sn, mn, K, yn, N);
      }
      m += mr;
    }
  }
}

AVX2_TARGET inline void store8(float* out, __m256 v) { _mm256_storeu_ps(out, v); }

AVX2_TARGET inline void store8(uint16_t* out, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), packed);
}

template <int BITS, int G, typename OUT, typename S>
AVX2_TARGET void dequant256(const uint8_t* q, int64_t ldq, const S* scale, const S* minv, int64_t K,
                            OUT* out, int64_t n0, int64_t n1) {
  const int64_t ngroups = K / G;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t g = 0; g < ngroups; ++g) {
      const __m256 s = _mm256_set1_ps(f32(scale[n * ngroups + g])), m = _mm256_set1_ps(f32(minv[n * ngroups + g]));
      for (int c = 0; c < G / 8; ++c) store8(out + n * K + g * G + c * 8, deq8<BITS, G>(q + n * ldq, g, c, s, m));
    }
  }
}

// ---- dispatch -----------------------------------------------------------------------------

template <typename S>
using RowsFn = void (*)(const float*, int64_t, int64_t, const uint8_t*, int64_t, const S*, const S*, float*, int64_t,
                        int64_t, int64_t);
template <typename OUT, typename S>
using DequantFn = void (*)(const uint8_t*, int64_t, const S*, const S*, int64_t, OUT*, int64_t, int64_t);

template <typename S>
struct Kernels {
  RowsFn<S> rows;
  DequantFn<float, S> dequant_f32;
  DequantFn<uint16_t, S> dequant_bf16;
};

template <int BITS, int G, typename S>
Kernels<S> kernels_for(int64_t isa) {
  if (isa == 2) return {rows512<BITS, G, S>, dequant512<BITS, G, float, S>, dequant512<BITS, G, uint16_t, S>};
  return {rows256<BITS, G, S>, dequant256<BITS, G, float, S>, dequant256<BITS, G, uint16_t, S>};
}

template <typename S>
Kernels<S> select(int64_t bits, int64_t group, int64_t isa) {
  TORCH_CHECK(isa == 1 || isa == 2, "qmatmul: isa must be 1 (AVX2) or 2 (AVX-512), got ", isa);
  TORCH_CHECK(isa != 2 || (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")),
              "qmatmul: this CPU has no AVX-512 (F, BW, VL, DQ)");
  TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"),
              "qmatmul: this CPU has no AVX2 + FMA + F16C");
  if (bits == 4 && group == 32) return kernels_for<4, 32, S>(isa);
  if (bits == 8 && group == 32) return kernels_for<8, 32, S>(isa);
  if (bits == 8 && group == 16) return kernels_for<8, 16, S>(isa);
  TORCH_CHECK(false, "qmatmul: no kernel for bits=", bits, " group=", group, " (have 4/32, 8/32, 8/16)");
}

void check_weight(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& minv, int64_t bits, int64_t group,
                  int64_t K) {
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.element_size() == 1, "qmatmul: q must be a contiguous 2-D byte tensor");
  TORCH_CHECK(K % group == 0, "qmatmul: K=", K, " is not a multiple of group=", group);
  TORCH_CHECK(q.size(1) * (bits == 4 ? 2 : 1) == K, "qmatmul: q has ", q.size(1), " bytes per row for K=", K);
  TORCH_CHECK(scale.scalar_type() == minv.scalar_type() &&
                  (scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kHalf),
              "qmatmul: scale and minv must both be float32 or both float16, got ", scale.scalar_type(), " and ",
              minv.scalar_type());
  for (const at::Tensor* t : {&scale, &minv}) {
    TORCH_CHECK(t->is_contiguous(), "qmatmul: scale/minv must be contiguous");
    TORCH_CHECK(t->dim() == 2 && t->size(0) == q.size(0) && t->size(1) == K / group, "qmatmul: scale/minv must be [N, K/group]");
  }
}

// fp32 scales as float, fp16 ones as their bits.
template <typename S>
const S* scales_of(const at::Tensor& t) { return static_cast<const S*>(t.data_ptr()); }

template <typename S>
void qmatmul_rows(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& minv,
                  int64_t bits, int64_t group, int64_t isa, at::Tensor& y) {
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), ldq = q.size(1);
  const RowsFn<S> rows = select<S>(bits, group, isa).rows;
  const float* xp = x.data_ptr<float>();
  const S *sp = scales_of<S>(scale), *mp = scales_of<S>(minv);
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, kGrainRows, [&](int64_t n0, int64_t n1) { rows(xp, M, K, qp, ldq, sp, mp, yp, N, n0, n1); });
}

at::Tensor qmatmul(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& minv,
                   int64_t bits, int64_t group, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "qmatmul: x must be a 2-D float32 tensor");
  const at::Tensor xc = x.contiguous();
  check_weight(q, scale, minv, bits, group, xc.size(1));
  at::Tensor y = at::empty({xc.size(0), q.size(0)}, xc.options());
  if (xc.size(0) == 0) return y;
  if (scale.scalar_type() == at::kHalf) qmatmul_rows<uint16_t>(xc, q, scale, minv, bits, group, isa, y);
  else qmatmul_rows<float>(xc, q, scale, minv, bits, group, isa, y);
  return y;
}

template <typename S>
void dequant_rows(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& minv, int64_t bits, int64_t group,
                  int64_t isa, bool bf16, at::Tensor& out) {
  const int64_t N = q.size(0), K = out.size(1), ldq = q.size(1);
  const Kernels<S> kernels = select<S>(bits, group, isa);
  const S *sp = scales_of<S>(scale), *mp = scales_of<S>(minv);
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  void* op = out.data_ptr();
  at::parallel_for(0, N, kGrainRows, [&](int64_t n0, int64_t n1) {
    if (bf16) kernels.dequant_bf16(qp, ldq, sp, mp, K, static_cast<uint16_t*>(op), n0, n1);
    else kernels.dequant_f32(qp, ldq, sp, mp, K, static_cast<float*>(op), n0, n1);
  });
}

// The dense weight [N, K] in float32 or (bf16 = true) bfloat16.
at::Tensor qdequant(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& minv, int64_t bits, int64_t group,
                    int64_t isa, bool bf16) {
  const int64_t N = q.size(0), K = q.size(1) * (bits == 4 ? 2 : 1);
  check_weight(q, scale, minv, bits, group, K);
  at::Tensor out = at::empty({N, K}, q.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  if (scale.scalar_type() == at::kHalf) dequant_rows<uint16_t>(q, scale, minv, bits, group, isa, bf16, out);
  else dequant_rows<float>(q, scale, minv, bits, group, isa, bf16, out);
  return out;
}

// Instruction sets this CPU can run: 2 = AVX-512 (F, BW, VL, DQ), 1 = AVX2 + FMA (+ F16C), 0 = neither.
int64_t cpu_isa() {
  if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))) return 0;
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return avx512 ? 2 : 1;
}

}  // namespace

TORCH_LIBRARY(deepinfer_cpu, m) {
  m.def("qmatmul(Tensor x, Tensor q, Tensor scale, Tensor minv, int bits, int group, int isa) -> Tensor");
  m.def("qdequant(Tensor q, Tensor scale, Tensor minv, int bits, int group, int isa, bool bf16=False) -> Tensor");
  m.def("cpu_isa() -> int", cpu_isa);
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("qmatmul", qmatmul);
  m.impl("qdequant", qdequant);
}
