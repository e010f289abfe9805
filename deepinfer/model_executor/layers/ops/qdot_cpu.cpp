// Integer dot products over GGUF blocks as stored in the file: y[M, N] = x[M, K] @ W[N, K]^T.
//
//   quantize_acts(x fp32 [M, K], isa) -> q int8 [M, K], d fp32 [M, K/32], sums int32 [M, K/16]
//   qdot(q, d, sums, w uint8 [N, row_bytes], kind (ggml type id), K, isa, levels) -> y fp32 [M / levels, N]
//     (with two levels, q's rows m and m + M/2 are one row's: its output is level 1 + level 2)
//
// qdot.py states the function (its torch reference computes the same bits). In short: every
// weight block splits into units of U values (16 for Q2_K, Q3_K and Q6_K, else 32) whose values are
// A * (code - offset) + B (IQ4_NL and IQ4_XS: a 16-entry table's value for the code); per output
// (m, n) the units are taken in ascending order and
//
//   i = sum (code - offset) * q   (exact, int32)      c = (A * d_act) * float(i)
//   c = c + (B * d_act) * float(s)   (kinds with a min; s = the unit's sum of q)      acc = acc + c
//
// each a separately rounded fp32 operation: every product goes through an empty asm statement
// (`opaque`, V::mul) so that no compiler fuses it into the add that follows, whatever
// -ffp-contract says.
//
// How (the SIMD variants): threads split the N weight rows in tiles of R rows (R = the lanes of
// one vector: 16 with AVX-512, 8 with AVX2). A tile's blocks are decoded into unsigned byte codes
// laid out across rows: for every 4 consecutive values, R x 4 bytes (row r's 4 codes in lane r),
// read with 16-byte loads and an in-register transpose. One `vpdpbusd` (or AVX2 maddubs + madd)
// of such a vector with an activation row's 4 bytes broadcast adds 4 products to each of the R
// rows' sums. Up to kFusedRows activation rows (decode, short verification) take the codes
// straight from registers as each block is decoded; more rows (batches, prefill chunks) decode a
// chunk of the tile (16 KB of codes, in L1) once and run every panel of MR activation rows over
// it (register blocking: MR rows share each code vector; the panels' activations are packed so
// that one pointer walks them). Signed codes use unsigned codes and start the sum at
// -offset * s (signed bytes, Q8_0's and the IQ4 tables' values, with VNNI: w ^ 0x80, offset 128;
// with AVX2 the sign trick |w| * (sign(w) x) instead, as maddubs saturates int16). The float steps
// run with lanes across the tile's rows, so each output's order of operations is the same whatever
// M, the row's position, the thread count or the instruction set.
//
// The same body is compiled three times (AVX512-VNNI, AVX-VNNI, AVX2) by including this file
// into itself under `#pragma GCC target` (GCC 11 or newer: AVX-VNNI); `isa` picks one per call:
// 4 AVX512-VNNI, 3 AVX-VNNI, 2 AVX2, 1 portable C++ (one weight row at a time, the same integers
// and floats). The two 256-bit variants are their own compilation unit (qdot_avx2_cpu.cpp includes
// this file with DEEPINFER_QDOT_256), so that the build compiles them beside the AVX-512 one.

#ifndef DEEPINFER_QDOT_BODY

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <functional>
#include <cstring>
#include <vector>

// The kernels' thread pool (work_pool.cpp): fn(begin, end) over [0, n) in chunks of at most grain items.
namespace deepinfer_pool {
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);
}

// The grid i-quants and ternary kinds (iq_grid_cpu.cpp): a block's 256 signed values and unit scales.
namespace deepinfer_iq {
bool tables_ready();
void decode_block(int64_t id, const uint8_t* p, int8_t* v, float* A);
const int8_t* grid_table(int i);  // IQ2_XXS 0, IQ2_XS 1, IQ2_S 2, IQ3_XXS 3, IQ3_S 4, IQ1_S 5
const int8_t* iq1_table();        // IQ1's grid times 8
}

namespace deepinfer_qdot {

#define INLINE inline __attribute__((always_inline))

// A ggml block type: ggml id, values and bytes per block, values per unit, code offset, min.
struct Kind {
  int64_t id, block_values, block_bytes, unit, offset;
  bool has_min;
};

constexpr Kind kKinds[] = {
    {2, 32, 18, 32, 8, false},    // Q4_0: d, 16 bytes of nibbles
    {3, 32, 20, 32, 0, true},     // Q4_1: d, m, nibbles
    {6, 32, 22, 32, 16, false},   // Q5_0: d, qh (32 high bits), nibbles
    {7, 32, 24, 32, 0, true},     // Q5_1: d, m, qh, nibbles
    {8, 32, 34, 32, 0, false},    // Q8_0: d, 32 signed bytes
    {12, 256, 144, 32, 0, true},  // Q4_K: d, dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
    {13, 256, 176, 32, 0, true},  // Q5_K: as Q4_K plus 32 bytes of high bits before the nibbles
    {14, 256, 210, 16, 32, false},  // Q6_K: 128 bytes low nibbles, 64 bytes 2-bit highs, 16 int8 scales, d
    {10, 256, 84, 16, 0, true},     // Q2_K: 16 bytes of 4-bit scale|min, 64 bytes of 2-bit codes, d, dmin
    {11, 256, 110, 16, 4, false},   // Q3_K: 32 bytes of high bits, 64 bytes of 2-bit codes, 12 bytes of scales, d
    {20, 32, 18, 32, 0, false},     // IQ4_NL: d, 16 bytes of nibbles indexing kIQ4Values
    {23, 256, 136, 32, 0, false},   // IQ4_XS: d, 6-bit scales (2 high bytes, 4 low), 128 bytes of nibbles
    {16, 256, 66, 32, 0, false},    // IQ2_XXS  (the grid kinds: iq_grid_cpu.cpp reads them)
    {17, 256, 74, 16, 0, false},    // IQ2_XS
    {22, 256, 82, 16, 0, false},    // IQ2_S
    {18, 256, 98, 32, 0, false},    // IQ3_XXS
    {21, 256, 110, 32, 0, false},   // IQ3_S
    {19, 256, 50, 32, 0, false},    // IQ1_S
    {29, 256, 56, 16, 0, false},    // IQ1_M
    {34, 256, 54, 32, 0, false},    // TQ1_0
    {35, 256, 66, 32, 0, false},    // TQ2_0
};

// The tile layout (pack_tiles) of Q4_K, Q5_K and Q6_K: a tile of R weight rows (R: the variant's
// lanes) holds, per block b of the rows and per 16-byte column c of a block, four vectors j of R dwords:
// bytes 16c + 4j .. 16c + 4j + 3 of row r's block in lane r. The one-row kernel then loads each with
// one plain load instead of R 16-byte loads and a transpose (a third of its instructions). Bytes per
// block in it (0: no tile layout): a multiple of 16; Q6_K's 210 take 224, its last column being bytes
// 194..209 again (d at its end, where the file-layout decoder has it).
constexpr int64_t tiled_block_bytes(int64_t id) { return id == 12 ? 144 : id == 13 ? 176 : id == 14 ? 224 : 0; }
constexpr int64_t tiled_column_source(int64_t id, int64_t c) { return id == 14 && c == 13 ? 194 : 16 * c; }

// IQ4_NL's and IQ4_XS's 16 values (a code indexes them), and the same plus 128 as unsigned bytes.
alignas(16) constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};
alignas(16) constexpr uint8_t kIQ4Biased[16] = {1,   24,  45,  63,  79,  93,  106, 118,
                                                129, 141, 153, 166, 181, 197, 217, 241};

// The kinds iq_grid_cpu.cpp decodes to signed bytes, block by block (IQ1-3 grids, TQ1_0, TQ2_0). The
// SIMD variants compile one body for all of them per unit size (the kind read at run time):
// kGrid16 and kGrid32 stand for them there.
constexpr int kGrid16 = 1016, kGrid32 = 1032;
constexpr bool grid_kind(int64_t id) {
  return id == 16 || id == 17 || id == 18 || id == 19 || id == 21 || id == 22 || id == 29 || id == 34 || id == 35 ||
         id == kGrid16 || id == kGrid32;
}

// Kinds whose values are signed bytes (Q8_0's, the IQ4 kinds' after the table, the grid kinds'): no
// code offset.
constexpr bool signed_kind(int64_t id) { return id == 8 || id == 20 || id == 23 || grid_kind(id); }

#ifndef DEEPINFER_QDOT_256
const Kind& kind_of(int64_t id) {
  for (const Kind& k : kKinds)
    if (k.id == id) return k;
  TORCH_CHECK(false, "qdot: no kernel for ggml type ", id, " (have Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, ",
              "Q2_K 10, Q3_K 11, Q4_K 12, Q5_K 13, Q6_K 14, IQ2_XXS 16, IQ2_XS 17, IQ3_XXS 18, IQ1_S 19, ",
              "IQ4_NL 20, IQ3_S 21, IQ2_S 22, IQ4_XS 23, IQ1_M 29, TQ1_0 34, TQ2_0 35)");
}
#endif

// A value the compiler cannot see into: a product passed through it is never fused with a later add.
INLINE float opaque(float v) {
  __asm__("" : "+x"(v));
  return v;
}

INLINE float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalize
    int e = -1;
    uint32_t m = man;
    do {
      ++e;
      m <<= 1;
    } while ((m & 0x400) == 0);
    bits = sign | ((112 - e) << 23) | ((m & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

INLINE int32_t load_i32(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// The activation scale a block of 32 values gets (see qdot.py): max|x| / 127, 0 below FLT_MIN.
INLINE float act_scale(float amax) {
  const float d = amax / 127.0f;
  return d < FLT_MIN ? 0.0f : d;
}

INLINE float act_inverse(float d) { return d == 0.0f ? 0.0f : 1.0f / d; }

// Activation rows m0 .. m0 + rows - 1 packed for the SIMD kernels: row i's values 4g .. 4g+3 at
// q[g * rows + i] (one int32), and per unit u (of U values) its scale, -offset * s and float(s)
// at [u * rows + i].
struct Panel {
  int64_t m0, rows;
  const int32_t* q;     // [K/4][rows]
  const float* d;       // [K/U][rows]
  const int32_t* init;  // [K/U][rows], kinds with an offset (else null)
  const float* sf;      // [K/U][rows], kinds with a min (else null)
};

constexpr int64_t kFusedRows = 8;  // up to this many activation rows: decoded codes go straight from registers

// What a qdot call reads: activations (plain and packed), weight bytes, the per-unit terms.
struct Problem {
  const int8_t* q;      // [M, K]
  const float* d;       // [M, K/32]
  const float* sf;      // [M, K/U]: float(s), kinds with a min (else null)
  const uint8_t* w;     // [N, row_bytes], or tiled (pack_tiles): [N rounded up to R, row_bytes]
  float* y;             // [M / levels, N]: level 1 + level 2 of each row with two levels
  int64_t M, N, K, row_bytes;
  int64_t levels;       // rows m and m + M / 2 are a row's two levels when 2
  Kind kind;
  const Panel* panels;  // covering rows 0 .. M-1 in order
  int64_t num_panels;
  bool tiled;           // w in the tile layout of the variant's R (see pack_tiles)
};

// The 256-bit variants' lanes and panel rows, and their entry points (qdot_avx2_cpu.cpp).
constexpr int kR256 = 8, kMR256 = 4;
namespace vnni256 {
void qdot_tiles(const Problem& pb, int64_t t0, int64_t t1);
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, int32_t* sums);
}  // namespace vnni256
namespace avx2 {
void qdot_tiles(const Problem& pb, int64_t t0, int64_t t1);
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, int32_t* sums);
}  // namespace avx2

#ifndef DEEPINFER_QDOT_256
// ---- portable C++ (isa 1): one weight row at a time ------------------------------------------

// Row `n`'s values (code - offset) and unit scales/mins, read from its blocks.
void decode_row(const Kind& kd, const uint8_t* row, int64_t K, int16_t* vals, float* A, float* B) {
  const int64_t nb = K / kd.block_values;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* p = row + b * kd.block_bytes;
    int16_t* v = vals + b * kd.block_values;
    const int64_t u0 = b * kd.block_values / kd.unit;
    if (grid_kind(kd.id)) {
      int8_t bytes[256];
      deepinfer_iq::decode_block(kd.id, p, bytes, A + u0);
      for (int j = 0; j < 256; ++j) v[j] = bytes[j];
      continue;
    }
    switch (kd.id) {
      case 2: case 3: case 6: case 7: {
        const int64_t qs_at = kd.id == 2 ? 2 : kd.id == 3 ? 4 : kd.id == 6 ? 6 : 8;
        const int64_t qh_at = kd.id == 6 ? 2 : 4;
        const int16_t off = static_cast<int16_t>(kd.offset);
        for (int j = 0; j < 16; ++j) {
          v[j] = static_cast<int16_t>((p[qs_at + j] & 0xF) - off);
          v[j + 16] = static_cast<int16_t>((p[qs_at + j] >> 4) - off);
        }
        if (kd.id >= 6) {  // the fifth bits
          uint32_t qh;
          std::memcpy(&qh, p + qh_at, 4);
          for (int j = 0; j < 32; ++j) v[j] = static_cast<int16_t>(v[j] + (((qh >> j) & 1) << 4));
        }
        A[u0] = half_to_float(p);
        if (kd.has_min) B[u0] = half_to_float(p + 2);
        break;
      }
      case 8:
        for (int j = 0; j < 32; ++j) v[j] = static_cast<int8_t>(p[2 + j]);
        A[u0] = half_to_float(p);
        break;
      case 12: case 13: {
        const float d = half_to_float(p), dmin = half_to_float(p + 2);
        const uint8_t* s = p + 4;
        const uint8_t* qs = p + (kd.id == 12 ? 16 : 48);
        for (int j = 0; j < 8; ++j) {
          const int sc = j < 4 ? s[j] & 63 : (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4);
          const int mn = j < 4 ? s[j + 4] & 63 : (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
          A[u0 + j] = d * static_cast<float>(sc);
          B[u0 + j] = -(dmin * static_cast<float>(mn));
          for (int l = 0; l < 32; ++l) {
            const int nib = (qs[(j / 2) * 32 + l] >> (4 * (j % 2))) & 0xF;
            const int hi = kd.id == 13 ? ((p[16 + l] >> j) & 1) << 4 : 0;
            v[j * 32 + l] = static_cast<int16_t>(nib | hi);
          }
        }
        break;
      }
      case 14: {
        const float d = half_to_float(p + 208);
        for (int j = 0; j < 16; ++j) A[u0 + j] = d * static_cast<float>(static_cast<int8_t>(p[192 + j]));
        for (int h = 0; h < 2; ++h)
          for (int r = 0; r < 128; ++r) {
            const int nib = (p[64 * h + r % 64] >> (4 * (r / 64))) & 0xF;
            const int hi = (p[128 + 32 * h + r % 32] >> (2 * (r / 32))) & 3;
            v[128 * h + r] = static_cast<int16_t>((nib | (hi << 4)) - 32);
          }
        break;
      }
      case 10: case 11: {  // value i: half i / 128, bit plane (i % 128) / 32, byte i % 32 of the half
        const uint8_t* qs = p + (kd.id == 10 ? 16 : 32);
        for (int i = 0; i < 256; ++i) {
          const int low = (qs[32 * (i / 128) + i % 32] >> (2 * ((i % 128) / 32))) & 3;
          v[i] = static_cast<int16_t>(kd.id == 10 ? low : (low | (((p[i % 32] >> (i / 32)) & 1) << 2)) - 4);
        }
        if (kd.id == 10) {
          const float d = half_to_float(p + 80), dmin = half_to_float(p + 82);
          for (int s = 0; s < 16; ++s) {
            A[u0 + s] = d * static_cast<float>(p[s] & 0xF);
            B[u0 + s] = -(dmin * static_cast<float>(p[s] >> 4));
          }
        } else {
          const float d = half_to_float(p + 108);
          for (int s = 0; s < 16; ++s) {
            const int sc = ((p[96 + s % 8] >> (4 * (s / 8))) & 0xF) | (((p[104 + s % 4] >> (2 * (s / 4))) & 3) << 4);
            A[u0 + s] = d * static_cast<float>(sc - 32);
          }
        }
        break;
      }
      case 20: case 23: {  // IQ4_NL: d, 16 bytes of codes; IQ4_XS: d, scales_h (2 B), scales_l (4 B), 128 B
        const bool xs = kd.id == 23;
        const int64_t subs = xs ? 8 : 1;
        const uint8_t* qs = p + (xs ? 8 : 2);
        const float d = half_to_float(p);
        for (int64_t ib = 0; ib < subs; ++ib) {
          if (xs) {
            const int high = (p[2] | (p[3] << 8)) >> (2 * ib) & 3, low = (p[4 + ib / 2] >> (4 * (ib % 2))) & 0xF;
            A[u0 + ib] = d * static_cast<float>((low | (high << 4)) - 32);
          } else {
            A[u0 + ib] = d;
          }
          for (int j = 0; j < 16; ++j) {
            v[32 * ib + j] = kIQ4Values[qs[16 * ib + j] & 0xF];
            v[32 * ib + 16 + j] = kIQ4Values[qs[16 * ib + j] >> 4];
          }
        }
        break;
      }
    }
  }
}

void qdot_plain(const Problem& pb, int64_t n0, int64_t n1) {
  const Kind& kd = pb.kind;
  const int64_t K = pb.K, U = kd.unit, units = K / U;
  std::vector<int16_t> vals(K);
  std::vector<float> A(units), B(units), out(pb.M);
  for (int64_t n = n0; n < n1; ++n) {
    decode_row(kd, pb.w + n * pb.row_bytes, K, vals.data(), A.data(), B.data());
    for (int64_t m = 0; m < pb.M; ++m) {
      const int8_t* q = pb.q + m * K;
      float acc = 0.0f;
      for (int64_t u = 0; u < units; ++u) {
        int32_t isum = 0;
        for (int64_t j = u * U; j < (u + 1) * U; ++j) isum += static_cast<int32_t>(vals[j]) * q[j];
        const float da = pb.d[m * (K / 32) + u * U / 32];
        float c = opaque(opaque(A[u] * da) * static_cast<float>(isum));
        if (kd.has_min) c = c + opaque(opaque(B[u] * da) * pb.sf[m * units + u]);
        acc = acc + c;
      }
      out[m] = acc;
    }
    const int64_t rows = pb.M / pb.levels;
    for (int64_t m = 0; m < rows; ++m) pb.y[m * pb.N + n] = pb.levels == 1 ? out[m] : out[m] + out[rows + m];
  }
}

void quantize_plain(const float* x, int64_t K, int8_t* q, float* d, int32_t* sums) {
  for (int64_t b = 0; b < K / 32; ++b) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[b * 32 + j]));
    d[b] = act_scale(amax);
    const float inv = act_inverse(d[b]);
    for (int half = 0; half < 2; ++half) {
      int32_t s = 0;
      for (int j = half * 16; j < half * 16 + 16; ++j) {
        const float r = std::nearbyint(x[b * 32 + j] * inv);  // the default rounding: half to even
        const int v = static_cast<int>(std::min(127.0f, std::max(-127.0f, r)));
        q[b * 32 + j] = static_cast<int8_t>(v);
        s += v;
      }
      sums[b * 2 + half] = s;
    }
  }
}

#endif  // DEEPINFER_QDOT_256

}  // namespace deepinfer_qdot

// ---- the SIMD variants: this file's body below, once per instruction set --------------------

#define DEEPINFER_QDOT_BODY 1

#ifndef DEEPINFER_QDOT_256

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c")
namespace deepinfer_qdot::v512 {

struct V {
  static constexpr int R = 16;  // lanes: weight rows per tile
  static constexpr int MR = 8;  // activation rows per register tile
  static constexpr bool kSignTrick = false;
  static constexpr bool kInt16 = false;  // vpdpbusd sums in int32
  using I = __m512i;
  using F = __m512;
  static INLINE I load(const void* p) { return _mm512_loadu_si512(p); }
  static INLINE void store(void* p, I v) { _mm512_storeu_si512(p, v); }
  static INLINE F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static INLINE void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
  static INLINE I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static INLINE F set1f(float v) { return _mm512_set1_ps(v); }
  static INLINE F zerof() { return _mm512_setzero_ps(); }
  static INLINE I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static INLINE I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static INLINE I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static INLINE I addi(I a, I b) { return _mm512_add_epi32(a, b); }
  static INLINE I srl(I v, int s) { return _mm512_srl_epi32(v, _mm_cvtsi32_si128(s)); }
  static INLINE I sll(I v, int s) { return _mm512_sll_epi32(v, _mm_cvtsi32_si128(s)); }
  static INLINE I sra(I v, int s) { return _mm512_sra_epi32(v, _mm_cvtsi32_si128(s)); }
  static INLINE F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static INLINE F mul(F a, F b) {  // a product never fused into a later add
    F p = _mm512_mul_ps(a, b);
    __asm__("" : "+v"(p));
    return p;
  }
  static INLINE I abs8(I v) { return _mm512_abs_epi8(v); }
  static INLINE I add8(I a, I b) { return _mm512_add_epi8(a, b); }
  static INLINE I sub8(I a, I b) { return _mm512_sub_epi8(a, b); }
  // Table lookups per lane: each lane's dword at base + 4 * idx (vpgatherdd), and (gather8) each lane's
  // 8 bytes at base + 8 * idx as two dword planes (bytes 0..3, 4..7), with scalar loads: on Ice Lake
  // 20-40% faster than vpgatherdq, the dword gather 5-8% faster than scalar loads (one row per token).
  static INLINE I join4(const __m128i* q) {  // q[0] | q[1] | q[2] | q[3]
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(q[1], q[0])), _mm256_set_m128i(q[3], q[2]), 1);
  }
  static INLINE I gather4(const void* base, I idx) { return _mm512_i32gather_epi32(idx, base, 4); }
  static INLINE void gather8(const void* base, I idx, I& lo, I& hi) {
    alignas(64) int32_t ix[16];
    _mm512_store_si512(ix, idx);
    const int64_t* g = static_cast<const int64_t*>(base);
    __m128i q[8];
    for (int j = 0; j < 8; ++j) q[j] = _mm_set_epi64x(g[ix[2 * j + 1]], g[ix[2 * j]]);
    const I a = join4(q), b = join4(q + 4);
    lo = _mm512_permutex2var_epi32(a, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30), b);
    hi = _mm512_permutex2var_epi32(a, _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31), b);
  }
  // The low 4 bits of each lane -> 0xFF in its bytes 0..3 whose bit is set, 0 in the others.
  static INLINE I mask_ff(I v) {
    const I table = _mm512_setr_epi32(0x0, 0xFF, 0xFF00, 0xFFFF, 0xFF0000, 0xFF00FF, 0xFFFF00, 0xFFFFFF,
                                      static_cast<int32_t>(0xFF000000u), static_cast<int32_t>(0xFF0000FFu),
                                      static_cast<int32_t>(0xFF00FF00u), static_cast<int32_t>(0xFF00FFFFu),
                                      static_cast<int32_t>(0xFFFF0000u), static_cast<int32_t>(0xFFFF00FFu),
                                      static_cast<int32_t>(0xFFFFFF00u), -1);
    return _mm512_permutexvar_epi32(v, table);
  }
  // Each byte (0..15) replaced by its entry in the 16-byte table t.
  static INLINE I lut(const void* t, I idx) {
    return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_load_si128(reinterpret_cast<const __m128i*>(t))), idx);
  }
  // Bits s .. s+3 of each lane -> bit 4 of its bytes 0..3 (Q5_0/Q5_1's high bits): a 16-entry table.
  static INLINE I spread(I qh, int s) {
    const I table = _mm512_setr_epi32(0x0, 0x10, 0x1000, 0x1010, 0x100000, 0x100010, 0x101000, 0x101010,
                                      0x10000000, 0x10000010, 0x10001000, 0x10001010, 0x10100000, 0x10100010,
                                      0x10101000, 0x10101010);
    return _mm512_permutexvar_epi32(and_(srl(qh, s), set1(0xF)), table);
  }
  static INLINE F add(F a, F b) { return _mm512_add_ps(a, b); }
  static INLINE F neg(F a) { return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), set1(INT32_MIN))); }
  // fp16 in the low 16 bits of each lane -> fp32
  static INLINE F half_lo(I v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); }
  // The 16 bytes at p + r * stride of rows r < 16 -> out[j] = their dword j (lane r).
  static INLINE void load_t4(const uint8_t* p, int64_t stride, I out[4]) {
    I z[4];
    const uint8_t* base[4] = {p, p + 4 * stride, p + 8 * stride, p + 12 * stride};
    const int64_t step[4] = {0, stride, 2 * stride, 3 * stride};
    for (int r = 0; r < 4; ++r) {
      z[r] = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(base[0] + step[r])));
      for (int q = 1; q < 4; ++q)
        z[r] = _mm512_inserti32x4(z[r], _mm_loadu_si128(reinterpret_cast<const __m128i*>(base[q] + step[r])), q);
    }
    const I t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const I t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    out[0] = _mm512_unpacklo_epi64(t0, t2);
    out[1] = _mm512_unpackhi_epi64(t0, t2);
    out[2] = _mm512_unpacklo_epi64(t1, t3);
    out[3] = _mm512_unpackhi_epi64(t1, t3);
  }
  // acc + the dot of each lane's 4 unsigned codes with the 4 signed bytes at a
  static INLINE I dp(I acc, I w, const int32_t* a) {  // the 4 bytes at a broadcast by the instruction itself
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*a));
    return acc;
  }
  static INLINE I madd16(I, int32_t) { return set1(0); }  // (the int16 steps: AVX2 only)
  static INLINE I madd16_sign(I, I, int32_t) { return set1(0); }
  static INLINE I add16(I a, I) { return a; }
  static INLINE I widen(I acc, I) { return acc; }
  // quantize_acts: 32 values = 2 vectors
  static constexpr int kPerBlock = 2;
  static INLINE F absf(F v) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), set1(0x7FFFFFFF))); }
  static INLINE F maxf(F a, F b) { return _mm512_max_ps(a, b); }
  static INLINE float hmax(F v) { return _mm512_reduce_max_ps(v); }
  static INLINE I round_clamp(F v) {
    const I r = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_max_epi32(_mm512_min_epi32(r, set1(127)), set1(-127));
  }
  static INLINE void store_i8(int8_t* p, I v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(v));
  }
  static INLINE void sums16(const I* v, int32_t* out) {
    out[0] = _mm512_reduce_add_epi32(v[0]);
    out[1] = _mm512_reduce_add_epi32(v[1]);
  }
};

#include "qdot_cpu.cpp"  // this file: its body below, for this instruction set

}  // namespace deepinfer_qdot::v512
#pragma GCC pop_options

#else  // DEEPINFER_QDOT_256: the AVX2 and AVX-VNNI variants

// AVX2 (+ AVX-VNNI): 8 lanes. VNNI selects vpdpbusd (VEX); without it maddubs + madd.
#define DEEPINFER_QDOT_V256(NAME, VNNI)                                                                              \
  struct NAME {                                                                                                      \
    static constexpr int R = 8;                                                                                      \
    static constexpr int MR = 4;                                                                                     \
    static constexpr bool kSignTrick = !(VNNI);                                                                      \
    static constexpr bool kInt16 = !(VNNI); /* maddubs: int16 pair sums, widened by madd */                          \
    using I = __m256i;                                                                                               \
    using F = __m256;                                                                                                \
    static INLINE I load(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }         \
    static INLINE void store(void* p, I v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }               \
    static INLINE F loadf(const float* p) { return _mm256_loadu_ps(p); }                                             \
    static INLINE void storef(float* p, F v) { _mm256_storeu_ps(p, v); }                                             \
    static INLINE I set1(int32_t v) { return _mm256_set1_epi32(v); }                                                 \
    static INLINE F set1f(float v) { return _mm256_set1_ps(v); }                                                     \
    static INLINE F zerof() { return _mm256_setzero_ps(); }                                                          \
    static INLINE I and_(I a, I b) { return _mm256_and_si256(a, b); }                                                \
    static INLINE I or_(I a, I b) { return _mm256_or_si256(a, b); }                                                  \
    static INLINE I xor_(I a, I b) { return _mm256_xor_si256(a, b); }                                                \
    static INLINE I addi(I a, I b) { return _mm256_add_epi32(a, b); }                                                \
    static INLINE I srl(I v, int s) { return _mm256_srl_epi32(v, _mm_cvtsi32_si128(s)); }                            \
    static INLINE I sll(I v, int s) { return _mm256_sll_epi32(v, _mm_cvtsi32_si128(s)); }                            \
    static INLINE I sra(I v, int s) { return _mm256_sra_epi32(v, _mm_cvtsi32_si128(s)); }                            \
    static INLINE F cvt(I v) { return _mm256_cvtepi32_ps(v); }                                                       \
    static INLINE F mul(F a, F b) {                                                                                  \
      F p = _mm256_mul_ps(a, b);                                                                                     \
      __asm__("" : "+x"(p));                                                                                        \
      return p;                                                                                                      \
    }                                                                                                                \
    static INLINE I abs8(I v) { return _mm256_abs_epi8(v); }                                                         \
    static INLINE I add8(I a, I b) { return _mm256_add_epi8(a, b); }                                                 \
    static INLINE I sub8(I a, I b) { return _mm256_sub_epi8(a, b); }                                                 \
    /* Table lookups per lane with scalar loads, as the 512-bit V's */                                              \
    static INLINE I gather4(const void* base, I idx) {                                                               \
      alignas(32) int32_t ix[8];                                                                                     \
      _mm256_store_si256(reinterpret_cast<__m256i*>(ix), idx);                                                       \
      const int32_t* g = static_cast<const int32_t*>(base);                                                          \
      return _mm256_setr_epi32(g[ix[0]], g[ix[1]], g[ix[2]], g[ix[3]], g[ix[4]], g[ix[5]], g[ix[6]], g[ix[7]]);     \
    }                                                                                                                \
    static INLINE void gather8(const void* base, I idx, I& lo, I& hi) {                                              \
      alignas(32) int32_t ix[8];                                                                                     \
      _mm256_store_si256(reinterpret_cast<__m256i*>(ix), idx);                                                       \
      const int64_t* g = static_cast<const int64_t*>(base);                                                          \
      const I a = _mm256_setr_epi64x(g[ix[0]], g[ix[1]], g[ix[2]], g[ix[3]]);                                        \
      const I b = _mm256_setr_epi64x(g[ix[4]], g[ix[5]], g[ix[6]], g[ix[7]]);                                        \
      const I even = _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6), odd = _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7);     \
      const I a_lo = _mm256_permutevar8x32_epi32(a, even), b_lo = _mm256_permutevar8x32_epi32(b, even);              \
      const I a_hi = _mm256_permutevar8x32_epi32(a, odd), b_hi = _mm256_permutevar8x32_epi32(b, odd);                \
      lo = _mm256_permute2x128_si256(a_lo, b_lo, 0x20);                                                              \
      hi = _mm256_permute2x128_si256(a_hi, b_hi, 0x20);                                                              \
    }                                                                                                                \
    /* The low 4 bits of each lane -> 0xFF in its bytes 0..3 whose bit is set: byte 0 copied to all 4, a test */     \
    static INLINE I mask_ff(I v) {                                                                                   \
      const I copy = _mm256_shuffle_epi8(v, _mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12, 0,   \
                                                             0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12));      \
      const I bits = set1(0x08040201);                                                                               \
      return _mm256_cmpeq_epi8(and_(copy, bits), bits);                                                              \
    }                                                                                                                \
    static INLINE I lut(const void* t, I idx) {                                                                      \
      return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(t))),  \
                                 idx);                                                                               \
    }                                                                                                                \
    /* Bits s .. s+3 of each lane -> bit 4 of its bytes 0..3: that nibble's byte copied to all 4, then a test */     \
    static INLINE I spread(I qh, int s) {                                                                            \
      const int b = s / 8;                                                                                           \
      const I copy = _mm256_shuffle_epi8(qh, _mm256_setr_epi8(b, b, b, b, 4 + b, 4 + b, 4 + b, 4 + b, 8 + b, 8 + b,  \
                                                              8 + b, 8 + b, 12 + b, 12 + b, 12 + b, 12 + b, b, b, b, \
                                                              b, 4 + b, 4 + b, 4 + b, 4 + b, 8 + b, 8 + b, 8 + b,    \
                                                              8 + b, 12 + b, 12 + b, 12 + b, 12 + b));               \
      const I bits = set1(s % 8 ? static_cast<int32_t>(0x80402010u) : 0x08040201);                                  \
      return and_(_mm256_cmpeq_epi8(and_(copy, bits), bits), set1(0x10101010));                                     \
    }                                                                                                                \
    static INLINE F add(F a, F b) { return _mm256_add_ps(a, b); }                                                    \
    static INLINE F neg(F a) {                                                                                       \
      return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(a), set1(INT32_MIN)));                         \
    }                                                                                                                \
    static INLINE F half_lo(I v) {                                                                                   \
      const I m = and_(v, set1(0xFFFF));                                                                             \
      return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1)));           \
    }                                                                                                                \
    static INLINE void load_t4(const uint8_t* p, int64_t stride, I out[4]) {                                         \
      I z[4];                                                                                                        \
      for (int r = 0; r < 4; ++r)                                                                                    \
        z[r] = _mm256_inserti128_si256(                                                                              \
            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + r * stride))),               \
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (r + 4) * stride)), 1);                             \
      const I t0 = _mm256_unpacklo_epi32(z[0], z[1]), t1 = _mm256_unpackhi_epi32(z[0], z[1]);                        \
      const I t2 = _mm256_unpacklo_epi32(z[2], z[3]), t3 = _mm256_unpackhi_epi32(z[2], z[3]);                        \
      out[0] = _mm256_unpacklo_epi64(t0, t2);                                                                        \
      out[1] = _mm256_unpackhi_epi64(t0, t2);                                                                        \
      out[2] = _mm256_unpacklo_epi64(t1, t3);                                                                        \
      out[3] = _mm256_unpackhi_epi64(t1, t3);                                                                        \
    }                                                                                                                \
    static INLINE I dp(I acc, I w, const int32_t* a) { return dp_impl(acc, w, set1(*a)); }                           \
    static INLINE I madd16(I w, int32_t a) { return _mm256_maddubs_epi16(w, set1(a)); }                             \
    static INLINE I madd16_sign(I wabs, I w, int32_t a) {                                                            \
      return _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(set1(a), w));                                               \
    }                                                                                                                \
    static INLINE I add16(I a, I b) { return _mm256_add_epi16(a, b); }                                               \
    static INLINE I widen(I acc, I s16) {                                                                            \
      return _mm256_add_epi32(acc, _mm256_madd_epi16(s16, _mm256_set1_epi16(1)));                                    \
    }                                                                                                                \
    static constexpr int kPerBlock = 4;                                                                              \
    static INLINE F absf(F v) { return _mm256_castsi256_ps(and_(_mm256_castps_si256(v), set1(0x7FFFFFFF))); }        \
    static INLINE F maxf(F a, F b) { return _mm256_max_ps(a, b); }                                                   \
    static INLINE float hmax(F v) {                                                                                  \
      __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));                                 \
      s = _mm_max_ps(s, _mm_movehl_ps(s, s));                                                                        \
      s = _mm_max_ss(s, _mm_movehdup_ps(s));                                                                         \
      return _mm_cvtss_f32(s);                                                                                       \
    }                                                                                                                \
    static INLINE I round_clamp(F v) {                                                                               \
      const I r = _mm256_cvttps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));            \
      return _mm256_max_epi32(_mm256_min_epi32(r, set1(127)), set1(-127));                                           \
    }                                                                                                                \
    static INLINE void store_i8(int8_t* p, I v) {                                                                    \
      const __m128i w16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));               \
      _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w16, w16));                                    \
    }                                                                                                                \
    static INLINE int32_t hsum(I v) {                                                                                \
      __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));                          \
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));                                                              \
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));                                                              \
      return _mm_cvtsi128_si32(s);                                                                                   \
    }                                                                                                                \
    static INLINE void sums16(const I* v, int32_t* out) {                                                            \
      out[0] = hsum(_mm256_add_epi32(v[0], v[1]));                                                                   \
      out[1] = hsum(_mm256_add_epi32(v[2], v[3]));                                                                   \
    }                                                                                                                \
    static INLINE I dp_impl(I acc, I w, I a) {                                                                       \
      if constexpr (VNNI) {                                                                                          \
        return DEEPINFER_QDOT_DPBUSD256(acc, w, a);                                                                  \
      } else {                                                                                                       \
        return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1)));          \
      }                                                                                                              \
    }                                                                                                                \
  };

#pragma GCC push_options
#pragma GCC target("avx2,f16c,avxvnni")
namespace deepinfer_qdot::vnni256 {
#define DEEPINFER_QDOT_DPBUSD256(acc, w, a) _mm256_dpbusd_avx_epi32(acc, w, a)
DEEPINFER_QDOT_V256(V, true)
#undef DEEPINFER_QDOT_DPBUSD256
#include "qdot_cpu.cpp"  // this file: its body below, for this instruction set
}  // namespace deepinfer_qdot::vnni256
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,f16c")
namespace deepinfer_qdot::avx2 {
#define DEEPINFER_QDOT_DPBUSD256(acc, w, a) acc
DEEPINFER_QDOT_V256(V, false)
#undef DEEPINFER_QDOT_DPBUSD256
#include "qdot_cpu.cpp"  // this file: its body below, for this instruction set
}  // namespace deepinfer_qdot::avx2
#pragma GCC pop_options

namespace deepinfer_qdot {
static_assert(avx2::V::R == kR256 && avx2::V::MR == kMR256 && vnni256::V::R == kR256 && vnni256::V::MR == kMR256,
              "qdot: the 256-bit variants' lanes and panel rows, as the dispatch takes them");
}  // namespace deepinfer_qdot

#endif  // DEEPINFER_QDOT_256

#undef DEEPINFER_QDOT_BODY

#ifndef DEEPINFER_QDOT_256

// ---- dispatch and the ops -------------------------------------------------------------------

namespace deepinfer_qdot {
namespace {

bool has_avx2() { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"); }

bool has_avx512_vnni() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni");
}

bool has_avx_vnni() { return has_avx2() && __builtin_cpu_supports("avxvnni"); }

// The variants this CPU runs, bit `isa` set for each: 1 portable C++ (always), 2 AVX2, 3 AVX-VNNI,
// 4 AVX512-VNNI. (Not nested: AVX512-VNNI CPUs such as Zen 4 or Ice Lake lack the VEX AVX-VNNI.)
int64_t qdot_cpu_isas() {
  return (1 << 1) | (has_avx2() ? 1 << 2 : 0) | (has_avx_vnni() ? 1 << 3 : 0) | (has_avx512_vnni() ? 1 << 4 : 0);
}

void check_isa(int64_t isa) {
  TORCH_CHECK(isa >= 1 && isa <= 4, "qdot: isa must be 1 (plain), 2 (AVX2), 3 (AVX-VNNI) or 4 (AVX512-VNNI), got ",
              isa);
  TORCH_CHECK(qdot_cpu_isas() >> isa & 1, "qdot: this CPU cannot run isa ", isa);
}

// The residual of a quantized row: r = x - float(q) * d, a separately rounded product and difference
// (never contracted into one fused operation: compiled for the baseline instruction set, which has
// none, and with contraction off; so the torch reference's `x - q * d` gives the same bits).
__attribute__((optimize("fp-contract=off"))) void residual_row(const float* x, const int8_t* q, const float* d,
                                                              int64_t K, float* r) {
  for (int64_t k = 0; k < K; ++k) r[k] = x[k] - static_cast<float>(q[k]) * d[k / 32];
}

void quantize_row(int64_t isa, const float* x, int64_t K, int8_t* q, float* d, int32_t* sums) {
  if (isa == 4) v512::quantize_row(x, K, q, d, sums);
  else if (isa >= 2) avx2::quantize_row(x, K, q, d, sums);
  else quantize_plain(x, K, q, d, sums);
}

// levels 1: x [M, K] -> rows [M]; levels 2: rows [2M], x's quantization (rows 0..M-1) then that of
// its residual x - q * d (rows M..2M-1), so that the two levels' products summed carry ~15 bits.
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_acts(const at::Tensor& x, int64_t isa, int64_t levels) {
  check_isa(isa);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "quantize_acts: x must be a 2-D float32 tensor");
  TORCH_CHECK(levels == 1 || levels == 2, "quantize_acts: levels must be 1 or 2, got ", levels);
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  TORCH_CHECK(K % 32 == 0, "quantize_acts: K=", K, " is not a multiple of 32");
  at::Tensor q = at::empty({levels * M, K}, xc.options().dtype(at::kChar));
  at::Tensor d = at::empty({levels * M, K / 32}, xc.options());
  at::Tensor sums = at::empty({levels * M, K / 16}, xc.options().dtype(at::kInt));
  const float* xp = xc.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float* dp = d.data_ptr<float>();
  int32_t* sp = sums.data_ptr<int32_t>();
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(K, 1));
  deepinfer_pool::parallel_for(M, grain, [&](int64_t m0, int64_t m1) {
    std::vector<float> residual(levels == 2 ? K : 0);
    for (int64_t m = m0; m < m1; ++m) {
      quantize_row(isa, xp + m * K, K, qp + m * K, dp + m * (K / 32), sp + m * (K / 16));
      if (levels == 1) continue;
      residual_row(xp + m * K, qp + m * K, dp + m * (K / 32), K, residual.data());
      const int64_t r = M + m;
      quantize_row(isa, residual.data(), K, qp + r * K, dp + r * (K / 32), sp + r * (K / 16));
    }
  });
  return {q, d, sums};
}

// The lanes (weight rows per tile) of variant `isa`.
int64_t tile_rows_of(int64_t isa) { return isa == 4 ? v512::V::R : isa >= 2 ? kR256 : 1; }

// w uint8 [N, row bytes] (the file's blocks) -> the tile layout of variant `isa` (see
// tiled_block_bytes): uint8 [N rounded up to its R, K / 256 * tiled_block_bytes], zero rows after N.
at::Tensor pack_tiles(const at::Tensor& w, int64_t kind, int64_t isa) {
  check_isa(isa);
  const Kind kd = kind_of(kind);
  const int64_t tb = tiled_block_bytes(kd.id), R = tile_rows_of(isa);
  TORCH_CHECK(tb && R > 1, "pack_tiles: no tile layout for type ", kind, " on isa ", isa);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.size(1) % kd.block_bytes == 0,
              "pack_tiles: w must be uint8 [N, a multiple of ", kd.block_bytes, "]");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), nb = wc.size(1) / kd.block_bytes, tiles = (N + R - 1) / R;
  at::Tensor out = at::empty({tiles * R, nb * tb}, wc.options());
  const uint8_t* src = wc.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t row_bytes = wc.size(1);
  deepinfer_pool::parallel_for(tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t valid = std::min(R, N - t * R);
      uint8_t* out_at = dst + t * R * nb * tb;  // written in order: one sequential stream
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t c = 0; c < tb / 16; ++c)
          for (int64_t j = 0; j < 4; ++j) {
            const uint8_t* from = src + t * R * row_bytes + b * kd.block_bytes + tiled_column_source(kd.id, c) + 4 * j;
            for (int64_t r = 0; r < R; ++r, out_at += 4) {
              if (r < valid) std::memcpy(out_at, from + r * row_bytes, 4);
              else std::memset(out_at, 0, 4);  // the rows after the last: zero scales, zero terms
            }
          }
    }
  });
  return out;
}

// rows >= 0: w is the tile layout (pack_tiles, for this isa) of a weight of `rows` rows; -1: the file's.
at::Tensor qdot(const at::Tensor& q, const at::Tensor& d, const at::Tensor& sums, const at::Tensor& w, int64_t kind,
                int64_t K, int64_t isa, int64_t levels, int64_t rows) {
  check_isa(isa);
  TORCH_CHECK(levels == 1 || levels == 2, "qdot: levels must be 1 or 2, got ", levels);
  const Kind kd = kind_of(kind);
  TORCH_CHECK(!grid_kind(kd.id) || deepinfer_iq::tables_ready(),
              "qdot: the grid tables of type ", kind, " are not loaded (qdot.py hands them over: iq_tables)");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == at::kChar && q.size(1) == K, "qdot: q must be int8 [M, K=", K, "]");
  const bool tiled = rows >= 0;
  const int64_t M = q.size(0), N = tiled ? rows : w.size(0);
  TORCH_CHECK(M % levels == 0, "qdot: ", M, " activation rows do not hold ", levels, " levels");
  TORCH_CHECK(K % kd.block_values == 0, "qdot: K=", K, " is not a multiple of the block size ", kd.block_values);
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.dim() == 2 && d.size(0) == M && d.size(1) == K / 32,
              "qdot: d must be float32 [M, K/32]");
  TORCH_CHECK(sums.scalar_type() == at::kInt && sums.dim() == 2 && sums.size(0) == M && sums.size(1) == K / 16,
              "qdot: sums must be int32 [M, K/16]");
  if (tiled) {
    const int64_t R = tile_rows_of(isa), tb = tiled_block_bytes(kd.id);
    TORCH_CHECK(tb && R > 1, "qdot: no tile layout for type ", kind, " on isa ", isa);
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.size(0) == (rows + R - 1) / R * R &&
                    w.size(1) == K / 256 * tb,
                "qdot: a tiled w must be uint8 [", (rows + R - 1) / R * R, ", ", K / 256 * tb, "] (pack_tiles)");
  } else {
    TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kByte && w.size(1) == K / kd.block_values * kd.block_bytes,
                "qdot: w must be uint8 [N, ", K / kd.block_values * kd.block_bytes, "] for K=", K);
  }
  const at::Tensor qc = q.contiguous(), dc = d.contiguous(), sc = sums.contiguous(), wc = w.contiguous();
  at::Tensor y = at::empty({M / levels, N}, qc.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  // The unit terms of the activations: -offset * s starts a unit's sum, float(s) its min term.
  const int64_t offset = signed_kind(kd.id) ? (isa >= 3 ? 128 : 0) : kd.offset;
  const int64_t units = K / kd.unit;
  std::vector<float> sf(kd.has_min && isa == 1 ? M * units : 0);  // the portable variant's min terms
  const int32_t* s16 = sc.data_ptr<int32_t>();
  auto unit_sum = [&](int64_t m, int64_t u) {
    const int32_t* r = s16 + m * (K / 16);
    return kd.unit == 16 ? r[u] : r[2 * u] + r[2 * u + 1];
  };
  for (int64_t m = 0; !sf.empty() && m < M; ++m)
    for (int64_t u = 0; u < units; ++u) sf[m * units + u] = static_cast<float>(unit_sum(m, u));
  // The SIMD variants' panels: all rows (up to kFusedRows), else MR rows at a time, then 4, 2, 1.
  const int64_t mr = isa == 4 ? v512::V::MR : isa >= 2 ? kMR256 : 0;
  std::vector<Panel> panels;
  if (mr && M <= kFusedRows) panels.push_back(Panel{0, M, nullptr, nullptr, nullptr, nullptr});
  for (int64_t m0 = 0, w = mr; mr && M > kFusedRows && m0 < M; w /= 2)
    for (; w && m0 + w <= M; m0 += w) panels.push_back(Panel{m0, w, nullptr, nullptr, nullptr, nullptr});
  std::vector<int32_t> qpack(mr ? M * K / 4 : 0), ipack(mr && offset ? M * units : 0);
  std::vector<float> dpack(mr ? M * units : 0), spack(mr && kd.has_min ? M * units : 0);
  const int8_t* qp = qc.data_ptr<int8_t>();
  const float* dp = dc.data_ptr<float>();
  deepinfer_pool::parallel_for(static_cast<int64_t>(panels.size()), 1, [&](int64_t p0, int64_t p1) {
    for (int64_t k = p0; k < p1; ++k) {
      Panel& pn = panels[k];
      const int64_t at = pn.m0 * K / 4, ua = pn.m0 * units, w = pn.rows;
      for (int64_t i = 0; i < w; ++i) {
        const int64_t m = pn.m0 + i;
        for (int64_t g = 0; g < K / 4; ++g) qpack[at + g * w + i] = load_i32(qp + m * K + 4 * g);
        for (int64_t u = 0; u < units; ++u) {
          dpack[ua + u * w + i] = dp[m * (K / 32) + u * kd.unit / 32];
          if (offset) ipack[ua + u * w + i] = static_cast<int32_t>(-offset * unit_sum(m, u));
          if (kd.has_min) spack[ua + u * w + i] = static_cast<float>(unit_sum(m, u));
        }
      }
      pn.q = qpack.data() + at;
      pn.d = dpack.data() + ua;
      pn.init = offset ? ipack.data() + ua : nullptr;
      pn.sf = kd.has_min ? spack.data() + ua : nullptr;
    }
  });
  const Problem pb{qp, dp, sf.empty() ? nullptr : sf.data(), wc.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, K,
                   wc.size(1), levels, kd, panels.data(), static_cast<int64_t>(panels.size()), tiled};
  const int64_t R = tile_rows_of(isa);
  const int64_t tiles = (N + R - 1) / R;
  // Tasks of at least ~64 K (weight bytes x activation rows): small calls stay on one thread.
  const int64_t work = R * pb.row_bytes * std::max<int64_t>(M, 1);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(work, 1));
  auto run = [&](int64_t t0, int64_t t1) {
    if (isa == 4) v512::qdot_tiles(pb, t0, t1);
    else if (isa == 3) vnni256::qdot_tiles(pb, t0, t1);
    else if (isa == 2) avx2::qdot_tiles(pb, t0, t1);
    else qdot_plain(pb, t0, std::min(t1, N));
  };
  // Each thread streams its own contiguous share of the weight's tiles (decode is memory-bound), then
  // takes chunks of `grain` tiles left in the others' shares: a thread the OS pauses (another process
  // on its core) holds up the call by the chunk it has, not by its whole share.
  deepinfer_pool::parallel_for(tiles, grain, run);
  return y;
}

// quantize_acts then qdot in one call (what a layer runs): x fp32 [M, K] -> y fp32 [M, N]; with two
// levels, each row's two products are added (level 1 + level 2, one fp32 add per output).
at::Tensor qlinear(const at::Tensor& x, const at::Tensor& w, int64_t kind, int64_t K, int64_t isa, int64_t levels,
                   int64_t rows) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "qlinear: x must be [M, K=", K, "]");
  const auto [q, d, sums] = quantize_acts(x, isa, levels);
  return qdot(q, d, sums, w, kind, K, isa, levels, rows);  // [M, N]
}

}  // namespace
}  // namespace deepinfer_qdot

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("quantize_acts(Tensor x, int isa, int levels=1) -> (Tensor, Tensor, Tensor)");
  m.def("qdot(Tensor q, Tensor d, Tensor sums, Tensor w, int kind, int K, int isa, int levels=1, int rows=-1) -> Tensor");
  m.def("qlinear(Tensor x, Tensor w, int kind, int K, int isa, int levels=1, int rows=-1) -> Tensor");
  m.def("pack_tiles(Tensor w, int kind, int isa) -> Tensor");
  m.def("qdot_cpu_isas() -> int", deepinfer_qdot::qdot_cpu_isas);
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("quantize_acts", deepinfer_qdot::quantize_acts);
  m.impl("qdot", deepinfer_qdot::qdot);
  m.impl("qlinear", deepinfer_qdot::qlinear);
  m.impl("pack_tiles", deepinfer_qdot::pack_tiles);
}

#endif  // DEEPINFER_QDOT_256

#else  // DEEPINFER_QDOT_BODY: the body, compiled once per instruction set with its `V`

using I = V::I;
using F = V::F;
constexpr int R = V::R;
constexpr int64_t kChunk = 16384 / R;  // values per decoded chunk: R * kChunk bytes of codes (16 KB)

// Decoders hand a sink, per unit u (numbered from the first block decoded), its scale A (`scale`),
// its min B (`min`, kinds with one) and its U/4 code vectors (`unit`; `unit_sign` for signed bytes
// with the sign trick: |w| and w; `later` then `settle` for a unit whose earlier units are still to come).

// The buffered sink: a tile chunk's codes and unit scales, for many activation rows.
struct Tile {
  uint8_t* codes;  // [values / 4][R][4]
  uint8_t* raw;    // signed bytes with the sign trick: the signed bytes, same layout
  float* A;        // [units][R]
  float* B;        // [units][R]
  int64_t groups;  // U / 4
  INLINE void scale(int64_t u, F a) const { V::storef(A + u * R, a); }
  INLINE void min(int64_t u, F b) const { V::storef(B + u * R, b); }
  INLINE void unit(int64_t u, const I* v) const {
    for (int64_t g = 0; g < groups; ++g) V::store(codes + (u * groups + g) * R * 4, v[g]);
  }
  INLINE void unit_sign(int64_t u, const I* abs, const I* w) const {
    for (int64_t g = 0; g < groups; ++g) {
      V::store(codes + (u * groups + g) * R * 4, abs[g]);
      V::store(raw + (u * groups + g) * R * 4, w[g]);
    }
  }
  INLINE void later(int64_t u, const I* v) const { unit(u, v); }
  INLINE void settle(int64_t) const {}
};

// A unit of 32 IQ4 values from its 8 vectors of 4-bit codes: the table's signed values, as Q8_0's
// bytes are taken (biased by 128 with VNNI; |w| and w with the sign trick).
template <class Sink>
INLINE void iq4_unit(Sink& sink, int64_t u, const I* nib) {
  I codes[8];
  if constexpr (V::kSignTrick) {
    I raw[8];
    for (int g = 0; g < 8; ++g) {
      raw[g] = V::lut(kIQ4Values, nib[g]);
      codes[g] = V::abs8(raw[g]);
    }
    sink.unit_sign(u, codes, raw);
  } else {
    for (int g = 0; g < 8; ++g) codes[g] = V::lut(kIQ4Biased, nib[g]);
    sink.unit(u, codes);
  }
}

// Blocks of 32 values (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) at p + r * stride (rows r < R): unit u.
// (The fp16 fields come from the same 16-byte loads and transposes: gathers are slower.)
template <int KIND, class Sink>
INLINE void decode32(const uint8_t* p, int64_t stride, Sink& sink, int64_t u) {
  constexpr int qs_at = KIND == 2 ? 2 : KIND == 3 ? 4 : KIND == 6 ? 6 : KIND == 7 ? 8 : 2;
  const I nib = V::set1(0x0F0F0F0F);
  I head[4];  // the block's bytes 0..15: d (and m), qh
  V::load_t4(p, stride, head);
  sink.scale(u, V::half_lo(head[0]));
  if constexpr (KIND == 3 || KIND == 7) sink.min(u, V::half_lo(V::srl(head[0], 16)));
  I qs[8], codes[8];
  V::load_t4(p + qs_at, stride, qs);
  if constexpr (KIND == 8) {
    V::load_t4(p + qs_at + 16, stride, qs + 4);
    if constexpr (V::kSignTrick) {
      for (int g = 0; g < 8; ++g) codes[g] = V::abs8(qs[g]);
      sink.unit_sign(u, codes, qs);
    } else {
      for (int g = 0; g < 8; ++g) codes[g] = V::xor_(qs[g], V::set1(static_cast<int32_t>(0x80808080u)));
      sink.unit(u, codes);
    }
  } else {
    I qh = V::set1(0);  // Q5_0: bytes 2..5, Q5_1: bytes 4..7
    if constexpr (KIND == 6) qh = V::or_(V::srl(head[0], 16), V::sll(head[1], 16));
    if constexpr (KIND == 7) qh = head[1];
    for (int g = 0; g < 4; ++g) {
      codes[g] = V::and_(qs[g], nib);
      codes[g + 4] = V::and_(V::srl(qs[g], 4), nib);
      if constexpr (KIND == 6 || KIND == 7) {
        codes[g] = V::or_(codes[g], V::spread(qh, 4 * g));
        codes[g + 4] = V::or_(codes[g + 4], V::spread(qh, 16 + 4 * g));
      }
    }
    if constexpr (KIND == 20) iq4_unit(sink, u, codes);
    else sink.unit(u, codes);
  }
}

// The 16 bytes at offset `at` (a multiple of 16) of rows r < R's blocks -> out[j] = their dword j (lane
// r). The file layout: row r's block at p + r * stride, read with 16-byte loads and a transpose. The
// tile layout (TILED, pack_tiles): the R blocks' bytes at p already so ordered, four plain loads.
template <bool TILED>
INLINE void block_t4(const uint8_t* p, int at, int64_t stride, I out[4]) {
  if constexpr (TILED) {
    for (int j = 0; j < 4; ++j) out[j] = V::load(p + at / 16 * (16 * R) + j * (4 * R));
  } else {
    V::load_t4(p + at, stride, out);
  }
}

// Q4_K / Q5_K super-block of rows r < R (see block_t4): units u0 .. u0+7.
template <int KIND, bool TILED, class Sink>
INLINE void decode_k45(const uint8_t* p, int64_t stride, Sink& sink, int64_t u0) {
  I h[4];
  block_t4<TILED>(p, 0, stride, h);  // d|dmin, scale bytes 0-3, 4-7, 8-11
  const F d = V::half_lo(h[0]), dmin = V::half_lo(V::srl(h[0], 16));
  // Unit j's scale and min, handed to the sink just before its codes (few registers live at once).
  auto scales = [&](int j) {
    const I m6 = V::set1(63), m4 = V::set1(0xF), m30 = V::set1(0x30);
    I sc, mn;
    if (j < 4) {
      sc = V::and_(V::srl(h[1], 8 * j), m6);
      mn = V::and_(V::srl(h[2], 8 * j), m6);
    } else {
      const int i = j - 4;
      sc = V::or_(V::and_(V::srl(h[3], 8 * i), m4), V::and_(V::srl(h[1], 8 * i + 2), m30));
      mn = V::or_(V::and_(V::srl(h[3], 8 * i + 4), m4), V::and_(V::srl(h[2], 8 * i + 2), m30));
    }
    sink.scale(u0 + j, V::mul(d, V::cvt(sc)));
    sink.min(u0 + j, V::neg(V::mul(dmin, V::cvt(mn))));
  };
  constexpr int qs_at = KIND == 12 ? 16 : 48;
  I qh[8];
  if constexpr (KIND == 13) {
    block_t4<TILED>(p, 16, stride, qh);
    block_t4<TILED>(p, 32, stride, qh + 4);
  }
  const I nib = V::set1(0x0F0F0F0F), bit = V::set1(0x01010101);
  #pragma GCC unroll 8
  for (int pair = 0; pair < 4; ++pair) {
    I qs[8], lo[8], hi[8];
    block_t4<TILED>(p, qs_at + 32 * pair, stride, qs);
    block_t4<TILED>(p, qs_at + 32 * pair + 16, stride, qs + 4);
    #pragma GCC unroll 8
    for (int g = 0; g < 8; ++g) {
      lo[g] = V::and_(qs[g], nib);
      hi[g] = V::and_(V::srl(qs[g], 4), nib);
      if constexpr (KIND == 13) {
        lo[g] = V::or_(lo[g], V::sll(V::and_(V::srl(qh[g], 2 * pair), bit), 4));
        hi[g] = V::or_(hi[g], V::sll(V::and_(V::srl(qh[g], 2 * pair + 1), bit), 4));
      }
    }
    scales(2 * pair);
    sink.unit(u0 + 2 * pair, lo);
    scales(2 * pair + 1);
    sink.unit(u0 + 2 * pair + 1, hi);
  }
}

// Q6_K super-block of rows r < R (see block_t4): units (of 16) u0 .. u0+15.
template <bool TILED, class Sink>
INLINE void decode_q6k(const uint8_t* p, int64_t stride, Sink& sink, int64_t u0) {
  I sc[4], tail[4];
  block_t4<TILED>(p, 192, stride, sc);  // the 16 int8 scales
  // bytes 194..209: d in the last dword's upper half (the tile layout keeps them at 208)
  if constexpr (TILED) block_t4<true>(p, 208, stride, tail);
  else V::load_t4(p + 194, stride, tail);
  const F d = V::half_lo(V::srl(tail[3], 16));
  auto scale = [&](int s) {  // unit s's scale, handed to the sink just before its float step
    const I v = V::sra(V::sll(sc[s / 4], 24 - 8 * (s % 4)), 24);  // int8 scale, sign-extended
    sink.scale(u0 + s, V::mul(d, V::cvt(v)));
  };
  // Unrolled in full: the qh vectors, the waiting sums and the scales stay in registers (as loops, with
  // indexes known only at run time, they went through the stack).
  const I nib = V::set1(0x0F0F0F0F), m30 = V::set1(0x30303030);
  #pragma GCC unroll 8
  for (int h = 0; h < 2; ++h) {
    I qh[8];
    block_t4<TILED>(p, 128 + 32 * h, stride, qh);
    block_t4<TILED>(p, 128 + 32 * h + 16, stride, qh + 4);
    // A 16-byte column of ql holds unit 8h + quarter (low nibbles) and unit 8h + 4 + quarter (high):
    // the low units are taken in order as they come, the high ones' sums wait and are settled after.
    #pragma GCC unroll 8
    for (int quarter = 0; quarter < 4; ++quarter) {  // ql bytes 64h + 16 quarter .. + 15
      I ql[4], lo[4], hi[4];
      block_t4<TILED>(p, 64 * h + 16 * quarter, stride, ql);
      #pragma GCC unroll 8
      for (int j = 0; j < 4; ++j) {
        const int r = 16 * quarter + 4 * j;  // values 128h + r (low nibbles) and 128h + r + 64 (high)
        // the high bit pairs (bits 2 (r / 32) and 2 (r / 32) + 4 of qh) moved straight to bits 4..5
        const I q = qh[(r % 32) / 4];
        const I qh_lo = V::and_(r / 32 ? V::sll(q, 2) : V::sll(q, 4), m30);
        const I qh_hi = V::and_(r / 32 ? V::srl(q, 2) : q, m30);
        lo[j] = V::or_(V::and_(ql[j], nib), qh_lo);
        hi[j] = V::or_(V::and_(V::srl(ql[j], 4), nib), qh_hi);
      }
      scale(8 * h + quarter);
      sink.unit(u0 + 8 * h + quarter, lo);  // values 128h + 16 quarter ..
      sink.later(u0 + 8 * h + 4 + quarter, hi);  // values 128h + 64 + 16 quarter ..
    }
    #pragma GCC unroll 8
    for (int quarter = 0; quarter < 4; ++quarter) {
      scale(8 * h + 4 + quarter);
      sink.settle(u0 + 8 * h + 4 + quarter);
    }
  }
}

// Q2_K / Q3_K super-block: units (of 16) u0 .. u0+15. Per half of 128 values, 32 bytes of 2-bit
// codes: bits 2j..2j+1 of byte l are value 32j + l, unit 2j + l / 16 of the half (Q3_K: the high
// bit of value i is bit i / 32 of byte i % 32 of hmask, its code offset 4).
template <int KIND, class Sink>
INLINE void decode_q23k(const uint8_t* p, int64_t stride, Sink& sink, int64_t u0) {
  constexpr bool Q2 = KIND == 10;
  I sc[4], tail[4], hm[8];
  V::load_t4(p + (Q2 ? 0 : 92), stride, sc);  // Q2_K: the 16 scale|min bytes; Q3_K: 12 scale bytes in dwords 1..3
  V::load_t4(p + (Q2 ? 68 : 94), stride, tail);  // the last dword: Q2_K d | dmin, Q3_K d in its upper half
  const F d = V::half_lo(Q2 ? tail[3] : V::srl(tail[3], 16)), dmin = V::half_lo(V::srl(tail[3], 16));
  if constexpr (!Q2) {
    V::load_t4(p, stride, hm);
    V::load_t4(p + 16, stride, hm + 4);
  }
  auto scale = [&](int s) {  // unit s's scale (and min), handed to the sink just before its codes
    const I m4 = V::set1(0xF);
    if constexpr (Q2) {
      const I byte = V::and_(V::srl(sc[s / 4], 8 * (s % 4)), V::set1(0xFF));
      sink.scale(u0 + s, V::mul(d, V::cvt(V::and_(byte, m4))));
      sink.min(u0 + s, V::neg(V::mul(dmin, V::cvt(V::srl(byte, 4)))));
    } else {  // low nibble: byte s % 8 (high nibble from s = 8), high pair: byte 8 + s % 4, bits 2 (s / 4)
      const I lo = V::and_(V::srl(sc[1 + (s % 8) / 4], 8 * (s % 4) + 4 * (s / 8)), m4);
      const I hi = V::and_(V::srl(sc[3], 8 * (s % 4) + 2 * (s / 4)), V::set1(3));
      sink.scale(u0 + s, V::mul(d, V::cvt(V::addi(V::or_(lo, V::sll(hi, 4)), V::set1(-32)))));
    }
  };
  const I two = V::set1(0x03030303), one = V::set1(0x01010101);
  for (int h = 0; h < 2; ++h) {
    I qs[8];
    V::load_t4(p + (Q2 ? 16 : 32) + 32 * h, stride, qs);
    V::load_t4(p + (Q2 ? 32 : 48) + 32 * h, stride, qs + 4);
    for (int j = 0; j < 4; ++j)
      for (int half = 0; half < 2; ++half) {
        I codes[4];
        for (int g = 0; g < 4; ++g) {
          codes[g] = V::and_(V::srl(qs[4 * half + g], 2 * j), two);
          if constexpr (!Q2) codes[g] = V::or_(codes[g], V::sll(V::and_(V::srl(hm[4 * half + g], 4 * h + j), one), 2));
        }
        scale(8 * h + 2 * j + half);
        sink.unit(u0 + 8 * h + 2 * j + half, codes);
      }
  }
}

// IQ4_XS super-block: units (of 32) u0 .. u0+7, each scale d * (ls - 32) with a 6-bit ls (low
// nibble 4 ib of scales_l, high pair 2 ib of scales_h).
template <class Sink>
INLINE void decode_iq4xs(const uint8_t* p, int64_t stride, Sink& sink, int64_t u0) {
  I h[4];
  V::load_t4(p, stride, h);  // d | scales_h, scales_l, ...
  const F d = V::half_lo(h[0]);
  const I nib = V::set1(0x0F0F0F0F);
  for (int ib = 0; ib < 8; ++ib) {
    const I lo = V::and_(V::srl(h[1], 4 * ib), V::set1(0xF));
    const I hi = V::and_(V::srl(h[0], 16 + 2 * ib), V::set1(3));
    sink.scale(u0 + ib, V::mul(d, V::cvt(V::addi(V::or_(lo, V::sll(hi, 4)), V::set1(-32)))));
    I qs[4], codes[8];
    V::load_t4(p + 8 + 16 * ib, stride, qs);
    for (int g = 0; g < 4; ++g) {
      codes[g] = V::and_(qs[g], nib);
      codes[g + 4] = V::and_(V::srl(qs[g], 4), nib);
    }
    iq4_unit(sink, u0 + ib, codes);
  }
}

// A grid kind's super-block of the R rows: each row decoded alone (iq_grid_cpu.cpp) into signed bytes,
// then read across rows with the transposed loads and taken as Q8_0's bytes are. Units of U values
// (16 or 32): units u0 .. u0 + 256 / U - 1.
template <int U, class Sink>
INLINE void decode_grid(int64_t id, const uint8_t* p, int64_t stride, Sink& sink, int64_t u0) {
  constexpr int NU = 256 / U;
  alignas(64) int8_t vals[R * 256];
  alignas(64) float A[NU * R];
  float row_scales[NU];
  for (int r = 0; r < R; ++r) {
    deepinfer_iq::decode_block(id, p + r * stride, vals + r * 256, row_scales);
    for (int u = 0; u < NU; ++u) A[u * R + r] = row_scales[u];
  }
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(vals);
  for (int u = 0; u < NU; ++u) {
    sink.scale(u0 + u, V::loadf(A + u * R));
    I w[U / 4], codes[U / 4];
    for (int h = 0; h < U / 16; ++h) V::load_t4(bytes + u * U + 16 * h, 256, w + 4 * h);
    if constexpr (V::kSignTrick) {
      for (int g = 0; g < U / 4; ++g) codes[g] = V::abs8(w[g]);
      sink.unit_sign(u0 + u, codes, w);
    } else {
      for (int g = 0; g < U / 4; ++g) codes[g] = V::xor_(w[g], V::set1(static_cast<int32_t>(0x80808080u)));
      sink.unit(u0 + u, codes);
    }
  }
}

// ---- the grid kinds, decoded in registers: grid rows gathered per lane (row), signs as byte masks ----

// A unit of G signed-byte vectors w (|w| in mag) into the sink, as Q8_0's bytes are taken.
template <int G, class Sink>
INLINE void grid_unit(Sink& sink, int64_t u, I* w, I* mag) {
  if constexpr (V::kSignTrick) {
    sink.unit_sign(u, mag, w);
  } else {
    for (int g = 0; g < G; ++g) w[g] = V::xor_(w[g], V::set1(static_cast<int32_t>(0x80808080u)));
    sink.unit(u, w);
  }
}

// 7 sign bits -> the 8 with even parity (ggml's ksigns table, computed).
INLINE I with_parity(I s7) {
  I t = V::xor_(s7, V::srl(s7, 4));
  t = V::xor_(t, V::srl(t, 2));
  t = V::xor_(t, V::srl(t, 1));
  return V::or_(s7, V::sll(V::and_(t, V::set1(1)), 7));
}

// The 8 grid bytes of row gi (two dwords: values 0..3, 4..7) with the bytes whose bit is set in
// s8 negated ((g ^ 0xFF) + 1: a grid byte is never 0); mag gets the grid bytes.
INLINE void signed_row8(const int8_t* grid, I gi, I s8, I* w, I* mag) {
  V::gather8(grid, gi, mag[0], mag[1]);
  const I lo = V::mask_ff(V::and_(s8, V::set1(15))), hi = V::mask_ff(V::srl(s8, 4));
  w[0] = V::sub8(V::xor_(mag[0], lo), lo);
  w[1] = V::sub8(V::xor_(mag[1], hi), hi);
}

// IQ3's two rows of 4 (gi, gj) with the sign byte s8.
INLINE void signed_rows4(const int8_t* grid, I gi, I gj, I s8, I* w, I* mag) {
  mag[0] = V::gather4(grid, gi);
  mag[1] = V::gather4(grid, gj);
  const I lo = V::mask_ff(V::and_(s8, V::set1(15))), hi = V::mask_ff(V::srl(s8, 4));
  w[0] = V::sub8(V::xor_(mag[0], lo), lo);
  w[1] = V::sub8(V::xor_(mag[1], hi), hi);
}

INLINE I byte_at(I v, int b) { return V::and_(V::srl(v, 8 * b), V::set1(0xFF)); }

// d (0.5 + ls) * f, in the scalar decoder's order of operations.
INLINE F half_step(F d, I ls, float f) { return V::mul(V::mul(d, V::add(V::cvt(ls), V::set1f(0.5f))), V::set1f(f)); }

template <class Sink>
INLINE void decode_iq2xxs(const uint8_t* p, int64_t stride, Sink& sink, int64_t u0) {
  const int8_t* grid = deepinfer_iq::grid_table(0);
  I h[4];
  V::load_t4(p, stride, h);
  const F d = V::half_lo(h[0]);
  for (int k = 0; k < 4; ++k) {
    I q[4];
    V::load_t4(p + 2 + 16 * k, stride, q);  // per 32 values: 4 grid indices, then 4 x 7 sign bits | ls
    for (int half = 0; half < 2; ++half) {
      const I idx = q[2 * half], aux = q[2 * half + 1];
      sink.scale(u0 + 2 * k + half, half_step(d, V::srl(aux, 28), 0.25f));
      I w[8], mag[8];
      for (int l = 0; l < 4; ++l)
        signed_row8(grid, byte_at(idx, l), with_parity(V::and_(V::srl(aux, 7 * l), V::set1(127))), w + 2 * l,
                    mag + 2 * l);
      grid_unit<8>(sink, u0 + 2 * k + half, w, mag);
    }
  }
}

template <class Sink>
INLINE void decode_iq2xs(const uint8_t* p, int64_t stride, Sink& sink, int64_t u0) {
  const int8_t* grid = deepinfer_iq::grid_table(1);
  I h[4], sc[4];
  V::load_t4(p, stride, h);
  V::load_t4(p + 58, stride, sc);  // sc[2], sc[3]: the scale bytes 66..73
  const F d = V::half_lo(h[0]);
  for (int k = 0; k < 4; ++k) {
    I q[4];
    V::load_t4(p + 2 + 16 * k, stride, q);  // uint16 per 8 values: 9-bit index | 7 sign bits
    for (int j = 0; j < 4; ++j) {
      const int u = 4 * k + j;
      const I ls = V::and_(V::srl(sc[2 + u / 8], 8 * ((u / 2) % 4) + 4 * (u % 2)), V::set1(15));
      sink.scale(u0 + u, half_step(d, ls, 0.25f));
      I w[4], mag[4];
      for (int t = 0; t < 2; ++t) {
        const I qv = V::and_(V::srl(q[j], 16 * t), V::set1(0xFFFF));
        signed_row8(grid, V::and_(qv, V::set1(511)), with_parity(V::srl(qv, 9)), w + 2 * t, mag + 2 * t);
      }
      grid_unit<4>(sink, u0 + u, w, mag);
    }
  }
}

template <class Sink>
INLINE void decode_iq2s(const uint8_t* p, int64_t stride, Sink& sink, int64_t u0) {
  const int8_t* grid = deepinfer_iq::grid_table(2);
  I h[4], qa[8], sg[8], t[4];
  V::load_t4(p, stride, h);
  V::load_t4(p + 2, stride, qa);  // low index bytes, one per 8 values
  V::load_t4(p + 18, stride, qa + 4);
  V::load_t4(p + 34, stride, sg);  // sign bytes
  V::load_t4(p + 50, stride, sg + 4);
  V::load_t4(p + 66, stride, t);  // t[0..1]: 2 high index bits per 8 values, t[2..3]: scales
  const F d = V::half_lo(h[0]);
  for (int u = 0; u < 16; ++u) {
    const I ls = V::and_(V::srl(t[2 + u / 8], 8 * ((u / 2) % 4) + 4 * (u % 2)), V::set1(15));
    sink.scale(u0 + u, half_step(d, ls, 0.25f));
    I w[4], mag[4];
    for (int e = 0; e < 2; ++e) {
      const int g = 2 * u + e;
      const I high = V::and_(V::srl(t[g / 16], 8 * ((g / 4) % 4) + 2 * (g % 4)), V::set1(3));
      signed_row8(grid, V::or_(byte_at(qa[g / 4], g % 4), V::sll(high, 8)), byte_at(sg[g / 4], g % 4), w + 2 * e,
                  mag + 2 * e);
    }
    grid_unit<4>(sink, u0 + u, w, mag);
  }
}

template <class Sink>
INLINE void decode_iq3xxs(const uint8_t* p, int64_t stride, Sink& sink, int64_t u0) {
  const int8_t* grid = deepinfer_iq::grid_table(3);
  I h[4], qd[16], ax[8];
  V::load_t4(p, stride, h);
  for (int k = 0; k < 4; ++k) V::load_t4(p + 2 + 16 * k, stride, qd + 4 * k);  // one grid index per 4 values
  V::load_t4(p + 66, stride, ax);  // per 32 values: 4 x 7 sign bits | ls
  V::load_t4(p + 82, stride, ax + 4);
  const F d = V::half_lo(h[0]);
  for (int ib = 0; ib < 8; ++ib) {
    sink.scale(u0 + ib, half_step(d, V::srl(ax[ib], 28), 0.5f));
    I w[8], mag[8];
    for (int l = 0; l < 4; ++l) {
      const I idx = qd[2 * ib + l / 2];
      signed_rows4(grid, byte_at(idx, 2 * (l % 2)), byte_at(idx, 2 * (l % 2) + 1),
                   with_parity(V::and_(V::srl(ax[ib], 7 * l), V::set1(127))), w + 2 * l, mag + 2 * l);
    }
    grid_unit<8>(sink, u0 + ib, w, mag);
  }
}

template <class Sink>
INLINE void decode_iq3s(const uint8_t* p, int64_t stride, Sink& sink, int64_t u0) {
  const int8_t* grid = deepinfer_iq::grid_table(4);
  I h[4], qd[16], a[4], b[4], c[4];
  V::load_t4(p, stride, h);
  for (int k = 0; k < 4; ++k) V::load_t4(p + 2 + 16 * k, stride, qd + 4 * k);  // low index bytes, one per 4 values
  V::load_t4(p + 66, stride, a);  // a[0..1]: the ninth index bits, a[2..3]: sign bytes 0..7
  V::load_t4(p + 82, stride, b);  // sign bytes 8..23
  V::load_t4(p + 94, stride, c);  // c[1..2]: sign bytes 24..31, c[3]: the scales
  const I sg[8] = {a[2], a[3], b[0], b[1], b[2], b[3], c[1], c[2]};
  const F d = V::half_lo(h[0]);
  for (int ib = 0; ib < 8; ++ib) {
    const I ls = V::and_(V::srl(c[3], 8 * (ib / 2) + 4 * (ib % 2)), V::set1(15));
    sink.scale(u0 + ib, V::mul(d, V::cvt(V::addi(V::sll(ls, 1), V::set1(1)))));
    I w[8], mag[8];
    for (int l = 0; l < 4; ++l) {
      const int g = 4 * ib + l;  // 8 values: grid rows 2g, 2g + 1
      const I hb = V::srl(a[g / 16], 8 * ((g / 4) % 4) + 2 * (g % 4));
      const I gi = V::or_(byte_at(qd[g / 2], 2 * (g % 2)), V::sll(V::and_(hb, V::set1(1)), 8));
      const I gj = V::or_(byte_at(qd[g / 2], 2 * (g % 2) + 1), V::sll(V::and_(V::srl(hb, 1), V::set1(1)), 8));
      signed_rows4(grid, gi, gj, byte_at(sg[g / 4], g % 4), w + 2 * l, mag + 2 * l);
    }
    grid_unit<8>(sink, u0 + ib, w, mag);
  }
}

// IQ1: 8 grid values (times 8, gathered) plus delta (+-1 per byte: all bytes 1, or all 0xFF where
// the lane's `minus` is -1).
INLINE void iq1_row8(const int8_t* tab, I gi, I minus, I* w, I* mag) {
  const I delta = V::xor_(V::set1(0x01010101), V::and_(minus, V::set1(static_cast<int32_t>(0xFEFEFEFEu))));
  V::gather8(tab, gi, w[0], w[1]);
  for (int e = 0; e < 2; ++e) {
    w[e] = V::add8(w[e], delta);
    mag[e] = V::abs8(w[e]);
  }
}

template <class Sink>
INLINE void decode_iq1s(const uint8_t* p, int64_t stride, Sink& sink, int64_t u0) {
  const int8_t* tab = deepinfer_iq::iq1_table();
  I h[4], qa[8], qh[4];
  V::load_t4(p, stride, h);
  V::load_t4(p + 2, stride, qa);  // low index bytes, one per 8 values
  V::load_t4(p + 18, stride, qa + 4);
  V::load_t4(p + 34, stride, qh);  // uint16 per 32 values: 4 x 3 high index bits, ls, delta sign
  const F d = V::half_lo(h[0]);
  for (int ib = 0; ib < 8; ++ib) {
    const I q = V::and_(V::srl(qh[ib / 2], 16 * (ib % 2)), V::set1(0xFFFF));
    const I ls = V::and_(V::srl(q, 12), V::set1(7));
    sink.scale(u0 + ib, V::mul(V::mul(d, V::cvt(V::addi(V::sll(ls, 1), V::set1(1)))), V::set1f(0.125f)));
    const I minus = V::sra(V::sll(q, 16), 31);
    I w[8], mag[8];
    for (int l = 0; l < 4; ++l) {
      const int g = 4 * ib + l;
      const I gi = V::or_(byte_at(qa[g / 4], g % 4), V::sll(V::and_(V::srl(q, 3 * l), V::set1(7)), 8));
      iq1_row8(tab, gi, minus, w + 2 * l, mag + 2 * l);
    }
    grid_unit<8>(sink, u0 + ib, w, mag);
  }
}

template <class Sink>
INLINE void decode_iq1m(const uint8_t* p, int64_t stride, Sink& sink, int64_t u0) {
  const int8_t* tab = deepinfer_iq::iq1_table();
  I qa[8], qh[4], s[4];
  V::load_t4(p, stride, qa);  // low index bytes, one per 8 values
  V::load_t4(p + 16, stride, qa + 4);
  V::load_t4(p + 32, stride, qh);  // a nibble per 8 values: 3 high index bits | delta sign
  V::load_t4(p + 40, stride, s);  // s[2..3]: the 4 scale words (3-bit scales, d's nibbles on top)
  const I m16 = V::set1(0xFFFF);
  const I word[4] = {V::and_(s[2], m16), V::srl(s[2], 16), V::and_(s[3], m16), V::srl(s[3], 16)};
  const I bits = V::or_(V::or_(V::srl(word[0], 12), V::and_(V::srl(word[1], 8), V::set1(0xF0))),
                        V::or_(V::and_(V::srl(word[2], 4), V::set1(0xF00)), V::and_(word[3], V::set1(0xF000))));
  const F d = V::half_lo(bits);
  for (int u = 0; u < 16; ++u) {
    const I ls = V::and_(V::srl(word[u / 4], 3 * (u % 4)), V::set1(7));
    sink.scale(u0 + u, V::mul(V::mul(d, V::cvt(V::addi(V::sll(ls, 1), V::set1(1)))), V::set1f(0.125f)));
    I w[4], mag[4];
    for (int e = 0; e < 2; ++e) {
      const int g = 2 * u + e;
      const I nib = V::and_(V::srl(qh[g / 8], 8 * ((g / 2) % 4) + 4 * (g % 2)), V::set1(15));
      const I gi = V::or_(byte_at(qa[g / 4], g % 4), V::sll(V::and_(nib, V::set1(7)), 8));
      iq1_row8(tab, gi, V::sra(V::sll(nib, 28), 31), w + 2 * e, mag + 2 * e);
    }
    grid_unit<4>(sink, u0 + u, w, mag);
  }
}

// TQ2_0: 2-bit codes in Q2_K's planes (value 128h + 32j + l: bits 2j of byte 32h + l), value code - 1.
template <class Sink>
INLINE void decode_tq2(const uint8_t* p, int64_t stride, Sink& sink, int64_t u0) {
  I t[4];
  V::load_t4(p + 50, stride, t);  // d: the upper half of the last dword
  const F d = V::half_lo(V::srl(t[3], 16));
  for (int h = 0; h < 2; ++h) {
    I qs[8];
    V::load_t4(p + 32 * h, stride, qs);
    V::load_t4(p + 32 * h + 16, stride, qs + 4);
    for (int j = 0; j < 4; ++j) {
      I w[8], mag[8];
      for (int g = 0; g < 8; ++g) {
        w[g] = V::sub8(V::and_(V::srl(qs[g], 2 * j), V::set1(0x03030303)), V::set1(0x01010101));
        mag[g] = V::abs8(w[g]);
      }
      sink.scale(u0 + 4 * h + j, d);
      grid_unit<8>(sink, u0 + 4 * h + j, w, mag);
    }
  }
}

// TQ1_0's base-3 digits of 4 bytes a lane: digit n of byte x is floor(3 * (x * 3^n mod 256) / 256).
// With y = x * 3^n mod 256, 3y = (2y mod 256) + y + 256 * (y's top bit), so the digit is y's top bit
// plus the carry out of the byte sum (2y mod 256) + y, and that sum is the next digit's y.
INLINE I tq1_digit(I& y) {
  const I top = V::set1(static_cast<int32_t>(0x80808080u));
  const I twice = V::add8(y, y);
  const I next = V::add8(twice, y);
  // a byte sum's carry out: the top bit of (a & b) | ((a | b) & ~(a + b))
  const I carry = V::or_(V::and_(twice, y), V::and_(V::or_(twice, y), V::xor_(next, V::set1(-1))));
  const I digit = V::add8(V::srl(V::and_(y, top), 7), V::srl(V::and_(carry, top), 7));
  y = next;
  return V::sub8(digit, V::set1(0x01010101));
}

// TQ1_0 (54 bytes: 48 of five digits, 4 of four, the f16 d): value n * 32 + b is digit n of byte b
// (values 0-159), 160 + n * 16 + b of byte 32 + b, 240 + n * 4 + b of byte 48 + b; one scale d.
template <class Sink>
INLINE void decode_tq1(const uint8_t* p, int64_t stride, Sink& sink, int64_t u0) {
  I lo[8], mid[4], t[4];
  V::load_t4(p, stride, lo);
  V::load_t4(p + 16, stride, lo + 4);
  V::load_t4(p + 32, stride, mid);
  V::load_t4(p + 38, stride, t);  // bytes 38-53: t[2] = 46-49, t[3] = 50-53
  const F d = V::half_lo(V::srl(t[3], 16));
  I high = V::or_(V::srl(t[2], 16), V::sll(t[3], 16));  // bytes 48-51
  I w[8], mag[8];
  auto emit = [&](int u) {
    for (int g = 0; g < 8; ++g) mag[g] = V::abs8(w[g]);
    sink.scale(u0 + u, d);
    grid_unit<8>(sink, u0 + u, w, mag);
  };
  for (int n = 0; n < 5; ++n) {  // units 0-4: digit n of bytes 0-31
    for (int g = 0; g < 8; ++g) w[g] = tq1_digit(lo[g]);
    emit(n);
  }
  for (int u = 5; u < 8; ++u) {  // units 5-7: two digits of bytes 32-47 (the last unit: one, then bytes 48-51)
    for (int g = 0; g < 4; ++g) w[g] = tq1_digit(mid[g]);
    if (u < 7) {
      for (int g = 0; g < 4; ++g) w[4 + g] = tq1_digit(mid[g]);
    } else {
      for (int g = 0; g < 4; ++g) w[4 + g] = tq1_digit(high);
    }
    emit(u);
  }
}

// A grid kind's block (the kind read at run time).
template <int U, class Sink>
INLINE void decode_grid_kind(int64_t id, const uint8_t* p, int64_t stride, Sink& sink, int64_t u0) {
  if constexpr (U == 16) {
    if (id == 17) return decode_iq2xs(p, stride, sink, u0);
    if (id == 22) return decode_iq2s(p, stride, sink, u0);
    if (id == 29) return decode_iq1m(p, stride, sink, u0);
  } else {
    if (id == 16) return decode_iq2xxs(p, stride, sink, u0);
    if (id == 18) return decode_iq3xxs(p, stride, sink, u0);
    if (id == 21) return decode_iq3s(p, stride, sink, u0);
    if (id == 19) return decode_iq1s(p, stride, sink, u0);
    if (id == 35) return decode_tq2(p, stride, sink, u0);
    if (id == 34) return decode_tq1(p, stride, sink, u0);
  }
  decode_grid<U>(id, p, stride, sink, u0);
}

template <int KIND>
constexpr int64_t block_bytes() {
  for (const Kind& k : kKinds)
    if (k.id == KIND) return k.block_bytes;
  return 0;
}

template <int KIND>
constexpr int unit_of() {
  if (KIND == kGrid16 || KIND == kGrid32) return KIND == kGrid16 ? 16 : 32;
  for (const Kind& k : kKinds)
    if (k.id == KIND) return static_cast<int>(k.unit);
  return 0;
}

// The next tile's bytes are prefetched (into L2) only up to this size. A tile of longer rows (K of
// about 4096 values or more) is left to the hardware's stream prefetchers, which follow its R row
// streams by themselves; software prefetches of it only took line-fill buffers from the loads that
// needed them. One row, 2 threads, weights beyond the L3 (Xeon family 6 model 207): Q4_K
// [1536 x 8960] 14.5 -> 20.5 GB/s, Q6_K [4096 x 14336] 18.1 -> 23.3, Q6_K LM head [151936 x 1536]
// 17.9 -> 18.3 (into L1 before, for every tile size).
constexpr int64_t kPrefetchTileBytes = 48 * 1024;

// The tile layout is one stream per thread (a tile's blocks, then the next tile's): each block's
// lines are prefetched (into L2) this many bytes ahead. The hardware's stream prefetchers stop at
// each 4 KB page; the file layout's R row streams keep R pages going at once, one stream does not.
// One row, 2 threads, weights beyond the L3 (Xeon family 6 model 207), file layout -> tiled with
// this: Q4_K [8960 x 1536] 19.9 -> 23.8 GB/s, Q6_K LM head [151936 x 1536] 20.8 -> 24.4, Q4_K
// [1536 x 8960] 23.7 -> 23.6, Q6_K [1536 x 8960] 23.2 -> 23.7 (tiled, the prefetches aimed 1 GB away,
// i.e. none that help: 13.3, 19.5, 17.6, 13.3; 2 KB ahead: within 3% of 4 KB; 4 KB into L1: 6-12% slower).
constexpr int64_t kTiledAhead = 4096;

// Decode blocks [b0, b1) of the R rows at w (stride row_bytes) into the sink (units from 0), and
// prefetch the `ahead_rows` rows at `ahead` (the next tile's) in step, the same share of them per
// block, when they are at most kPrefetchTileBytes.
// TILED: w is the tile's blocks in the tile layout (row_bytes: a row's share, tiled_block_bytes per block).
template <int KIND, bool TILED, class Sink>
INLINE void decode(const Kind& kd, const uint8_t* w, int64_t row_bytes, int64_t b0, int64_t b1, Sink& sink,
                   const uint8_t* ahead, int64_t ahead_rows) {
  constexpr int NU = 256 / unit_of<KIND>();  // units per 256-value block
  const int64_t BB = TILED ? tiled_block_bytes(KIND) : grid_kind(KIND) ? kd.block_bytes : block_bytes<KIND>();
  const int64_t ahead_bytes = ahead_rows * row_bytes <= kPrefetchTileBytes ? ahead_rows * row_bytes : 0;
  const int64_t nb = row_bytes / BB, lines = ahead_bytes / 64, per_block = (lines + nb - 1) / nb;
  for (int64_t b = b0; b < b1; ++b) {
    if constexpr (TILED) {  // one stream: the bytes kTiledAhead past this block's (a prefetch never faults)
      const uint8_t* next = w + b * BB * R + kTiledAhead;
      for (int64_t l = 0; l < BB * R / 64; ++l) _mm_prefetch(reinterpret_cast<const char*>(next + 64 * l), _MM_HINT_T1);
    } else if (lines)
      for (int64_t l = b * per_block; l < std::min(lines, (b + 1) * per_block); ++l)
        _mm_prefetch(reinterpret_cast<const char*>(ahead + 64 * l), _MM_HINT_T1);
    const uint8_t* p = w + b * BB * (TILED ? R : 1);
    if constexpr (TILED) static_assert(KIND == 12 || KIND == 13 || KIND == 14, "the tile layout: Q4_K, Q5_K, Q6_K");
    if constexpr (KIND == 14) decode_q6k<TILED>(p, row_bytes, sink, (b - b0) * 16);
    else if constexpr (KIND == 10 || KIND == 11) decode_q23k<KIND>(p, row_bytes, sink, (b - b0) * 16);
    else if constexpr (KIND == 12 || KIND == 13) decode_k45<KIND, TILED>(p, row_bytes, sink, (b - b0) * 8);
    else if constexpr (KIND == 23) decode_iq4xs(p, row_bytes, sink, (b - b0) * 8);
    else if constexpr (grid_kind(KIND)) decode_grid_kind<unit_of<KIND>()>(kd.id, p, row_bytes, sink, (b - b0) * NU);
    else decode32<KIND>(p, row_bytes, sink, b - b0);
  }
}

// One unit's integer sums for MR activation rows: isum[i] = init[i] + sum over its G groups of
// code(g) . a[g * MR + i] (4 byte products each). VNNI: one vpdpbusd per group and row, in C
// independent chains (two for 4 to 7 rows, else one). AVX2: maddubs gives int16 pair sums, L of them are added in
// int16 (exact: L is the most that cannot overflow for the kind's largest code) before one madd
// widens them to int32. SIGN (signed bytes on AVX2): code(g) = |w|, raw(g) = w.
template <int MR, int G, int L, bool SIGN, bool INIT, class Code, class Raw>
INLINE void unit_sums(I* isum, const int32_t* a, const int32_t* init, Code code, Raw raw) {
  if constexpr (V::kInt16) {
    I s16[MR];
    for (int i = 0; i < MR; ++i) isum[i] = INIT ? V::set1(init[i]) : V::set1(0);
    for (int g = 0; g < G; ++g) {
      const I w = code(g);
      const I r = SIGN ? raw(g) : w;
      for (int i = 0; i < MR; ++i) {
        const I t = SIGN ? V::madd16_sign(w, r, a[g * MR + i]) : V::madd16(w, a[g * MR + i]);
        s16[i] = g % L == 0 ? t : V::add16(s16[i], t);
      }
      if (g % L == L - 1 || g == G - 1)
        for (int i = 0; i < MR; ++i) isum[i] = V::widen(isum[i], s16[i]);
    }
  } else {
    constexpr int C = MR >= 4 && MR < 8 ? 2 : 1;  // one row: one chain (the out-of-order core overlaps units)
    I part[MR][C];
    for (int i = 0; i < MR; ++i) {
      part[i][0] = INIT ? V::set1(init[i]) : V::set1(0);
      for (int c = 1; c < C; ++c) part[i][c] = V::set1(0);
    }
    for (int g = 0; g < G; ++g) {
      const I w = code(g);
      for (int i = 0; i < MR; ++i) part[i][g % C] = V::dp(part[i][g % C], w, a + g * MR + i);
    }
    for (int i = 0; i < MR; ++i) {
      isum[i] = part[i][0];
      if constexpr (C >= 2) isum[i] = V::addi(isum[i], part[i][1]);
      if constexpr (C == 4) isum[i] = V::addi(isum[i], V::addi(part[i][2], part[i][3]));
    }
  }
}

// One unit's float step for MR activation rows (lanes across weight rows), the numerics' rule:
// acc[i] + (A * d[i]) * float(isum[i]) [+ (B * d[i]) * float(s[i])], each product rounded alone.
template <int MR, bool MIN>
INLINE void float_step(F* acc, F a, F b, const float* d, const float* s, const I* isum) {
  for (int i = 0; i < MR; ++i) {
    const F di = V::set1f(d[i]);
    F c = V::mul(V::mul(a, di), V::cvt(isum[i]));
    if constexpr (MIN) c = V::add(c, V::mul(V::mul(b, di), V::set1f(s[i])));
    acc[i] = V::add(acc[i], c);
  }
}

// The fused sink, for a few activation rows (one panel of MR <= kFusedRows): each unit's integer
// sums are taken as its codes come (from registers) and its float step follows at once (`unit`),
// or, for a unit whose earlier units are still to come (Q6_K's high nibbles, `later`), its sums
// wait for `settle`: every output adds its units' terms in ascending order, as the buffered path.
template <int MR, int U, int L, bool MIN, bool INIT, bool SIGN>
struct Fused {
  static constexpr int G = U / 4, UB = U == 16 ? 16 : 8;  // units per block, at most
  static constexpr int W = 4;  // units whose sums may wait at once
  const Panel& p;
  F acc[MR];
  F A[UB], B[UB];
  I waiting[W][MR];
  INLINE explicit Fused(const Panel& panel) : p(panel) {
    for (int i = 0; i < MR; ++i) acc[i] = V::zerof();
  }
  INLINE void scale(int64_t u, F a) { A[u % UB] = a; }
  INLINE void min(int64_t u, F b) { B[u % UB] = b; }
  INLINE void step(int64_t u, const I* isum) {
    float_step<MR, MIN>(acc, A[u % UB], B[u % UB], p.d + u * MR, MIN ? p.sf + u * MR : nullptr, isum);
  }
  template <class Code, class Raw>
  INLINE void sums(int64_t u, I* isum, Code code, Raw raw) {
    unit_sums<MR, G, L, SIGN, INIT>(isum, p.q + u * G * MR, INIT ? p.init + u * MR : nullptr, code, raw);
  }
  INLINE void unit(int64_t u, const I* v) {
    I isum[MR];
    sums(u, isum, [&](int g) { return v[g]; }, [&](int g) { return v[g]; });
    step(u, isum);
  }
  INLINE void unit_sign(int64_t u, const I* abs, const I* w) {
    I isum[MR];
    sums(u, isum, [&](int g) { return abs[g]; }, [&](int g) { return w[g]; });
    step(u, isum);
  }
  INLINE void later(int64_t u, const I* v) {
    sums(u, waiting[u % W], [&](int g) { return v[g]; }, [&](int g) { return v[g]; });
  }
  INLINE void settle(int64_t u) { step(u, waiting[u % W]); }
};

// The MR rows of panel p over the units [0, units) of a decoded chunk starting at unit gu0:
// yt[m][R] += the units' terms, in ascending order.
template <int MR, int U, int L, bool MIN, bool INIT, bool SIGN>
INLINE void micro(const Panel& p, const Tile& t, int64_t units, int64_t gu0, float* yt) {
  constexpr int G = U / 4;  // groups of 4 values per unit
  F acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = V::loadf(yt + (p.m0 + i) * R);
  const int32_t* qa = p.q + gu0 * G * MR;
  const float* da = p.d + gu0 * MR;
  const int32_t* init = INIT ? p.init + gu0 * MR : nullptr;
  const float* sf = MIN ? p.sf + gu0 * MR : nullptr;
  for (int64_t u = 0; u < units; ++u) {
    I isum[MR];
    const uint8_t* codes = t.codes + u * G * R * 4;
    const uint8_t* raw = t.raw + u * G * R * 4;
    unit_sums<MR, G, L, SIGN, INIT>(isum, qa + u * G * MR, INIT ? init + u * MR : nullptr,
                                    [&](int g) { return V::load(codes + g * R * 4); },
                                    [&](int g) { return V::load(raw + g * R * 4); });
    const F sb = MIN ? V::loadf(t.B + u * R) : V::zerof();
    float_step<MR, MIN>(acc, V::loadf(t.A + u * R), sb, da + u * MR, MIN ? sf + u * MR : nullptr, isum);
  }
  for (int i = 0; i < MR; ++i) V::storef(yt + (p.m0 + i) * R, acc[i]);
}

template <int U, int L, bool MIN, bool INIT, bool SIGN>
void rows_pass(const Problem& pb, const Tile& t, int64_t units, int64_t gu0, float* yt) {
  for (int64_t k = 0; k < pb.num_panels; ++k) {
    const Panel& p = pb.panels[k];
    if (p.rows == V::MR) micro<V::MR, U, L, MIN, INIT, SIGN>(p, t, units, gu0, yt);
    else if (p.rows == 4) micro<4, U, L, MIN, INIT, SIGN>(p, t, units, gu0, yt);
    else if (p.rows == 2) micro<2, U, L, MIN, INIT, SIGN>(p, t, units, gu0, yt);
    else micro<1, U, L, MIN, INIT, SIGN>(p, t, units, gu0, yt);
  }
}

template <int KIND>
struct Traits {
  static constexpr bool MIN = KIND == 3 || KIND == 7 || KIND == 10 || KIND == 12 || KIND == 13;
  static constexpr int U = unit_of<KIND>();
  static constexpr int BV = KIND >= 10 && KIND != 20 ? 256 : 32;  // values per block
  static constexpr bool SIGN = signed_kind(KIND) && V::kSignTrick;
  static constexpr bool INIT = KIND == 2 || KIND == 6 || KIND == 11 || KIND == 14 || (signed_kind(KIND) && !SIGN);
  // AVX2: int16 pair sums (2 products each, |activation| <= 127) added before widening, at most
  // 32767 / (2 * 127 * largest code): codes to 15 -> 8, to 31 -> 4, to 63 -> 2, signed bytes
  // (|w| to 128) -> 1.
  static constexpr int L = signed_kind(KIND) ? 1 : KIND == 14 ? 2 : (KIND == 6 || KIND == 7 || KIND == 13) ? 4 : 8;
};

// Tile `tile`'s R weight rows: their bytes (a zero-padded copy for the last, partial tile: zero
// scales give zero terms), the rows that exist, and the next tile's bytes to prefetch.
struct Rows {
  const uint8_t* w;
  int64_t valid;
  const uint8_t* ahead;
  int64_t ahead_rows;
};

INLINE Rows tile_rows(const Problem& pb, int64_t tile, std::vector<uint8_t>& pad) {
  const int64_t n0 = tile * R, rb = pb.row_bytes;
  Rows rows{pb.w + n0 * rb, std::min<int64_t>(R, pb.N - n0), pb.w, 0};
  if (rows.valid < R && !pb.tiled) {  // (the tile layout has whole tiles, zero rows after the last)
    pad.assign(R * rb, 0);
    std::memcpy(pad.data(), rows.w, rows.valid * rb);
    rows.w = pad.data();
  }
  if (n0 + R < pb.N) {
    rows.ahead = pb.w + (n0 + R) * rb;
    rows.ahead_rows = std::min<int64_t>(R, pb.N - n0 - R);
  }
  return rows;
}

// A tile's outputs yt [M][R] into y (rows n0 .. n0 + valid - 1): with two levels, each row's
// level 1 + level 2 (one fp32 add, lanes across the tile's rows).
INLINE void store_tile(const Problem& pb, const float* yt, int64_t tile, int64_t valid) {
  const int64_t rows = pb.M / pb.levels;
  for (int64_t m = 0; m < rows; ++m) {
    float* out = pb.y + m * pb.N + tile * R;
    const F y = pb.levels == 1 ? V::loadf(yt + m * R) : V::add(V::loadf(yt + m * R), V::loadf(yt + (rows + m) * R));
    if (valid == R) {  // a whole tile: one vector store (not a library call per 64 bytes)
      V::storef(out, y);
      continue;
    }
    alignas(64) float part[R];
    V::storef(part, y);
    std::memcpy(out, part, valid * sizeof(float));
  }
}

// Many activation rows: each tile's chunk of K decoded once into L1, then every panel over it.
template <int KIND, bool TILED>
void tiles_buffered(const Problem& pb, int64_t t0, int64_t t1) {
  using T = Traits<KIND>;
  const int64_t M = pb.M, nb = pb.K / T::BV;
  const int64_t bpc = kChunk / T::BV;  // blocks per chunk
  std::vector<uint8_t> codes(kChunk * R), raw(T::SIGN ? kChunk * R : 0), pad;
  std::vector<float> A(kChunk / T::U * R), B(T::MIN ? kChunk / T::U * R : 0), yt(M * R);
  Tile t{codes.data(), raw.data(), A.data(), B.data(), T::U / 4};
  for (int64_t tile = t0; tile < t1; ++tile) {
    const Rows rows = tile_rows(pb, tile, pad);
    std::fill(yt.begin(), yt.end(), 0.0f);
    for (int64_t b0 = 0; b0 < nb; b0 += bpc) {
      const int64_t b1 = std::min(b0 + bpc, nb);
      decode<KIND, TILED>(pb.kind, rows.w, pb.row_bytes, b0, b1, t, rows.ahead, rows.ahead_rows);
      rows_pass<T::U, T::L, T::MIN, T::INIT, T::SIGN>(pb, t, (b1 - b0) * T::BV / T::U, b0 * T::BV / T::U, yt.data());
    }
    store_tile(pb, yt.data(), tile, rows.valid);
  }
}

// A few activation rows (one panel of MR): each block's codes go from registers into the sums.
template <int KIND, bool TILED, int MR>
void tiles_fused(const Problem& pb, int64_t t0, int64_t t1) {
  using T = Traits<KIND>;
  std::vector<uint8_t> pad;
  for (int64_t tile = t0; tile < t1; ++tile) {
    const Rows rows = tile_rows(pb, tile, pad);
    Fused<MR, T::U, T::L, T::MIN, T::INIT, T::SIGN> sink(pb.panels[0]);
    decode<KIND, TILED>(pb.kind, rows.w, pb.row_bytes, 0, pb.K / T::BV, sink, rows.ahead, rows.ahead_rows);
    alignas(64) float yt[MR * R];
    for (int i = 0; i < MR; ++i) V::storef(yt + i * R, sink.acc[i]);
    store_tile(pb, yt, tile, rows.valid);
  }
}

template <int KIND, bool TILED = false>
void tiles_of(const Problem& pb, int64_t t0, int64_t t1) {
  if (pb.num_panels == 1 && pb.panels[0].rows <= kFusedRows) {
    switch (pb.panels[0].rows) {
      case 1: return tiles_fused<KIND, TILED, 1>(pb, t0, t1);
      case 2: return tiles_fused<KIND, TILED, 2>(pb, t0, t1);
      case 3: return tiles_fused<KIND, TILED, 3>(pb, t0, t1);
      case 4: return tiles_fused<KIND, TILED, 4>(pb, t0, t1);
      case 5: return tiles_fused<KIND, TILED, 5>(pb, t0, t1);
      case 6: return tiles_fused<KIND, TILED, 6>(pb, t0, t1);
      case 7: return tiles_fused<KIND, TILED, 7>(pb, t0, t1);
      default: return tiles_fused<KIND, TILED, 8>(pb, t0, t1);
    }
  }
  tiles_buffered<KIND, TILED>(pb, t0, t1);
}

void qdot_tiles(const Problem& pb, int64_t t0, int64_t t1) {
  if (pb.tiled) {
    switch (pb.kind.id) {
      case 12: return tiles_of<12, true>(pb, t0, t1);
      case 13: return tiles_of<13, true>(pb, t0, t1);
      case 14: return tiles_of<14, true>(pb, t0, t1);
    }
  }
  switch (pb.kind.id) {
    case 2: tiles_of<2>(pb, t0, t1); break;
    case 3: tiles_of<3>(pb, t0, t1); break;
    case 6: tiles_of<6>(pb, t0, t1); break;
    case 7: tiles_of<7>(pb, t0, t1); break;
    case 8: tiles_of<8>(pb, t0, t1); break;
    case 12: tiles_of<12>(pb, t0, t1); break;
    case 13: tiles_of<13>(pb, t0, t1); break;
    case 14: tiles_of<14>(pb, t0, t1); break;
    case 10: tiles_of<10>(pb, t0, t1); break;
    case 11: tiles_of<11>(pb, t0, t1); break;
    case 20: tiles_of<20>(pb, t0, t1); break;
    case 23: tiles_of<23>(pb, t0, t1); break;
    case 17: case 22: case 29: tiles_of<kGrid16>(pb, t0, t1); break;  // IQ2_XS, IQ2_S, IQ1_M
    case 16: case 18: case 19: case 21: case 34: case 35: tiles_of<kGrid32>(pb, t0, t1); break;
  }
}

// One activation row: per block of 32, d = max|x| / 127 and q = round(x / d), sums per 16.
void quantize_row(const float* x, int64_t K, int8_t* q, float* d, int32_t* sums) {
  constexpr int P = V::kPerBlock;  // vectors per block of 32
  for (int64_t b = 0; b < K / 32; ++b) {
    F xs[P];
    F amax = V::zerof();
    for (int j = 0; j < P; ++j) {
      xs[j] = V::loadf(x + b * 32 + j * R);
      amax = V::maxf(amax, V::absf(xs[j]));
    }
    d[b] = act_scale(V::hmax(amax));
    const F inv = V::set1f(act_inverse(d[b]));
    I v[P];
    for (int j = 0; j < P; ++j) {
      v[j] = V::round_clamp(V::mul(xs[j], inv));
      V::store_i8(q + b * 32 + j * R, v[j]);
    }
    V::sums16(v, sums + 2 * b);
  }
}

#endif  // DEEPINFER_QDOT_BODY
