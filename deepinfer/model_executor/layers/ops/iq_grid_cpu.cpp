// The grid i-quants (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) and the ternary types
// (TQ1_0, TQ2_0): one 256-value block -> its values as signed bytes and its unit scales, as
// iq_blocks.py states them (value * scale is gguf's float bit for bit). qdot_cpu.cpp's kernels take
// a tile's blocks through here, row by row, then run them as signed bytes (as Q8_0's).
//
// The grids are the gguf package's tables, handed over once by qdot.py (`iq_tables`, the bytes of
// iq_blocks.grid_tables()); a call on a grid kind before that is refused. Signs are applied eight
// bytes at a time: a grid byte g (never 0) becomes -g as (g ^ 0xFF) + 1, which carries into no
// other byte.

#include <ATen/ATen.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>

namespace deepinfer_iq {
namespace {

#define INLINE inline __attribute__((always_inline))

// Rows of each grid (8 values, IQ3: 4) in iq_blocks.GRID_KINDS order, then ksigns' 128 bytes.
constexpr int64_t kRows[6] = {256, 512, 1024, 256, 512, 2048};
constexpr int64_t kWidth[6] = {8, 8, 8, 4, 4, 8};
constexpr int64_t kTableBytes = 256 * 8 + 512 * 8 + 1024 * 8 + 256 * 4 + 512 * 4 + 2048 * 8 + 128;

struct Tables {
  std::vector<int8_t> bytes;
  const int8_t* grid[6];
  uint64_t ksign[128];  // 7 sign bits -> 0xFF in each byte to negate (the 8th: parity)
  uint64_t sign[256];   // a sign byte -> the same
  int8_t iq1[2048 * 8];  // 8 * IQ1's grid values
};

Tables g_tables;
std::atomic<bool> g_ready{false};
std::mutex g_mutex;

uint64_t byte_mask(uint32_t bits) {
  uint64_t m = 0;
  for (int j = 0; j < 8; ++j)
    if (bits >> j & 1) m |= uint64_t{0xFF} << (8 * j);
  return m;
}

void set_tables(const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kByte && t.dim() == 1 && t.numel() == kTableBytes,
              "iq_tables: expected uint8 [", kTableBytes, "] (iq_blocks.grid_tables()), got ", t.scalar_type(), " ",
              t.sizes());
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_ready.load()) return;
  const at::Tensor c = t.contiguous();
  g_tables.bytes.assign(reinterpret_cast<const int8_t*>(c.data_ptr<uint8_t>()),
                        reinterpret_cast<const int8_t*>(c.data_ptr<uint8_t>()) + kTableBytes);
  int64_t at = 0;
  for (int i = 0; i < 6; ++i) {
    g_tables.grid[i] = g_tables.bytes.data() + at;
    at += kRows[i] * kWidth[i];
  }
  for (int s = 0; s < 128; ++s) g_tables.ksign[s] = byte_mask(static_cast<uint8_t>(g_tables.bytes[at + s]));
  for (int s = 0; s < 256; ++s) g_tables.sign[s] = byte_mask(s);
  for (int64_t j = 0; j < 2048 * 8; ++j) g_tables.iq1[j] = static_cast<int8_t>(8 * g_tables.grid[5][j]);
  g_ready.store(true);
}

INLINE float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

INLINE uint32_t u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

INLINE uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// 8 grid bytes (IQ3: two rows of 4) with the bytes of `neg` negated, stored at v.
INLINE void put8(int8_t* v, uint64_t g, uint64_t neg) {
  const uint64_t x = (g ^ neg) + (neg & 0x0101010101010101ULL);
  std::memcpy(v, &x, 8);
}

INLINE uint64_t row8(const int8_t* grid, uint32_t i) {
  uint64_t g;
  std::memcpy(&g, grid + 8 * i, 8);
  return g;
}

INLINE uint64_t rows4(const int8_t* grid, uint32_t i, uint32_t j) {
  uint32_t a, b;
  std::memcpy(&a, grid + 4 * i, 4);
  std::memcpy(&b, grid + 4 * j, 4);
  return a | (uint64_t{b} << 32);
}

// IQ2: d (0.5 + ls) / 4; IQ3_XXS: / 2 (gguf's order of fp32 operations).
INLINE float half_step(float d, uint32_t ls, float quarter) { return d * (0.5f + static_cast<float>(ls)) * quarter; }

void iq2_xxs(const uint8_t* p, int8_t* v, float* A) {
  const float d = f16(p);
  for (int ib = 0; ib < 8; ++ib) {
    const uint32_t idx = u32(p + 2 + 8 * ib), aux = u32(p + 6 + 8 * ib);
    A[ib] = half_step(d, aux >> 28, 0.25f);
    for (int l = 0; l < 4; ++l)
      put8(v + 32 * ib + 8 * l, row8(g_tables.grid[0], idx >> (8 * l) & 0xFF), g_tables.ksign[aux >> (7 * l) & 127]);
  }
}

void iq2_xs(const uint8_t* p, int8_t* v, float* A) {
  const float d = f16(p);
  for (int g = 0; g < 32; ++g) {
    const uint32_t q = u16(p + 2 + 2 * g);
    put8(v + 8 * g, row8(g_tables.grid[1], q & 511), g_tables.ksign[q >> 9]);
  }
  for (int j = 0; j < 16; ++j) A[j] = half_step(d, p[66 + j / 2] >> (4 * (j % 2)) & 0xF, 0.25f);
}

void iq2_s(const uint8_t* p, int8_t* v, float* A) {
  const float d = f16(p);
  for (int g = 0; g < 32; ++g) {
    const uint32_t i = p[2 + g] | (p[66 + g / 4] >> (2 * (g % 4)) & 3) << 8;
    put8(v + 8 * g, row8(g_tables.grid[2], i), g_tables.sign[p[34 + g]]);
  }
  for (int j = 0; j < 16; ++j) A[j] = half_step(d, p[74 + j / 2] >> (4 * (j % 2)) & 0xF, 0.25f);
}

void iq3_xxs(const uint8_t* p, int8_t* v, float* A) {
  const float d = f16(p);
  for (int ib = 0; ib < 8; ++ib) {
    const uint32_t aux = u32(p + 66 + 4 * ib);
    A[ib] = half_step(d, aux >> 28, 0.5f);
    const uint8_t* q = p + 2 + 8 * ib;
    for (int l = 0; l < 4; ++l)
      put8(v + 32 * ib + 8 * l, rows4(g_tables.grid[3], q[2 * l], q[2 * l + 1]), g_tables.ksign[aux >> (7 * l) & 127]);
  }
}

void iq3_s(const uint8_t* p, int8_t* v, float* A) {
  const float d = f16(p);
  for (int g = 0; g < 32; ++g) {  // 8 values: grid rows 2g and 2g + 1, sign byte g
    const uint32_t i = p[2 + 2 * g] | (p[66 + g / 4] >> (2 * (g % 4)) & 1) << 8;
    const uint32_t j = p[3 + 2 * g] | (p[66 + g / 4] >> (2 * (g % 4) + 1) & 1) << 8;
    put8(v + 8 * g, rows4(g_tables.grid[4], i, j), g_tables.sign[p[74 + g]]);
  }
  for (int ib = 0; ib < 8; ++ib) A[ib] = d * static_cast<float>(1 + 2 * (p[106 + ib / 2] >> (4 * (ib % 2)) & 0xF));
}

// IQ1: 8 grid values +- 1 (the delta's sign) for the groups of 8 at grid rows idx[0..n).
INLINE void iq1_group(int8_t* v, uint32_t i, int delta) {
  const int8_t* g = g_tables.iq1 + 8 * i;
  for (int j = 0; j < 8; ++j) v[j] = static_cast<int8_t>(g[j] + delta);
}

void iq1_s(const uint8_t* p, int8_t* v, float* A) {
  const float d = f16(p);
  for (int ib = 0; ib < 8; ++ib) {
    const uint32_t qh = u16(p + 34 + 2 * ib);
    A[ib] = d * static_cast<float>(2 * (qh >> 12 & 7) + 1) * 0.125f;
    for (int l = 0; l < 4; ++l)
      iq1_group(v + 32 * ib + 8 * l, p[2 + 4 * ib + l] | (qh >> (3 * l) & 7) << 8, qh & 0x8000 ? -1 : 1);
  }
}

void iq1_m(const uint8_t* p, int8_t* v, float* A) {
  uint32_t sc[4];
  for (int i = 0; i < 4; ++i) sc[i] = u16(p + 48 + 2 * i);
  const uint16_t bits = static_cast<uint16_t>((sc[0] >> 12) | (sc[1] >> 8 & 0xF0) | (sc[2] >> 4 & 0xF00) |
                                              (sc[3] & 0xF000));
  const float d = static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
  for (int j = 0; j < 16; ++j) A[j] = d * static_cast<float>(2 * (sc[j / 4] >> (3 * (j % 4)) & 7) + 1) * 0.125f;
  for (int g = 0; g < 32; ++g) {
    const uint32_t h = p[32 + g / 2] >> (4 * (g % 2)) & 0xF;
    iq1_group(v + 8 * g, p[g] | (h & 7) << 8, h & 8 ? -1 : 1);
  }
}

// TQ1_0: 5 base-3 digits per byte (4 in the last 4 bytes), digit n of byte b is value n * len + b.
void tq1_0(const uint8_t* p, int8_t* v, float* A) {
  constexpr uint8_t pow3[5] = {1, 3, 9, 27, 81};
  auto digits = [&](const uint8_t* q, int len, int count, int8_t* out) {
    for (int n = 0; n < count; ++n)
      for (int b = 0; b < len; ++b)
        out[n * len + b] = static_cast<int8_t>((static_cast<uint8_t>(q[b] * pow3[n]) * 3 >> 8) - 1);
  };
  digits(p, 32, 5, v);
  digits(p + 32, 16, 5, v + 160);
  digits(p + 48, 4, 4, v + 240);
  const float d = f16(p + 52);
  for (int j = 0; j < 8; ++j) A[j] = d;
}

void tq2_0(const uint8_t* p, int8_t* v, float* A) {
  for (int i = 0; i < 256; ++i)
    v[i] = static_cast<int8_t>((p[32 * (i / 128) + i % 32] >> (2 * (i % 128 / 32)) & 3) - 1);
  const float d = f16(p + 64);
  for (int j = 0; j < 8; ++j) A[j] = d;
}

}  // namespace

bool tables_ready() { return g_ready.load(std::memory_order_acquire); }

// Grid i of iq_blocks.GRID_KINDS (rows of 8 or 4 int8 values), and IQ1's grid times 8 (the SIMD
// decoders of qdot_cpu.cpp gather their rows; valid once tables_ready()).
const int8_t* grid_table(int i) { return g_tables.grid[i]; }
const int8_t* iq1_table() { return g_tables.iq1; }

// Block `p` of kind `id` -> v [256] signed values, A [units] scales.
void decode_block(int64_t id, const uint8_t* p, int8_t* v, float* A) {
  switch (id) {
    case 16: return iq2_xxs(p, v, A);
    case 17: return iq2_xs(p, v, A);
    case 22: return iq2_s(p, v, A);
    case 18: return iq3_xxs(p, v, A);
    case 21: return iq3_s(p, v, A);
    case 19: return iq1_s(p, v, A);
    case 29: return iq1_m(p, v, A);
    case 34: return tq1_0(p, v, A);
    case 35: return tq2_0(p, v, A);
  }
}

}  // namespace deepinfer_iq

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("iq_tables(Tensor tables) -> ()", deepinfer_iq::set_tables);
  m.def("iq_tables_ready() -> bool", deepinfer_iq::tables_ready);
}
