// MXFP4 weights as stored (GPT-OSS `*_blocks` / `*_scales`), multiplied without dequantizing them first:
//
//   mxfp4_matmul(x fp32 [M, K], blocks uint8 [N, K/2], scales uint8 [N, K/32], isa) -> y fp32 [M, N]
//
// y = x @ W^T, W[n, 32b + 2j] = E2M1[blocks[n, 16b + j] & 15] * 2^(scales[n, b] - 127) and
// W[n, 32b + 2j + 1] the same with the high nibble (mxfp4.py states the format; its torch reference
// dequantizes, then multiplies).
//
// Per output (m, n) the computation is one fixed sequence of fp32 operations, on 16 lanes:
//
//   acc[l] = +0                                          l = 0 .. 15
//   for each block b ascending:
//     acc[l] = fma(W[n, 32b + 2l],     x[m, 32b + 2l],     acc[l])     (the low nibbles)
//     acc[l] = fma(W[n, 32b + 2l + 1], x[m, 32b + 2l + 1], acc[l])     (the high nibbles)
//   y = c[0] + c[1]   where a[i] = acc[i] + acc[i+8], b[i] = a[i] + a[i+4], c[i] = b[i] + b[i+2]
//
// Each weight value is exact in fp32 (a 4-bit value times a power of two), and every fma rounds
// once, so the result is the same bits whatever M, the row's position, the thread count or the
// instruction set: AVX-512 (one 16-lane vector), AVX2 + FMA (two 8-lane halves), or portable C++
// (16 scalar fmaf). Activation rows are first split per block into their even and odd values, so
// a decoded block (16 bytes -> the 16 low-nibble and the 16 high-nibble values) meets its inputs
// lane for lane.
//
// How: threads take tiles of R weight rows. Up to kFusedRows activation rows, each block is decoded
// in registers and used at once; more rows decode the tile once into a buffer (the same values)
// that every panel of MR activation rows then reads. The same body is compiled per instruction set
// by including this file into itself under `#pragma GCC target`.

#ifndef DEEPINFER_MXFP4_BODY

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

namespace deepinfer_mxfp4 {

#define MXFP4_INLINE inline __attribute__((always_inline))

constexpr int64_t kBlock = 32;      // values per scale byte
constexpr int64_t kBlockBytes = 16;  // bytes of packed values per block
constexpr int64_t kFusedRows = 4;   // up to this many activation rows: blocks decoded in registers
constexpr int64_t kTileRows = 4;    // weight rows per task

// The E2M1 values of codes 0 .. 15 (bit 3 the sign).
alignas(64) constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                         -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// 2^(s - 127) for a UE8M0 byte s: its bits, or 2^-127 (a subnormal) for s = 0.
MXFP4_INLINE float scale_of(uint8_t s) {
  const uint32_t bits = s == 0 ? 0x00400000u : static_cast<uint32_t>(s) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// What a call reads and writes: activations split per block into even | odd values.
struct Problem {
  const float* xs;      // [M, K]: per block, x[32b + 2l] at 32b + l and x[32b + 2l + 1] at 32b + 16 + l
  const uint8_t* w;     // [N, K/2]
  const uint8_t* s;     // [N, K/32]
  float* y;             // [M, N]
  int64_t M, N, K;
};

}  // namespace deepinfer_mxfp4

#define DEEPINFER_MXFP4_BODY 1

// ---- AVX-512: one vector of 16 lanes ---------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
namespace deepinfer_mxfp4::v512 {
struct V {
  __m512 v;
  static MXFP4_INLINE V zero() { return {_mm512_setzero_ps()}; }
  static MXFP4_INLINE V load(const float* p) { return {_mm512_loadu_ps(p)}; }
  MXFP4_INLINE void store(float* p) const { _mm512_storeu_ps(p, v); }
  static MXFP4_INLINE V fma(V a, V b, V c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  // 16 packed bytes at scale `scale` -> the low-nibble values (lo) and the high-nibble values (hi)
  static MXFP4_INLINE void decode(const uint8_t* p, float scale, V& lo, V& hi) {
    const __m512 lut = _mm512_load_ps(kE2M1), sc = _mm512_set1_ps(scale);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i low = _mm512_and_si512(bytes, _mm512_set1_epi32(15)), high = _mm512_srli_epi32(bytes, 4);
    lo.v = _mm512_mul_ps(_mm512_permutexvar_ps(low, lut), sc);
    hi.v = _mm512_mul_ps(_mm512_permutexvar_ps(high, lut), sc);
  }
  MXFP4_INLINE float sum() const {  // the tree of the header
    const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
  }
};
constexpr int64_t MR = 4;  // activation rows per panel
#include "mxfp4_cpu.cpp"  // this file: its body below, for this instruction set
}  // namespace deepinfer_mxfp4::v512
#pragma GCC pop_options

// ---- AVX2 + FMA: two 8-lane halves (lanes 0-7, 8-15) ------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace deepinfer_mxfp4::avx2 {
struct V {
  __m256 a, b;
  static MXFP4_INLINE V zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static MXFP4_INLINE V load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  MXFP4_INLINE void store(float* p) const {
    _mm256_storeu_ps(p, a);
    _mm256_storeu_ps(p + 8, b);
  }
  static MXFP4_INLINE V fma(V x, V y, V z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
  // codes (int32 lanes) -> values: the magnitude from an 8-entry table, bit 3 moved to the sign bit
  static MXFP4_INLINE __m256 value(__m256i code, __m256 mags, __m256 sc) {
    const __m256 mag = _mm256_permutevar8x32_ps(mags, code);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(8)), 28);
    return _mm256_mul_ps(_mm256_xor_ps(mag, _mm256_castsi256_ps(sign)), sc);
  }
  static MXFP4_INLINE void decode(const uint8_t* p, float scale, V& lo, V& hi) {
    const __m256 mags = _mm256_load_ps(kE2M1), sc = _mm256_set1_ps(scale);
    const __m256i m15 = _mm256_set1_epi32(15);
    const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    lo = {value(_mm256_and_si256(b0, m15), mags, sc), value(_mm256_and_si256(b1, m15), mags, sc)};
    hi = {value(_mm256_srli_epi32(b0, 4), mags, sc), value(_mm256_srli_epi32(b1, 4), mags, sc)};
  }
  MXFP4_INLINE float sum() const {  // the tree of the header: lanes i + i+8 first
    const __m256 s = _mm256_add_ps(a, b);
    const __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    const __m128 c = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
  }
};
constexpr int64_t MR = 2;  // activation rows per panel (16 registers)
#include "mxfp4_cpu.cpp"  // this file: its body below, for this instruction set
}  // namespace deepinfer_mxfp4::avx2
#pragma GCC pop_options

// ---- portable C++: 16 scalar lanes ----------------------------------------------------------------
namespace deepinfer_mxfp4::plain {
struct V {
  float l[16];
  static V zero() {
    V r;
    for (float& x : r.l) x = 0.0f;
    return r;
  }
  static V load(const float* p) {
    V r;
    std::memcpy(r.l, p, sizeof(r.l));
    return r;
  }
  void store(float* p) const { std::memcpy(p, l, sizeof(l)); }
  static V fma(const V& x, const V& y, const V& z) {
    V r;
    for (int i = 0; i < 16; ++i) r.l[i] = std::fmaf(x.l[i], y.l[i], z.l[i]);
    return r;
  }
  static void decode(const uint8_t* p, float scale, V& lo, V& hi) {
    for (int i = 0; i < 16; ++i) {
      lo.l[i] = kE2M1[p[i] & 15] * scale;
      hi.l[i] = kE2M1[p[i] >> 4] * scale;
    }
  }
  float sum() const {
    float a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i) a[i] = l[i] + l[i + 8];
    for (int i = 0; i < 4; ++i) b[i] = a[i] + a[i + 4];
    for (int i = 0; i < 2; ++i) c[i] = b[i] + b[i + 2];
    return c[0] + c[1];
  }
};
constexpr int64_t MR = 1;
#include "mxfp4_cpu.cpp"  // this file: its body below, for this instruction set
}  // namespace deepinfer_mxfp4::plain

#undef DEEPINFER_MXFP4_BODY

// ---- dispatch and the op ----------------------------------------------------------------------

namespace deepinfer_mxfp4 {
namespace {

bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }

bool has_avx512() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

// The variants this CPU runs, bit `isa` set for each: 0 portable C++ (always), 1 AVX2 + FMA, 2 AVX-512.
int64_t mxfp4_cpu_isas() { return 1 | (has_avx2() ? 2 : 0) | (has_avx512() ? 4 : 0); }

// x [M, K] -> per block its even values, then its odd values.
void split_blocks(const float* x, int64_t M, int64_t K, float* xs) {
  deepinfer_pool::parallel_for(M, std::max<int64_t>(1, 65536 / std::max<int64_t>(K, 1)), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < K; b += kBlock)
        for (int64_t l = 0; l < 16; ++l) {
          xs[m * K + b + l] = x[m * K + b + 2 * l];
          xs[m * K + b + 16 + l] = x[m * K + b + 2 * l + 1];
        }
  });
}

at::Tensor mxfp4_matmul(const at::Tensor& x, const at::Tensor& blocks, const at::Tensor& scales, int64_t isa) {
  TORCH_CHECK(isa >= 0 && isa <= 2, "mxfp4_matmul: isa must be 0 (plain), 1 (AVX2) or 2 (AVX-512), got ", isa);
  TORCH_CHECK(mxfp4_cpu_isas() >> isa & 1, "mxfp4_matmul: this CPU cannot run isa ", isa);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "mxfp4_matmul: x must be a 2-D float32 tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kBlock == 0, "mxfp4_matmul: K=", K, " is not a multiple of ", kBlock);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.size(1) == K / 2,
              "mxfp4_matmul: blocks must be uint8 [N, K/2=", K / 2, "]");
  const int64_t N = blocks.size(0);
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kByte && scales.size(0) == N &&
                  scales.size(1) == K / kBlock,
              "mxfp4_matmul: scales must be uint8 [N=", N, ", K/32=", K / kBlock, "]");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const at::Tensor xc = x.contiguous(), wc = blocks.contiguous(), sc = scales.contiguous();
  at::Tensor xs = at::empty({M, K}, x.options());
  split_blocks(xc.data_ptr<float>(), M, K, xs.data_ptr<float>());
  const Problem pb{xs.data_ptr<float>(), wc.data_ptr<uint8_t>(), sc.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, K};
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  // tasks of at least ~64 K multiply-adds: small calls stay on one thread
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(kTileRows * K * M, 1));
  deepinfer_pool::parallel_for(tiles, grain, [&](int64_t t0, int64_t t1) {
    if (isa == 2) v512::run_tiles(pb, t0, t1);
    else if (isa == 1) avx2::run_tiles(pb, t0, t1);
    else plain::run_tiles(pb, t0, t1);
  });
  return y;
}

}  // namespace
}  // namespace deepinfer_mxfp4

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("mxfp4_matmul(Tensor x, Tensor blocks, Tensor scales, int isa) -> Tensor");
  m.def("mxfp4_cpu_isas() -> int", deepinfer_mxfp4::mxfp4_cpu_isas);
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) { m.impl("mxfp4_matmul", deepinfer_mxfp4::mxfp4_matmul); }

#else  // DEEPINFER_MXFP4_BODY: the body, compiled once per instruction set with its `V` and `MR`

// Rows n0 .. n0 + R - 1 (R <= kTileRows) times activation rows m0 .. m0 + rows - 1 (rows <= MR):
// the weights decoded on the fly from the packed bytes (`buf` null) or read from `buf` [R, K].
template <int64_t ROWS>
MXFP4_INLINE void panel(const Problem& pb, int64_t n0, int64_t R, int64_t m0, const float* buf) {
  V acc[ROWS][kTileRows];
  for (int64_t i = 0; i < ROWS; ++i)
    for (int64_t r = 0; r < R; ++r) acc[i][r] = V::zero();
  const int64_t nb = pb.K / kBlock;
  for (int64_t b = 0; b < nb; ++b) {
    V xl[ROWS], xh[ROWS];
    for (int64_t i = 0; i < ROWS; ++i) {
      xl[i] = V::load(pb.xs + (m0 + i) * pb.K + b * kBlock);
      xh[i] = V::load(pb.xs + (m0 + i) * pb.K + b * kBlock + 16);
    }
    for (int64_t r = 0; r < R; ++r) {
      V lo, hi;
      if (buf) {
        lo = V::load(buf + r * pb.K + b * kBlock);
        hi = V::load(buf + r * pb.K + b * kBlock + 16);
      } else {
        const int64_t n = n0 + r;
        V::decode(pb.w + n * (pb.K / 2) + b * kBlockBytes, scale_of(pb.s[n * nb + b]), lo, hi);
      }
      for (int64_t i = 0; i < ROWS; ++i) {
        acc[i][r] = V::fma(lo, xl[i], acc[i][r]);
        acc[i][r] = V::fma(hi, xh[i], acc[i][r]);
      }
    }
  }
  for (int64_t i = 0; i < ROWS; ++i)
    for (int64_t r = 0; r < R; ++r) pb.y[(m0 + i) * pb.N + n0 + r] = acc[i][r].sum();
}

// Activation rows m0 .. M - 1 over one tile, in panels of MR rows, then single rows.
MXFP4_INLINE void panels(const Problem& pb, int64_t n0, int64_t R, int64_t m0, const float* buf) {
  for (; m0 + MR <= pb.M; m0 += MR) panel<MR>(pb, n0, R, m0, buf);
  for (; m0 < pb.M; ++m0) panel<1>(pb, n0, R, m0, buf);
}

void run_tiles(const Problem& pb, int64_t t0, int64_t t1) {
  const int64_t nb = pb.K / kBlock;
  std::vector<float> buf(pb.M > kFusedRows ? kTileRows * pb.K : 0);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * kTileRows, R = std::min(kTileRows, pb.N - n0);
    if (buf.empty()) {
      panels(pb, n0, R, 0, nullptr);
      continue;
    }
    for (int64_t r = 0; r < R; ++r)  // decode the tile once, the same values as on the fly
      for (int64_t b = 0; b < nb; ++b) {
        V lo, hi;
        const int64_t n = n0 + r;
        V::decode(pb.w + n * (pb.K / 2) + b * kBlockBytes, scale_of(pb.s[n * nb + b]), lo, hi);
        lo.store(buf.data() + r * pb.K + b * kBlock);
        hi.store(buf.data() + r * pb.K + b * kBlock + 16);
      }
    panels(pb, n0, R, 0, buf.data());
  }
}

#endif  // DEEPINFER_MXFP4_BODY
