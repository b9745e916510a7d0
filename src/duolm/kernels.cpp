// duolm's CPU kernels for decoding (duolm/kernels.py builds and loads this file). Two are products of a few rows
// x (M, K) fp32 with a weight W (N, K) packed in blocks of 16 outputs, each block's column streamed once for all the rows (up to 8 at a
// time), two blocks a step, the next lines prefetched: decoding reads every weight once a token.
//   fp32_linear: y = x W^T + b, fp32 sums (the dot products in k's order). AVX-512F.
//   int8_linear: W int8 rows with a scale each; each row of x quantized on its own,
//     u8[m, k] = round((x[m, k] - lo[m]) * (255 / span[m])),  lo, span = the row's min and max - min (at least 1e-30),
//     y[m, n]  = acc[m, n] * (span[m] / 255) * scale[n] + lo[m] * row_sums[n] + b[n],
//   acc the exact int32 sum over k of u8 * W, row_sums[n] the sum over k of W * scale. AVX512-VNNI (vpdpbusd: four
//   u8 x s8 pairs a 32-bit lane), compiled for it alone (the target attribute): the file loads on any AVX-512 CPU.
// Layouts (kernels.pack_fp32, kernels.pack_int8): fp32 [N/16][K][16], int8 [N/16][K/4][16][4], zero-padded.
// The third, one_query_attention, is one query a row over a KV cache, reading only the columns its mask shows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t AHEAD = 24;     // lines prefetched ahead on each weight stream
constexpr int64_t PF = 16;        // rows of keys and values prefetched ahead (attention)

__mmask16 lanes(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

template <int R> using Rows = std::integral_constant<int, R>;

// tile(p, m0, Rows<mr>) for every pair p of 16-output blocks (split between the threads) and chunk of mr <= 8 rows
// from m0, mr a compile-time constant (the tile's accumulators stay in registers); a chunk's rows lie interleaved
// ([chunk][k][row] floats, [chunk][k / 4][row] 4-byte words).
template <class F>
void for_tiles(int64_t M, int64_t NB, F tile) {
  at::parallel_for(0, (NB + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        switch (std::min<int64_t>(8, M - m0)) {
          case 1: tile(p, m0, Rows<1>{}); break;
          case 2: tile(p, m0, Rows<2>{}); break;
          case 3: tile(p, m0, Rows<3>{}); break;
          case 4: tile(p, m0, Rows<4>{}); break;
          case 5: tile(p, m0, Rows<5>{}); break;
          case 6: tile(p, m0, Rows<6>{}); break;
          case 7: tile(p, m0, Rows<7>{}); break;
          default: tile(p, m0, Rows<8>{});
        }
      }
  });
}

// ---- fp32 ------------------------------------------------------------------------------------------------------

template <int MR>
void fp32_tile(const float* __restrict xt, int64_t K, const float* __restrict w0, const float* __restrict w1,
               int64_t n0, int64_t N, const float* bp, float* __restrict y) {
  __m512 acc0[MR], acc1[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(w0 + (k + AHEAD) * 16), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w1 + (k + AHEAD) * 16), _MM_HINT_T0);
    const __m512 b0 = _mm512_loadu_ps(w0 + k * 16), b1 = _mm512_loadu_ps(w1 + k * 16);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 a = _mm512_set1_ps(xt[k * MR + i]);
      acc0[i] = _mm512_fmadd_ps(a, b0, acc0[i]);
      acc1[i] = _mm512_fmadd_ps(a, b1, acc1[i]);
    }
  }
  for (int j = 0; j < 2 && n0 + 16 * j < N; ++j) {
    const int64_t n = n0 + 16 * j;
    const __mmask16 keep = lanes(N - n);
    const __m512 b = bp ? _mm512_maskz_loadu_ps(keep, bp + n) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(y + i * N + n, keep, _mm512_add_ps(j ? acc1[i] : acc0[i], b));
  }
}

at::Tensor fp32_linear(const at::Tensor& x_, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t N) {
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kFloat && x_.device().is_cpu(), "fp32_linear: x (M, K) fp32");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kFloat && packed.is_contiguous() && packed.size(2) == 16,
              "fp32_linear: a weight packed by kernels.pack_fp32");
  auto x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0);
  TORCH_CHECK(K > 0 && packed.size(1) == K && NB == (N + 15) / 16, "fp32_linear: x's width or N does not match the "
              "packed weight");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "fp32_linear: N fp32 biases");
  auto xt = at::empty({(M + 7) / 8 * 8 * K}, x.options());
  const float* xp = x.data_ptr<float>();
  float* tp = xt.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const int64_t mr = std::min<int64_t>(8, M - m / 8 * 8), i = m % 8;
    float* dst = tp + m / 8 * 8 * K;
    for (int64_t k = 0; k < K; ++k) dst[k * mr + i] = xp[m * K + k];
  }
  auto y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  for_tiles(M, NB, [&](int64_t p, int64_t m0, auto mr) {
    const float* w0 = wp + 2 * p * K * 16;
    const float* w1 = 2 * p + 1 < NB ? w0 + K * 16 : w0;
    fp32_tile<decltype(mr)::value>(tp + m0 * K, K, w0, w1, 32 * p, N, bp, yp + m0 * N);
  });
  return y;
}

// ---- int8 ------------------------------------------------------------------------------------------------------

#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

template <int MR>
VNNI void int8_tile(const int32_t* __restrict xq, int64_t KG, const int8_t* __restrict w0,
                    const int8_t* __restrict w1, int64_t n0, int64_t N, const float* lo, const float* step,
                    const float* sp, const float* rs, const float* bp, float* __restrict y) {
  __m512i acc0[MR], acc1[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = _mm512_setzero_si512();
  for (int64_t g = 0; g < KG; ++g) {
    _mm_prefetch(reinterpret_cast<const char*>(w0 + (g + AHEAD) * 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w1 + (g + AHEAD) * 64), _MM_HINT_T0);
    const __m512i b0 = _mm512_loadu_si512(w0 + g * 64), b1 = _mm512_loadu_si512(w1 + g * 64);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512i a = _mm512_set1_epi32(xq[g * MR + i]);
      acc0[i] = _mm512_dpbusd_epi32(acc0[i], a, b0);
      acc1[i] = _mm512_dpbusd_epi32(acc1[i], a, b1);
    }
  }
  for (int j = 0; j < 2 && n0 + 16 * j < N; ++j) {
    const int64_t n = n0 + 16 * j;
    const __mmask16 keep = lanes(N - n);
    const __m512 s = _mm512_maskz_loadu_ps(keep, sp + n), r = _mm512_maskz_loadu_ps(keep, rs + n);
    const __m512 b = bp ? _mm512_maskz_loadu_ps(keep, bp + n) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512 base = _mm512_fmadd_ps(_mm512_set1_ps(lo[i]), r, b);
      const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(j ? acc1[i] : acc0[i]),
                                       _mm512_mul_ps(_mm512_set1_ps(step[i]), s), base);
      _mm512_mask_storeu_ps(y + i * N + n, keep, v);
    }
  }
}

// Row r of x (K floats) -> its u8 (4 KG bytes, the padding left 0), lo and step = span / 255.
VNNI void quantize_row(const float* r, int64_t K, uint8_t* out, float* lo, float* step) {
  const int64_t tail = K % 16;
  const __mmask16 last = lanes(tail);
  __m512 vl = _mm512_set1_ps(FLT_MAX), vh = _mm512_set1_ps(-FLT_MAX);
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 v = _mm512_loadu_ps(r + k);
    vl = _mm512_min_ps(vl, v);
    vh = _mm512_max_ps(vh, v);
  }
  if (tail) {
    const __m512 v = _mm512_maskz_loadu_ps(last, r + k);
    vl = _mm512_mask_min_ps(vl, last, vl, v);
    vh = _mm512_mask_max_ps(vh, last, vh, v);
  }
  const float l = _mm512_reduce_min_ps(vl), h = _mm512_reduce_max_ps(vh);
  const float span = std::max(h - l, 1e-30f), inv = 255.0f / span;     // a constant row: every u8 0, 255 / span finite
  *lo = l;
  *step = span / 255.0f;
  const __m512 ml = _mm512_set1_ps(l), mi = _mm512_set1_ps(inv);
  for (k = 0; k + 16 <= K; k += 16)       // round to nearest even (the default MXCSR), saturated to [0, 255]
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k),
                     _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(r + k), ml), mi))));
  if (tail)
    _mm512_mask_cvtusepi32_storeu_epi8(out + k, last,
        _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(last, r + k), ml), mi)));
}

VNNI at::Tensor int8_linear(const at::Tensor& x_, const at::Tensor& packed, const at::Tensor& scale,
                            const at::Tensor& row_sums, const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kFloat && x_.device().is_cpu(), "int8_linear: x (M, K) fp32");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
              packed.size(2) == 16 && packed.size(3) == 4, "int8_linear: a weight packed by kernels.pack_int8");
  auto x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), KG = packed.size(1);
  TORCH_CHECK(K > 0 && KG == (K + 3) / 4 && NB == (N + 15) / 16, "int8_linear: x's width or N does not match the "
              "packed weight");
  for (const at::Tensor* v : {&scale, &row_sums})
    TORCH_CHECK(v->scalar_type() == at::kFloat && v->is_contiguous() && v->numel() == N,
                "int8_linear: N fp32 scales and row sums");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "int8_linear: N fp32 biases");
  auto xq = at::empty({(M + 7) / 8 * 8 * KG * 4}, x.options().dtype(at::kByte));
  std::vector<float> lo(M), step(M);
  std::vector<uint8_t> row(KG * 4, 0);
  const float* xp = x.data_ptr<float>();
  uint8_t* qp = xq.data_ptr<uint8_t>();
  for (int64_t m = 0; m < M; ++m) {
    quantize_row(xp + m * K, K, row.data(), &lo[m], &step[m]);
    const int64_t mr = std::min<int64_t>(8, M - m / 8 * 8), i = m % 8;
    int32_t* dst = reinterpret_cast<int32_t*>(qp + m / 8 * 8 * KG * 4);
    const int32_t* src = reinterpret_cast<const int32_t*>(row.data());
    for (int64_t g = 0; g < KG; ++g) dst[g * mr + i] = src[g];
  }
  auto y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* rs = row_sums.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  for_tiles(M, NB, [&](int64_t p, int64_t m0, auto mr) {
    const int8_t* w0 = wp + 2 * p * KG * 64;
    const int8_t* w1 = 2 * p + 1 < NB ? w0 + KG * 64 : w0;
    int8_tile<decltype(mr)::value>(reinterpret_cast<const int32_t*>(qp + m0 * KG * 4), KG, w0, w1, 32 * p, N,
                                   lo.data() + m0, step.data() + m0, sp, rs, bp, yp + m0 * N);
  });
  return y;
}

// ---- one-query attention ---------------------------------------------------------------------------------------

// exp(x) for x <= 0 (clamped at -87.3, where expf reaches FLT_MIN): 2^n p(r), n = round(x log2(e)), r = x - n ln(2)
// in two parts, p Cephes' expf polynomial (within 2 ulp of expf).
__m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// softmax(q k^T / sqrt(D) under mask) v for one query a row: q (B, H, 1, D), k and v (B, H, L, D), mask bool
// (B or 1, 1, 1, L) or none -> (B, H, 1, D). Each (row, head) reads only the keys and values of the columns its mask
// shows, each once: the scores, then their softmax, then the weighted sum of the values. No column shown: NaN (as
// softmax over nothing but -inf).
at::Tensor one_query_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const c10::optional<at::Tensor>& mask) {
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->dim() == 4 && t->scalar_type() == at::kFloat && t->device().is_cpu() && t->stride(3) == 1,
                "one_query_attention: q, k, v 4-D fp32, each row of head_dim contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), L = k.size(2);
  TORCH_CHECK(q.size(2) == 1 && k.sizes() == v.sizes() && k.size(0) == B && k.size(1) == H && k.size(3) == D,
              "one_query_attention: q (B, H, 1, D), k and v (B, H, L, D)");
  TORCH_CHECK(!mask.has_value() || (mask->dim() == 4 && mask->scalar_type() == at::kBool &&
              (mask->size(0) == B || mask->size(0) == 1) && mask->size(1) == 1 && mask->size(2) == 1 &&
              mask->size(3) == L), "one_query_attention: mask bool (B or 1, 1, 1, L)");
  auto y = at::empty({B, H, 1, D}, q.options());
  const float scale = static_cast<float>(std::pow(static_cast<double>(D), -0.5));
  const bool* mp = mask.has_value() ? mask->data_ptr<bool>() : nullptr;
  const int64_t mb = mask.has_value() && mask->size(0) > 1 ? mask->stride(0) : 0, mj = mp ? mask->stride(3) : 0;
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> s(L + 16);
    std::vector<int64_t> cols(L);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / H, h = t % H;
      const float* qr = qp + b * q.stride(0) + h * q.stride(1);
      const float* kr = kp + b * k.stride(0) + h * k.stride(1);
      const float* vr = vp + b * v.stride(0) + h * v.stride(1);
      float* out = yp + t * D;
      int64_t n = 0;
      float top = -INFINITY;
      for (int64_t j = 0; j < L; ++j) {
        if (mp && !mp[b * mb + j * mj]) continue;
        for (int64_t d = 0; d < D; d += 16) {
          _mm_prefetch(reinterpret_cast<const char*>(kr + (j + PF) * k.stride(2) + d), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(vr + (j + PF) * v.stride(2) + d), _MM_HINT_T1);
        }
        __m512 dot = _mm512_setzero_ps();
        for (int64_t d = 0; d < D; d += 16) {
          const __mmask16 keep = lanes(D - d);
          dot = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(keep, qr + d),
                                _mm512_maskz_loadu_ps(keep, kr + j * k.stride(2) + d), dot);
        }
        s[n] = _mm512_reduce_add_ps(dot) * scale;
        top = std::max(top, s[n]);
        cols[n++] = j;
      }
      if (n == 0) {
        std::fill(out, out + D, NAN);
        continue;
      }
      __m512 sum = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 keep = lanes(n - i);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, s.data() + i), _mm512_set1_ps(top)));
        _mm512_mask_storeu_ps(s.data() + i, keep, e);
        sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(keep, e));
      }
      const float total = _mm512_reduce_add_ps(sum);
      std::fill(out, out + D, 0.0f);
      for (int64_t i = 0; i < n; ++i) {
        const __m512 w = _mm512_set1_ps(s[i] / total);
        const float* row = vr + cols[i] * v.stride(2);
        for (int64_t d = 0; d < D; d += 16) {
          const __mmask16 keep = lanes(D - d);
          _mm512_mask_storeu_ps(out + d, keep, _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(keep, row + d),
                                                               _mm512_maskz_loadu_ps(keep, out + d)));
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(duolm_cpu, m) {
  m.def("fp32_linear(Tensor x, Tensor packed, Tensor? bias, int N) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor packed, Tensor scale, Tensor row_sums, Tensor? bias, int N) -> Tensor");
  m.def("one_query_attention(Tensor q, Tensor k, Tensor v, Tensor? mask) -> Tensor");
}

TORCH_LIBRARY_IMPL(duolm_cpu, CPU, m) {
  m.impl("fp32_linear", &fp32_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("one_query_attention", &one_query_attention);
}
