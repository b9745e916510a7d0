// duolm's CPU kernels for decoding (duolm/kernels.py builds and loads this file), written once with ATen's portable
// vectors (at::vec::Vectorized<float>: L = 16 floats under AVX-512, 8 under AVX2) and built for the instruction set
// torch dispatches on the CPU at hand (kernels.py: -DCPU_CAPABILITY=AVX512 or AVX2 and that set's -m flags). Two are
// products of a few rows x (M, K) fp32 with a weight W (N, K) packed in blocks of L outputs, each block's column
// streamed once for all the rows (up to CHUNK at a time), two blocks a step, the next lines prefetched: decoding reads
// every weight once a token.
//   fp32_linear: y = x W^T + b, fp32 sums (the dot products in k's order).
//   int8_linear: W int8 rows with a scale each; each row of x quantized on its own,
//     u8[m, k] = round((x[m, k] - lo[m]) * (255 / span[m])),  lo, span = the row's min and max - min (at least 1e-30),
//     y[m, n]  = acc[m, n] * (span[m] / 255) * scale[n] + lo[m] * row_sums[n] + b[n],
//   acc the exact int32 sum over k of u8 * W, summed G inputs at a time by the one instruction that differs between
//   the sets (dot() below): AVX512-VNNI's vpdpbusd (G = 4 u8 x s8 pairs a 32-bit lane; compiled for VNNI alone, the
//   target attribute, so that the file loads on any AVX-512 CPU) or AVX2's vpmaddwd (G = 2, both widened to 16 bits).
// Layouts (kernels.pack_fp32, kernels.pack_int8): fp32 [N/L][K][L], int8 [N/L][K/G][L][G], zero-padded.
// The third, one_query_attention, is one query a row over a KV cache, reading only the columns its mask shows; the
// fourth, masked_logits, structured output's mask on a draw's logits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t L = Vec::size();           // floats a vector
constexpr int CHUNK = L == 16 ? 8 : 4;       // rows a tile keeps in registers (32 vector registers, or 16)
constexpr int64_t AHEAD = 1536;              // bytes prefetched ahead on each weight stream
constexpr int64_t PF = 16;                   // rows of keys and values prefetched ahead (attention)
constexpr int64_t MASK_WORDS = 512;          // masked_logits' words a thread takes at least (16,384 tokens)

#if defined(CPU_CAPABILITY_AVX512)
#define INT8 __attribute__((target("avx512f,avx512bw,avx512vnni")))
constexpr int64_t G = 4;
using IVec = __m512i;
inline IVec izero() { return _mm512_setzero_si512(); }
// acc + the G-term dot products of the word a (G u8) with each of the L outputs' G int8 weights at w
INT8 inline IVec dot(IVec acc, int32_t a, const int8_t* w) {
  return _mm512_dpbusd_epi32(acc, _mm512_set1_epi32(a), _mm512_loadu_si512(w));
}
inline Vec to_float(IVec a) { return Vec(_mm512_cvtepi32_ps(a)); }
#else
#define INT8
constexpr int64_t G = 2;
using IVec = __m256i;
inline IVec izero() { return _mm256_setzero_si256(); }
inline IVec dot(IVec acc, int32_t a, const int8_t* w) {       // a: two u8 as 16-bit halves
  const __m256i w16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_set1_epi32(a), w16));
}
inline Vec to_float(IVec a) { return Vec(_mm256_cvtepi32_ps(a)); }
#endif

// into L2 (T1): a stream's lines reach L1 on their loads; prefetched into L1 (T0) they slowed a decoding step
// (docs/precision.md, the prefetch hint)
void prefetch(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }

template <int R> using Rows = std::integral_constant<int, R>;

// f(Rows<r>{}) for 1 <= r <= CHUNK: the row count a compile-time constant (a tile's accumulators stay in registers)
template <int R = 1, class F>
void with_rows(int64_t r, F f) {
  if constexpr (R < CHUNK) {
    if (r != R) return with_rows<R + 1>(r, f);
  }
  f(Rows<R>{});
}

// tile(p, m0, Rows<mr>) for every pair p of L-output blocks (split between the threads) and chunk of mr <= CHUNK rows
// from m0; a chunk's rows lie interleaved ([chunk][k][row] floats, [chunk][k / G][row] 4-byte words).
template <class F>
void for_tiles(int64_t M, int64_t NB, F tile) {
  at::parallel_for(0, (NB + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t m0 = 0; m0 < M; m0 += CHUNK)
        with_rows(std::min<int64_t>(CHUNK, M - m0), [&](auto mr) { tile(p, m0, mr); });
  });
}

// The outputs n0 .. n0 + 2L of a tile's MR rows: y[i, n] = value(i, j) + b[n], j the block, partial at N.
template <int MR, class F>
void store_tile(int64_t n0, int64_t N, const float* bp, float* y, F value) {
  for (int j = 0; j < 2 && n0 + L * j < N; ++j) {
    const int64_t n = n0 + L * j, count = std::min<int64_t>(L, N - n);
    const Vec b = bp ? Vec::loadu(bp + n, count) : Vec(0.0f);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) (value(i, j, n, count) + b).store(y + i * N + n, count);
  }
}

// ---- fp32 ------------------------------------------------------------------------------------------------------

template <int MR>
void fp32_tile(const float* __restrict xt, int64_t K, const float* __restrict w0, const float* __restrict w1,
               int64_t n0, int64_t N, const float* bp, float* __restrict y) {
  Vec acc0[MR], acc1[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = Vec(0.0f);
  for (int64_t k = 0; k < K; ++k) {
    prefetch(w0 + k * L + AHEAD / 4);
    prefetch(w1 + k * L + AHEAD / 4);
    const Vec b0 = Vec::loadu(w0 + k * L), b1 = Vec::loadu(w1 + k * L);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const Vec a(xt[k * MR + i]);
      acc0[i] = at::vec::fmadd(a, b0, acc0[i]);
      acc1[i] = at::vec::fmadd(a, b1, acc1[i]);
    }
  }
  store_tile<MR>(n0, N, bp, y, [&](int i, int j, int64_t, int64_t) { return j ? acc1[i] : acc0[i]; });
}

// the M rows of x (K values of T each) -> their chunks interleaved for the tiles: chunk c holds rows
// c*CHUNK .. as [k][row]
template <class T>
at::Tensor interleave(const T* x, int64_t M, int64_t K, const at::TensorOptions& options) {
  auto out = at::empty({(M + CHUNK - 1) / CHUNK * CHUNK * K * static_cast<int64_t>(sizeof(T))}, options.dtype(at::kByte));
  T* dst = reinterpret_cast<T*>(out.data_ptr<uint8_t>());
  for (int64_t m = 0; m < M; ++m) {
    const int64_t mr = std::min<int64_t>(CHUNK, M - m / CHUNK * CHUNK), i = m % CHUNK;
    T* chunk = dst + m / CHUNK * CHUNK * K;
    for (int64_t k = 0; k < K; ++k) chunk[k * mr + i] = x[m * K + k];
  }
  return out;
}

// x's rows (any leading shape, K last) and y's shape (x's leading shape, N last)
std::vector<int64_t> out_shape(const at::Tensor& x, int64_t N) {
  auto shape = x.sizes().vec();
  shape.back() = N;
  return shape;
}

at::Tensor fp32_linear(const at::Tensor& x_, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t N) {
  TORCH_CHECK(x_.dim() >= 1 && x_.scalar_type() == at::kFloat && x_.device().is_cpu(), "fp32_linear: x (..., K) fp32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() && packed.size(2) == L,
              "fp32_linear: a weight packed by kernels.pack_fp32 for ", L, " floats a vector");
  auto x = x_.contiguous();
  const int64_t K = x.size(-1), M = K ? x.numel() / K : 0, NB = packed.size(0);
  TORCH_CHECK(K > 0 && packed.size(1) == K && NB == (N + L - 1) / L, "fp32_linear: x's width or N does not match the "
              "packed weight");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "fp32_linear: N fp32 biases");
  auto xt = interleave(x.data_ptr<float>(), M, K, x.options());
  auto y = at::empty(out_shape(x, N), x.options());
  const float* tp = reinterpret_cast<const float*>(xt.data_ptr<uint8_t>());
  float* yp = y.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  for_tiles(M, NB, [&](int64_t p, int64_t m0, auto mr) {
    const float* w0 = wp + 2 * p * K * L;
    const float* w1 = 2 * p + 1 < NB ? w0 + K * L : w0;
    fp32_tile<decltype(mr)::value>(tp + m0 * K, K, w0, w1, 2 * L * p, N, bp, yp + m0 * N);
  });
  return y;
}

// ---- int8 ------------------------------------------------------------------------------------------------------

template <int MR>
INT8 void int8_tile(const int32_t* __restrict xq, int64_t KG, const int8_t* __restrict w0,
                    const int8_t* __restrict w1, int64_t n0, int64_t N, const float* lo, const float* step,
                    const float* sp, const float* rs, const float* bp, float* __restrict y) {
  IVec acc0[MR], acc1[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = izero();
  for (int64_t g = 0; g < KG; ++g) {
    prefetch(w0 + g * L * G + AHEAD);
    prefetch(w1 + g * L * G + AHEAD);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      acc0[i] = dot(acc0[i], xq[g * MR + i], w0 + g * L * G);
      acc1[i] = dot(acc1[i], xq[g * MR + i], w1 + g * L * G);
    }
  }
  store_tile<MR>(n0, N, bp, y, [&](int i, int j, int64_t n, int64_t count) {
    return at::vec::fmadd(to_float(j ? acc1[i] : acc0[i]), Vec(step[i]) * Vec::loadu(sp + n, count),
                          Vec(lo[i]) * Vec::loadu(rs + n, count));
  });
}

// Row r of x (K floats) -> its words (G u8 each: 4 bytes under VNNI, 2 as 16-bit halves under AVX2; the padding 0),
// lo and step = span / 255. The u8 rounded to nearest even, as torch.round.
void quantize_row(const float* r, int64_t K, int32_t* words, float* lo, float* step) {
  Vec vl(FLT_MAX), vh(-FLT_MAX);
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    const Vec v = Vec::loadu(r + k);
    vl = at::vec::minimum(vl, v);
    vh = at::vec::maximum(vh, v);
  }
  float l = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return at::vec::minimum(a, b); }, vl);
  float h = at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, vh);
  for (; k < K; ++k) l = std::min(l, r[k]), h = std::max(h, r[k]);
  const float span = std::max(h - l, 1e-30f), inv = 255.0f / span;     // a constant row: every u8 0, 255 / span finite
  *lo = l;
  *step = span / 255.0f;
  std::vector<float> u((K + L + G - 1) / L * L + G, 0.0f);
  for (k = 0; k < K; k += L) {
    const int64_t count = std::min<int64_t>(L, K - k);
    ((Vec::loadu(r + k, count) - Vec(l)) * Vec(inv)).round().store(u.data() + k, count);
  }
  // a word's G u8 are its bytes (VNNI) or its 16-bit halves (AVX2), lowest first: the u8 written as such, the padding 0
  using Q = std::conditional_t<G == 4, uint8_t, uint16_t>;
  const int64_t n = (K + G - 1) / G * G;
  std::vector<Q> q(n);
  for (k = 0; k < n; ++k) q[k] = static_cast<Q>(std::clamp(u[k], 0.0f, 255.0f));
  std::memcpy(words, q.data(), n * sizeof(Q));
}

at::Tensor int8_linear(const at::Tensor& x_, const at::Tensor& packed, const at::Tensor& scale,
                       const at::Tensor& row_sums, const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x_.dim() >= 1 && x_.scalar_type() == at::kFloat && x_.device().is_cpu(), "int8_linear: x (..., K) fp32");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
              packed.size(2) == L && packed.size(3) == G, "int8_linear: a weight packed by kernels.pack_int8 in blocks "
              "of ", L, " x ", G);
  auto x = x_.contiguous();
  const int64_t K = x.size(-1), M = K ? x.numel() / K : 0, NB = packed.size(0), KG = packed.size(1);
  TORCH_CHECK(K > 0 && KG == (K + G - 1) / G && NB == (N + L - 1) / L, "int8_linear: x's width or N does not match "
              "the packed weight");
  for (const at::Tensor* v : {&scale, &row_sums})
    TORCH_CHECK(v->scalar_type() == at::kFloat && v->is_contiguous() && v->numel() == N,
                "int8_linear: N fp32 scales and row sums");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "int8_linear: N fp32 biases");
  std::vector<int32_t> words(M * KG);
  std::vector<float> lo(M), step(M);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {         // each row its own lo, step and words
    for (int64_t m = m0; m < m1; ++m) quantize_row(xp + m * K, K, words.data() + m * KG, &lo[m], &step[m]);
  });
  auto xq = interleave(words.data(), M, KG, x.options());
  auto y = at::empty(out_shape(x, N), x.options());
  const int32_t* qp = reinterpret_cast<const int32_t*>(xq.data_ptr<uint8_t>());
  float* yp = y.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float *sp = scale.data_ptr<float>(), *rs = row_sums.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  for_tiles(M, NB, [&](int64_t p, int64_t m0, auto mr) {
    const int8_t* w0 = wp + 2 * p * KG * L * G;
    const int8_t* w1 = 2 * p + 1 < NB ? w0 + KG * L * G : w0;
    int8_tile<decltype(mr)::value>(qp + m0 * KG, KG, w0, w1, 2 * L * p, N, lo.data() + m0, step.data() + m0, sp, rs,
                                   bp, yp + m0 * N);
  });
  return y;
}

// ---- one-query attention ---------------------------------------------------------------------------------------

float sum_of(Vec v) { return at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, v); }

// softmax(q k^T / sqrt(D) under mask) v for one query a row: q (B, H, 1, D), k and v (B, H, L, D), mask bool
// (B or 1, 1, 1, L) or none -> (B, H, 1, D). Each (row, head) reads only the keys and values of the columns its mask
// shows, each once: the scores, then their softmax, then the weighted sum of the values. No column shown: NaN (as
// softmax over nothing but -inf).
at::Tensor one_query_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const c10::optional<at::Tensor>& mask) {
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->dim() == 4 && t->scalar_type() == at::kFloat && t->device().is_cpu() && t->stride(3) == 1,
                "one_query_attention: q, k, v 4-D fp32, each row of head_dim contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), T = k.size(2);
  TORCH_CHECK(q.size(2) == 1 && k.sizes() == v.sizes() && k.size(0) == B && k.size(1) == H && k.size(3) == D,
              "one_query_attention: q (B, H, 1, D), k and v (B, H, L, D)");
  TORCH_CHECK(!mask.has_value() || (mask->dim() == 4 && mask->scalar_type() == at::kBool &&
              (mask->size(0) == B || mask->size(0) == 1) && mask->size(1) == 1 && mask->size(2) == 1 &&
              mask->size(3) == T), "one_query_attention: mask bool (B or 1, 1, 1, L)");
  auto y = at::empty({B, H, 1, D}, q.options());
  const float scale = static_cast<float>(std::pow(static_cast<double>(D), -0.5));
  const bool* mp = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
  const int64_t mb = mask.has_value() && mask->size(0) > 1 ? mask->stride(0) : 0, mj = mp ? mask->stride(3) : 0;
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(T + L);
    std::vector<int64_t> cols(T);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / H, h = t % H;
      const float* qr = qp + b * q.stride(0) + h * q.stride(1);
      const float* kr = kp + b * k.stride(0) + h * k.stride(1);
      const float* vr = vp + b * v.stride(0) + h * v.stride(1);
      float* out = yp + t * D;
      int64_t n = 0;
      float top = -INFINITY;
      for (int64_t j = 0; j < T; ++j) {
        if (mp && !mp[b * mb + j * mj]) continue;
        for (int64_t d = 0; d < D; d += 16) {
          prefetch(kr + (j + PF) * k.stride(2) + d);
          prefetch(vr + (j + PF) * v.stride(2) + d);
        }
        Vec dot(0.0f);
        for (int64_t d = 0; d < D; d += L) {
          const int64_t count = std::min<int64_t>(L, D - d);
          dot = at::vec::fmadd(Vec::loadu(qr + d, count), Vec::loadu(kr + j * k.stride(2) + d, count), dot);
        }
        s[n] = sum_of(dot) * scale;
        top = std::max(top, s[n]);
        cols[n++] = j;
      }
      if (n == 0) {
        std::fill(out, out + D, NAN);
        continue;
      }
      Vec sum(0.0f);
      for (int64_t i = 0; i < n; i += L) {
        const int64_t count = std::min<int64_t>(L, n - i);
        (Vec::loadu(s.data() + i, count) - Vec(top)).exp().store(s.data() + i, count);
        sum = sum + Vec::loadu(s.data() + i, count);              // (the lanes past count load as 0)
      }
      const float total = sum_of(sum);
      std::fill(out, out + D, 0.0f);
      for (int64_t i = 0; i < n; ++i) {
        const Vec w(s[i] / total);
        const float* row = vr + cols[i] * v.stride(2);
        for (int64_t d = 0; d < D; d += L) {
          const int64_t count = std::min<int64_t>(L, D - d);
          at::vec::fmadd(w, Vec::loadu(row + d, count), Vec::loadu(out + d, count)).store(out + d, count);
        }
      }
    }
  });
  return y;
}

// Structured output's draw: logits (B, V) float32 -> a copy whose row rows[k] keeps the tokens that bitmasks[k]
// allows (W >= V / 32 int32 words, token t's bit t % 32 of word t / 32) and has -inf for the others; the other rows
// as they are. A word's 32 tokens a step: under AVX-512 two masked loads (-inf where a bit is 0), under AVX2 each
// byte's bits spread over 8 lanes and blended.
inline void keep32(uint32_t bits, const float* x, float* y) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 none = _mm512_set1_ps(-INFINITY);
  _mm512_storeu_ps(y, _mm512_mask_loadu_ps(none, static_cast<__mmask16>(bits), x));
  _mm512_storeu_ps(y + 16, _mm512_mask_loadu_ps(none, static_cast<__mmask16>(bits >> 16), x + 16));
#else
  const __m256 none = _mm256_set1_ps(-INFINITY);
  const __m256i lane = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int b = 0; b < 32; b += 8) {
    const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(bits >> b), lane), lane);
    _mm256_storeu_ps(y + b, _mm256_blendv_ps(none, _mm256_loadu_ps(x + b), _mm256_castsi256_ps(on)));
  }
#endif
}

at::Tensor masked_logits(const at::Tensor& logits_, at::TensorList bitmasks, at::IntArrayRef rows) {
  TORCH_CHECK(logits_.dim() == 2 && logits_.scalar_type() == at::kFloat, "masked_logits: logits (B, V) float32");
  TORCH_CHECK(bitmasks.size() == rows.size(), "masked_logits: ", bitmasks.size(), " bitmasks for ", rows.size(),
              " rows");
  const at::Tensor logits = logits_.contiguous();
  const int64_t B = logits.size(0), V = logits.size(1);
  at::Tensor out = at::empty_like(logits);
  const float* src = logits.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  std::vector<char> masked(B, 0);
  std::vector<const uint32_t*> words(rows.size());
  for (size_t k = 0; k < rows.size(); ++k) {
    const int64_t r = rows[k];
    const at::Tensor& m = bitmasks[k];
    TORCH_CHECK(r >= 0 && r < B && !masked[r], "masked_logits: row ", r, " of ", B, ", once");
    TORCH_CHECK(m.scalar_type() == at::kInt && m.is_contiguous() && m.numel() * 32 >= V,
                "masked_logits: a bitmask is ", (V + 31) / 32, " contiguous int32 words");
    words[k] = reinterpret_cast<const uint32_t*>(m.data_ptr<int32_t>());
    masked[r] = 1;
  }
  const int64_t W = (V + 31) / 32, full = V / 32;
  at::parallel_for(0, static_cast<int64_t>(rows.size()) * W, MASK_WORDS, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {                      // word i % W of row rows[i / W]
      const int64_t k = i / W, word = i % W;
      const float* x = src + rows[k] * V;
      float* y = dst + rows[k] * V;
      if (word < full) {
        keep32(words[k][word], x + 32 * word, y + 32 * word);
      } else {
        for (int64_t t = 32 * full; t < V; ++t) y[t] = (words[k][full] >> (t - 32 * full)) & 1u ? x[t] : -INFINITY;
      }
    }
  });
  for (int64_t r = 0; r < B; ++r) {
    if (!masked[r]) std::memcpy(dst + r * V, src + r * V, V * sizeof(float));
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(duolm_cpu, m) {
  m.def("fp32_linear(Tensor x, Tensor packed, Tensor? bias, int N) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale, Tensor row_sums, Tensor? bias, int N) -> Tensor");
  m.def("one_query_attention(Tensor q, Tensor k, Tensor v, Tensor? mask) -> Tensor");
  m.def("masked_logits(Tensor logits, Tensor[] bitmasks, int[] rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(duolm_cpu, CPU, m) {
  m.impl("fp32_linear", &fp32_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("one_query_attention", &one_query_attention);
  m.impl("masked_logits", &masked_logits);
}
