// The small ops of a CPU decode step, one call each instead of five to ten torch ops:
//
//   rms_norm      x [T, E] fp32 -> x / rms(x) * (offset + w)                      one row per task
//   silu_mul      x [T, 2I] = [gate | up] -> silu(gate) * up [T, I]
//   gelu_tanh_mul x [T, 2I] = [gate | up] -> gelu_tanh(gate) * up [T, I]
//   rope          q [T, H, D], k [T, H_kv, D] fp32 -> rotated copies (rotate-half layout),
//                 cos/sin read from [P, D] tables at `positions` [T]
//   store_rows    k, v [T, H_kv, D] -> K|V rows of a layer's cache at flat slots [T]; uint8 rows are
//                 q8 rows (per 32 values an fp32 scale and 32 int8 values: `quantize_q8`)
//   q8_round      x [..., D] -> the values a q8 row keeps of it (quantized and read back), fp32
//   decode_attn   q [N, H, D] over the rows each query's index row [N, L] names (-1: none);
//                 optional logit soft-cap (s = cap * tanh(s / cap)) and per-head sink logits [H]
//                 (in the softmax denominator, no value)
//
// Cache rows: `rows` [lines, (1 or 2) * H_kv * D] fp32 or bf16, one line per (unit, layer, row):
// flat slot u * R + r of the layer at `offset` is line u * LPU + offset + r (LPU = lines per unit).
// A shared K = V row (parts = 1) serves as both K and V.
//
// Every output element is computed by one thread with a fixed order of operations that depends
// on its own row alone (the row count and thread count never change a result). The same loops
// are compiled for AVX-512 and AVX2 + FMA: generic bodies are inlined into wrappers with
// function-level target attributes (the compiler vectorizes them for that set), and `isa`
// (2 or 1, what `cpu_isa()` below reports) picks one per call.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

// The kernels' thread pool (work_pool.cpp): fn(begin, end) over [0, n) in chunks of at most grain items.
namespace deepinfer_pool {
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);
}

namespace {

#define INLINE inline __attribute__((always_inline))
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
#define AVX2_TARGET __attribute__((target("avx2,fma")))

INLINE float as_float(float v) { return v; }
INLINE float as_float(c10::BFloat16 v) { return static_cast<float>(v); }

template <class T>
INLINE T from_float(float v) { return static_cast<T>(v); }

template <class T>
INLINE float dot(const float* a, const T* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * as_float(b[i]);
  return s;
}

template <class T>
INLINE void axpy(float* y, float a, const T* x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * as_float(x[i]);
}

INLINE int64_t line_of(int64_t slot, int64_t R, int64_t lpu, int64_t offset) {
  return slot + slot / R * (lpu - R) + offset;
}

// ---- generic bodies -----------------------------------------------------------------------

INLINE void rms_norm_row(const float* x, const float* w, float eps, float offset, int64_t E, float* y) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < E; ++i) ss += x[i] * x[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(E) + eps);
#pragma omp simd
  for (int64_t i = 0; i < E; ++i) y[i] = x[i] * inv * (offset + w[i]);
}

// One head: out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1).
INLINE void rope_head(const float* x, const float* c, const float* s, int64_t D, float* y) {
  const int64_t h = D / 2;
#pragma omp simd
  for (int64_t i = 0; i < h; ++i) {
    y[i] = x[i] * c[i] - x[i + h] * s[i];
    y[i + h] = x[i + h] * c[i + h] + x[i] * s[i + h];
  }
}

// e^x for x <= 0 (an exact 0 below -87), within 2 ulp: 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2,
// p Cephes' degree-6 polynomial. Branch-free arithmetic, so a loop over it vectorizes (the
// library is built with -fno-trapping-math, which lets selects be computed on both sides): n is
// rounded by adding 1.5 * 2^23, which leaves it in the low mantissa bits, and 2^n is built from
// those bits.
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

// silu(g) * u over one row: silu(g) = g * sigmoid(g), sigmoid from e^-|g| (never overflows).
INLINE void silu_mul_row(const float* gate, const float* up, int64_t I, float* y) {
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) {
    const float e = exp_nonpositive(-std::fabs(gate[i]));
    const float d = 1.f / (1.f + e);
    const float sigmoid = gate[i] >= 0.f ? d : e * d;
    y[i] = gate[i] * sigmoid * up[i];
  }
}

// gelu_tanh(g) * u over one row: 0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3),
// tanh(y) = sign(y) (1 - e) / (1 + e), e = e^(-2|y|) (never overflows).
INLINE void gelu_tanh_mul_row(const float* gate, const float* up, int64_t I, float* y) {
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) {
    const float g = gate[i];
    const float inner = (g + 0.044715f * g * g * g) * 0.7978845608028654f;
    const float e = exp_nonpositive(-2.f * std::fabs(inner));
    const float t = (1.f - e) / (1.f + e);
    const float th = inner < 0.f ? -t : t;
    y[i] = 0.5f * g * (1.f + th) * up[i];
  }
}

// One query's KV-head group: the `G` heads at q (stride qs) over the rows idx[0 .. L-1] names
// (-1 entries skipped). keys [L] and scores [G, L] are scratch; out [G, D] (stride os).
// softcap > 0: logits capped as softcap * tanh(s / softcap); sinks (nullptr: none) [G]: the heads'
// sink logits, in the max and the denominator, adding no value.
template <int DC, class T>
INLINE void attend(const float* q, int64_t qs, const T* rows, int64_t ld, int64_t k_off, int64_t v_off,
                   const int64_t* idx, int64_t L, int64_t R, int64_t lpu, int64_t offset, int64_t G,
                   int64_t head_dim, float scale, float softcap, const float* sinks, const T** keys, float* scores,
                   float* out, int64_t os) {
  const int64_t D = DC ? DC : head_dim;  // a compile-time head size unrolls the loops over it
  int64_t n = 0;
  for (int64_t l = 0; l < L; ++l)
    if (idx[l] >= 0) keys[n++] = rows + line_of(idx[l], R, lpu, offset) * ld;
  for (int64_t h = 0; h < G; ++h)
    for (int64_t d = 0; d < D; ++d) out[h * os + d] = 0.f;
  if (n == 0) return;  // a query that sees nothing gets zeros
  for (int64_t j = 0; j < n; ++j)
    for (int64_t h = 0; h < G; ++h) scores[h * n + j] = dot(q + h * qs, keys[j] + k_off, D) * scale;
  if (softcap > 0.f)
    for (int64_t i = 0; i < G * n; ++i) scores[i] = softcap * std::tanh(scores[i] / softcap);
  for (int64_t h = 0; h < G; ++h) {
    float* s = scores + h * n;
    float m = s[0], sum = 0.f;
    for (int64_t j = 1; j < n; ++j) m = std::max(m, s[j]);
    if (sinks) m = std::max(m, sinks[h]);
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      s[j] = exp_nonpositive(s[j] - m);
      sum += s[j];
    }
    if (sinks) sum += exp_nonpositive(sinks[h] - m);
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) s[j] *= inv;
  }
  for (int64_t j = 0; j < n; ++j)
    for (int64_t h = 0; h < G; ++h) axpy(out + h * os, scores[h * n + j], keys[j] + v_off, D);
}

// ---- one wrapper per instruction set ------------------------------------------------------

#define DEFINE_FOR(SUFFIX, TARGET)                                                                               \
  TARGET void rms_norm_##SUFFIX(const float* x, const float* w, float eps, float offset, int64_t E, float* y) {   \
    rms_norm_row(x, w, eps, offset, E, y);                                                                       \
  }                                                                                                              \
  TARGET void silu_mul_##SUFFIX(const float* g, const float* u, int64_t I, float* y) { silu_mul_row(g, u, I, y); } \
  TARGET void gelu_mul_##SUFFIX(const float* g, const float* u, int64_t I, float* y) {                           \
    gelu_tanh_mul_row(g, u, I, y);                                                                               \
  }                                                                                                              \
  TARGET void rope_##SUFFIX(const float* x, const float* c, const float* s, int64_t D, float* y) {               \
    rope_head(x, c, s, D, y);                                                                                    \
  }                                                                                                              \
  template <int DC, class T>                                                                                     \
  TARGET void attend_##SUFFIX(const float* q, int64_t qs, const T* rows, int64_t ld, int64_t k_off,              \
                              int64_t v_off, const int64_t* idx, int64_t L, int64_t R, int64_t lpu,              \
                              int64_t offset, int64_t G, int64_t D, float scale, float softcap,                  \
                              const float* sinks, const T** keys, float* scores, float* out, int64_t os) {       \
    attend<DC>(q, qs, rows, ld, k_off, v_off, idx, L, R, lpu, offset, G, D, scale, softcap, sinks, keys, scores,  \
               out, os);                                                                                         \
  }

DEFINE_FOR(512, AVX512_TARGET)
DEFINE_FOR(256, AVX2_TARGET)

using NormFn = void (*)(const float*, const float*, float, float, int64_t, float*);
using GatedFn = void (*)(const float*, const float*, int64_t, float*);  // [gate | up] -> act(gate) * up
using RopeFn = void (*)(const float*, const float*, const float*, int64_t, float*);
template <class T>
using AttendFn = void (*)(const float*, int64_t, const T*, int64_t, int64_t, int64_t, const int64_t*, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, float, float, const float*, const T**, float*,
                          float*, int64_t);

NormFn norm_fn(int64_t isa) { return isa >= 2 ? rms_norm_512 : rms_norm_256; }
GatedFn silu_fn(int64_t isa) { return isa >= 2 ? silu_mul_512 : silu_mul_256; }
GatedFn gelu_fn(int64_t isa) { return isa >= 2 ? gelu_mul_512 : gelu_mul_256; }
RopeFn rope_fn(int64_t isa) { return isa >= 2 ? rope_512 : rope_256; }
template <int DC, class T>
AttendFn<T> attend_for(int64_t isa) { return isa >= 2 ? attend_512<DC, T> : attend_256<DC, T>; }

// Head sizes of the supported models get unrolled code; any other runs the generic loops.
template <class T>
AttendFn<T> attend_fn(int64_t isa, int64_t D) {
  return D == 64 ? attend_for<64, T>(isa) : D == 128 ? attend_for<128, T>(isa) : D == 256 ? attend_for<256, T>(isa)
                                                                                         : attend_for<0, T>(isa);
}

// ---- ops ----------------------------------------------------------------------------------

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, double offset, int64_t isa) {
  check_f32(x, "x");
  check_f32(w, "w");
  const int64_t E = x.size(-1);
  TORCH_CHECK(w.numel() == E, "w has ", w.numel(), " elements for rows of ", E);
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t T = E ? xc.numel() / E : 0;
  const float *xp = xc.data_ptr<float>(), *wp = wc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const NormFn fn = norm_fn(isa);
  deepinfer_pool::parallel_for(T, std::max<int64_t>(1, 16384 / std::max<int64_t>(E, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) fn(xp + t * E, wp, float(eps), float(offset), E, yp + t * E);
  });
  return y;
}

// x [T, 2I] = [gate | up] (last dim contiguous) -> act(gate) * up [T, I], one row per task.
at::Tensor gated_mul(const at::Tensor& x, GatedFn fn) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0, "x must be [T, 2I] with contiguous rows");
  const int64_t T = x.size(0), I = x.size(1) / 2, ld = x.stride(0);
  at::Tensor y = at::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  deepinfer_pool::parallel_for(T, std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) fn(xp + t * ld, xp + t * ld + I, I, yp + t * I);
  });
  return y;
}

at::Tensor silu_mul(const at::Tensor& x, int64_t isa) { return gated_mul(x, silu_fn(isa)); }

// Gemma's GeGLU (tanh form): torch's gelu changes a row's bits with the thread count, this does not.
at::Tensor gelu_tanh_mul(const at::Tensor& x, int64_t isa) { return gated_mul(x, gelu_fn(isa)); }

// x [T, H, D] (last dim contiguous) -> rotated [T, H, D] contiguous.
at::Tensor rope_one(const at::Tensor& x, const int64_t* pos, const float* cos, const float* sin, int64_t P,
                    RopeFn fn) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rope input must be [T, H, D] with contiguous heads");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), st = x.stride(0), sh = x.stride(1);
  TORCH_CHECK(D % 2 == 0, "rope head_dim must be even, got ", D);
  at::Tensor y = at::empty({T, H, D}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < P, "position ", pos[t], " outside the table");
  deepinfer_pool::parallel_for(T, std::max<int64_t>(1, 4096 / std::max<int64_t>(H * D, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < H; ++h) fn(xp + t * st + h * sh, cos + pos[t] * D, sin + pos[t] * D, D, yp + (t * H + h) * D);
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> rope(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                                        const at::Tensor& cos, const at::Tensor& sin, int64_t isa) {
  check_f32(q, "q");
  check_f32(k, "k");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == q.size(0), "positions must be [T] for T rows of q");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == q.size(2) &&
                  sin.sizes() == cos.sizes(), "cos and sin must be contiguous [P, D]");
  const at::Tensor pos = positions.to(at::kLong).contiguous();
  const RopeFn fn = rope_fn(isa);
  const int64_t* pp = pos.data_ptr<int64_t>();
  return {rope_one(q, pp, cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(0), fn),
          rope_one(k, pp, cos.data_ptr<float>(), sin.data_ptr<float>(), cos.size(0), fn)};
}

void check_rows(const at::Tensor& rows, int64_t parts, int64_t Hkv, int64_t D) {
  TORCH_CHECK(rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kBFloat16,
              "cache rows must be float32 or bfloat16, got ", rows.scalar_type());
  TORCH_CHECK(rows.dim() == 2 && rows.stride(1) == 1 && rows.size(1) == parts * Hkv * D,
              "cache rows must be [lines, parts * H_kv * D] with contiguous lines");
}

// A cache line's D elements from one head of k or v (contiguous when stride 1, as the layers pass them).
template <class T>
INLINE void store_head(T* dst, const float* src, int64_t D, int64_t stride) {
  if (stride == 1) {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) dst[d] = from_float<T>(src[d]);
  } else {
    for (int64_t d = 0; d < D; ++d) dst[d] = from_float<T>(src[d * stride]);
  }
}

// Heads in parallel, each task's rows in order: a slot named twice in one call (a chunk longer than
// a ring) keeps its last row, as a sequential store would.
template <class T>
void store_typed(at::Tensor& rows, const int64_t* sp, const at::Tensor& k, const at::Tensor& v, int64_t parts,
                 int64_t R, int64_t lpu, int64_t offset) {
  const int64_t n = k.size(0), Hkv = k.size(1), D = k.size(2), ld = rows.stride(0);
  T* base = rows.data_ptr<T>();
  const at::Tensor* tensors[2] = {&k, &v};
  const int64_t grain = n * D >= 16384 ? 1 : parts * Hkv;  // a few rows (decode): one thread, no fork
  deepinfer_pool::parallel_for(parts * Hkv, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const at::Tensor& x = *tensors[c / Hkv];
      const float* src = x.data_ptr<float>() + (c % Hkv) * x.stride(1);
      for (int64_t t = 0; t < n; ++t)
        store_head(base + line_of(sp[t], R, lpu, offset) * ld + c * D, src + t * x.stride(0), D, x.stride(2));
    }
  });
}

// ---- q8 rows: per 32 values one block of an fp32 scale and 32 int8 values (invariant_cpu.cpp reads them)
constexpr int64_t kQ8Values = 32, kQ8Bytes = 4 + kQ8Values;

// 32 values (at src, stride) -> one block: scale = amax / 127, q = round-half-even(x * (127 / amax)) in
// -127 .. 127 (all 0 when amax is 0); the value read back is q * scale (one fp32 product).
INLINE void quantize_q8(uint8_t* dst, const float* src, int64_t stride) {
  float x[kQ8Values], amax = 0.f;
  for (int l = 0; l < kQ8Values; ++l) x[l] = src[l * stride], amax = std::max(amax, std::fabs(x[l]));
  const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
  int8_t q[kQ8Values];
  for (int l = 0; l < kQ8Values; ++l) q[l] = int8_t(std::min(127.f, std::max(-127.f, std::nearbyint(x[l] * inv))));
  std::memcpy(dst, &scale, sizeof scale);
  std::memcpy(dst + 4, q, kQ8Values);
}

// Heads in parallel as in store_typed; a head of D values is D / 32 blocks.
void store_q8(at::Tensor& rows, const int64_t* sp, const at::Tensor& k, const at::Tensor& v, int64_t parts, int64_t R,
              int64_t lpu, int64_t offset) {
  const int64_t n = k.size(0), Hkv = k.size(1), D = k.size(2), ld = rows.stride(0), head = D / kQ8Values * kQ8Bytes;
  uint8_t* base = rows.data_ptr<uint8_t>();
  const at::Tensor* tensors[2] = {&k, &v};
  const int64_t grain = n * D >= 16384 ? 1 : parts * Hkv;
  deepinfer_pool::parallel_for(parts * Hkv, grain, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const at::Tensor& x = *tensors[c / Hkv];
      const float* src = x.data_ptr<float>() + (c % Hkv) * x.stride(1);
      for (int64_t t = 0; t < n; ++t) {
        uint8_t* dst = base + line_of(sp[t], R, lpu, offset) * ld + c * head;
        for (int64_t b = 0; b < D / kQ8Values; ++b)
          quantize_q8(dst + b * kQ8Bytes, src + t * x.stride(0) + b * kQ8Values * x.stride(2), x.stride(2));
      }
    }
  });
}

// x [..., D] fp32 (D a multiple of 32) -> the values a q8 row stores for it, as fp32 (a prefill chunk's
// rows as a later cache read returns them).
at::Tensor q8_round(const at::Tensor& x) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % kQ8Values == 0, "q8 rows need a last dimension that is a multiple of ",
              kQ8Values, ", got ", x.sizes());
  const at::Tensor c = x.contiguous();
  at::Tensor out = at::empty_like(c);
  const int64_t blocks = c.numel() / kQ8Values;
  deepinfer_pool::parallel_for(blocks, 256, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      uint8_t block[kQ8Bytes];
      quantize_q8(block, c.data_ptr<float>() + b * kQ8Values, 1);
      float scale;
      std::memcpy(&scale, block, sizeof scale);
      float* o = out.data_ptr<float>() + b * kQ8Values;
      for (int l = 0; l < kQ8Values; ++l) o[l] = float(int8_t(block[4 + l])) * scale;
    }
  });
  return out;
}

void store_rows(at::Tensor rows, const at::Tensor& slots, const at::Tensor& k, const at::Tensor& v,
                int64_t rows_per_unit, int64_t lines_per_unit, int64_t offset) {
  check_f32(k, "k");
  check_f32(v, "v");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "k and v must both be [T, H_kv, D]");
  const bool q8 = rows.scalar_type() == at::kByte;
  TORCH_CHECK(!q8 || k.size(2) % kQ8Values == 0, "q8 cache rows need a head size that is a multiple of ", kQ8Values,
              ", got ", k.size(2));
  const int64_t head = q8 ? k.size(2) / kQ8Values * kQ8Bytes : k.size(2);  // elements of rows per head
  const int64_t parts = rows.size(1) / (k.size(1) * head);
  if (q8) {
    TORCH_CHECK(rows.dim() == 2 && rows.stride(1) == 1 && rows.size(1) == parts * k.size(1) * head &&
                    (parts == 1 || parts == 2), "q8 cache rows must be [lines, parts * H_kv * D / 32 * 36] bytes");
  } else {
    check_rows(rows, parts, k.size(1), k.size(2));
  }
  const at::Tensor s = slots.to(at::kLong).contiguous();
  TORCH_CHECK(s.numel() == k.size(0), "slots has ", s.numel(), " entries for ", k.size(0), " rows");
  const int64_t* sp = s.data_ptr<int64_t>();
  const int64_t lines = rows.size(0);
  for (int64_t t = 0; t < s.numel(); ++t) {
    TORCH_CHECK(sp[t] >= 0, "slot ", sp[t], " is negative");
    TORCH_CHECK(line_of(sp[t], rows_per_unit, lines_per_unit, offset) < lines, "slot ", sp[t], " is past the cache");
  }
  if (q8)
    store_q8(rows, sp, k, v, parts, rows_per_unit, lines_per_unit, offset);
  else if (rows.scalar_type() == at::kFloat)
    store_typed<float>(rows, sp, k, v, parts, rows_per_unit, lines_per_unit, offset);
  else
    store_typed<c10::BFloat16>(rows, sp, k, v, parts, rows_per_unit, lines_per_unit, offset);
}

template <class T>
void decode_typed(const at::Tensor& q, const at::Tensor& rows, const at::Tensor& index, int64_t parts, int64_t Hkv,
                  int64_t R, int64_t lpu, int64_t offset, double scale, float softcap, const float* sinks,
                  int64_t isa, at::Tensor& out) {
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), L = index.size(1), G = H / Hkv;
  const float* qp = q.data_ptr<float>();
  const T* rp = rows.data_ptr<T>();
  const int64_t* ip = index.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const AttendFn<T> fn = attend_fn<T>(isa, D);
  deepinfer_pool::parallel_for(N * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(G * L);
    std::vector<const T*> keys(L);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = i / Hkv, g = i % Hkv;
      fn(qp + n * q.stride(0) + g * G * q.stride(1), q.stride(1), rp, rows.stride(0), g * D,
         (parts - 1) * Hkv * D + g * D, ip + n * L, L, R, lpu, offset, G, D, float(scale), softcap,
         sinks ? sinks + g * G : nullptr, keys.data(), scores.data(), op + (n * H + g * G) * D, D);
    }
  });
}

// Sink logits as the kernels read them: nullptr, or H contiguous floats.
const float* sink_logits(const std::optional<at::Tensor>& sinks, int64_t H) {
  if (!sinks.has_value()) return nullptr;
  check_f32(*sinks, "sinks");
  TORCH_CHECK(sinks->dim() == 1 && sinks->numel() == H && sinks->is_contiguous(), "sinks must be [H] contiguous for ",
              H, " query heads, got ", sinks->sizes());
  return sinks->data_ptr<float>();
}

at::Tensor decode_attn(const at::Tensor& q, const at::Tensor& rows, const at::Tensor& index, int64_t num_kv_heads,
                       int64_t rows_per_unit, int64_t lines_per_unit, int64_t offset, double scale, int64_t isa,
                       double softcap, const std::optional<at::Tensor>& sinks) {
  check_f32(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [N, H, D] with contiguous heads");
  TORCH_CHECK(num_kv_heads > 0 && q.size(1) % num_kv_heads == 0, "H = ", q.size(1),
              " is not a multiple of H_kv = ", num_kv_heads);
  const int64_t D = q.size(2), parts = rows.size(1) / (num_kv_heads * D);
  check_rows(rows, parts, num_kv_heads, D);
  const at::Tensor idx = index.to(at::kLong).contiguous();
  TORCH_CHECK(idx.dim() == 2 && idx.size(0) == q.size(0), "index must be [N, L] for N queries");
  const int64_t lines = rows.size(0), *ip = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < idx.numel(); ++i)
    TORCH_CHECK(ip[i] < 0 || line_of(ip[i], rows_per_unit, lines_per_unit, offset) < lines, "slot ", ip[i],
                " is past the cache");
  TORCH_CHECK(softcap >= 0, "softcap must be positive (0: none), got ", softcap);
  const float* sp = sink_logits(sinks, q.size(1));
  at::Tensor out = at::empty({q.size(0), q.size(1), D}, q.options());
  if (rows.scalar_type() == at::kFloat)
    decode_typed<float>(q, rows, idx, parts, num_kv_heads, rows_per_unit, lines_per_unit, offset, scale,
                        float(softcap), sp, isa, out);
  else
    decode_typed<c10::BFloat16>(q, rows, idx, parts, num_kv_heads, rows_per_unit, lines_per_unit, offset, scale,
                                float(softcap), sp, isa, out);
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

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("cpu_isa() -> int", cpu_isa);
  m.def("rms_norm(Tensor x, Tensor w, float eps, float offset, int isa) -> Tensor");
  m.def("silu_mul(Tensor x, int isa) -> Tensor");
  m.def("gelu_tanh_mul(Tensor x, int isa) -> Tensor");
  m.def("rope(Tensor q, Tensor k, Tensor positions, Tensor cos, Tensor sin, int isa) -> (Tensor, Tensor)");
  m.def("store_rows(Tensor(a!) rows, Tensor slots, Tensor k, Tensor v, int rows_per_unit, int lines_per_unit, "
        "int offset) -> ()");
  m.def("q8_round(Tensor x) -> Tensor");
  m.def("decode_attn(Tensor q, Tensor rows, Tensor index, int num_kv_heads, int rows_per_unit, int lines_per_unit, "
        "int offset, float scale, int isa, float softcap=0., Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("silu_mul", silu_mul);
  m.impl("gelu_tanh_mul", gelu_tanh_mul);
  m.impl("rope", rope);
  m.impl("store_rows", store_rows);
  m.impl("q8_round", q8_round);
  m.impl("decode_attn", decode_attn);
}
