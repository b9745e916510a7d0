// duolm's int8 product of a few rows (duolm/int8_kernel.py builds and loads this file; duolm.precision.Int8Linear runs
// it): y = x W^T + b for x (M, K) fp32 and W int8 (N, K) with a scale per row, each row of x quantized on its own,
//   u8[m, k] = round((x[m, k] - lo[m]) * (255 / span[m])),  lo, span = the row's min and max - min,
//   y[m, n]  = acc[m, n] * (span[m] / 255) * scale[n] + lo[m] * row_sums[n] + b[n],
// acc the exact int32 sum over k of u8 * W, row_sums[n] the sum over k of W * scale. The sums run on AVX512-VNNI
// (vpdpbusd: four u8 x s8 pairs a 32-bit lane), W packed by int8_kernel.pack: [N/16][K/4][16][4], zero-padded.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cfloat>
#include <vector>

namespace {

// MR rows (<= 8) times two blocks of 16 outputs: 2 MR accumulators in registers over the K/4 groups, then each row's
// affine map back. xq: the MR rows' groups interleaved, [g][i] the 4 bytes of row i in group g.
template <int MR>
void tile(const int32_t* __restrict xq, int64_t KG, const int8_t* __restrict w0, const int8_t* __restrict w1,
          int64_t n0, int64_t N, const float* lo, const float* step, const float* sp, const float* rs, const float* bp,
          float* __restrict y) {
  __m512i acc0[MR], acc1[MR];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) acc0[i] = acc1[i] = _mm512_setzero_si512();
  for (int64_t g = 0; g < KG; ++g) {
    const __m512i b0 = _mm512_loadu_si512(w0 + g * 64), b1 = _mm512_loadu_si512(w1 + g * 64);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const __m512i ai = _mm512_set1_epi32(xq[g * MR + i]);
      acc0[i] = _mm512_dpbusd_epi32(acc0[i], ai, b0);
      acc1[i] = _mm512_dpbusd_epi32(acc1[i], ai, b1);
    }
  }
  for (int j = 0; j < 2; ++j) {
    const int64_t n = n0 + 16 * j;
    if (n >= N) break;
    const __mmask16 keep = N - n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (N - n)) - 1);
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

at::Tensor linear(const at::Tensor& x_, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& row_sums,
                  const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x_.dim() == 2 && x_.scalar_type() == at::kFloat && x_.device().is_cpu(), "linear: x (M, K) fp32 on the CPU");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
              packed.size(2) == 16 && packed.size(3) == 4, "linear: a weight packed by int8_kernel.pack");
  auto x = x_.contiguous();
  const int64_t M = x.size(0), K = x.size(1), NB = packed.size(0), KG = packed.size(1);
  TORCH_CHECK(K > 0 && KG == (K + 3) / 4 && NB == (N + 15) / 16, "linear: x's width or N does not match the packed weight");
  for (const at::Tensor* v : {&scale, &row_sums})
    TORCH_CHECK(v->scalar_type() == at::kFloat && v->is_contiguous() && v->numel() == N, "linear: N fp32 scales, row sums");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N),
              "linear: N fp32 biases");
  // each row quantized on its own; rows in chunks of 8, a chunk's rows interleaved by groups of 4 bytes
  // ([chunk][g][row][4]; the padding 0, against W's zero padding)
  const int64_t chunks = (M + 7) / 8;
  auto xq = at::zeros({chunks * KG * 8 * 4}, x.options().dtype(at::kByte));
  std::vector<float> lo(M), step(M);
  const float* xp = x.data_ptr<float>();
  uint8_t* qp = xq.data_ptr<uint8_t>();
  std::vector<uint8_t> row(KG * 4, 0);
  const int64_t tail = K % 16;
  const __mmask16 last = (__mmask16)((1u << tail) - 1);
  for (int64_t m = 0; m < M; ++m) {
    const float* r = xp + m * K;
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
    lo[m] = l;
    step[m] = span / 255.0f;
    const __m512 ml = _mm512_set1_ps(l), mi = _mm512_set1_ps(inv);
    for (k = 0; k + 16 <= K; k += 16)   // round to nearest even (the default MXCSR), saturated to [0, 255]
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row.data() + k),
                       _mm512_cvtusepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(r + k), ml), mi))));
    if (tail)
      _mm512_mask_cvtusepi32_storeu_epi8(row.data() + k, last,
          _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(last, r + k), ml), mi)));
    const int64_t c = m / 8, mr = std::min<int64_t>(8, M - 8 * c), i = m % 8;
    int32_t* dst = reinterpret_cast<int32_t*>(qp + c * KG * 8 * 4);
    const int32_t* src = reinterpret_cast<const int32_t*>(row.data());
    for (int64_t g = 0; g < KG; ++g) dst[g * mr + i] = src[g];
  }
  auto y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const int8_t* wp = packed.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* rs = row_sums.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  const int64_t pairs = (NB + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int8_t* w0 = wp + 2 * p * KG * 64;
      const int8_t* w1 = 2 * p + 1 < NB ? w0 + KG * 64 : w0;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t m0 = 8 * c;
        const int32_t* xr = reinterpret_cast<const int32_t*>(qp + c * KG * 8 * 4);
        float* yr = yp + m0 * N;
        const float *l = lo.data() + m0, *st = step.data() + m0;
        switch (std::min<int64_t>(8, M - m0)) {
          case 1: tile<1>(xr, KG, w0, w1, 32 * p, N, l, st, sp, rs, bp, yr); break;
          case 2: tile<2>(xr, KG, w0, w1, 32 * p, N, l, st, sp, rs, bp, yr); break;
          case 3: tile<3>(xr, KG, w0, w1, 32 * p, N, l, st, sp, rs, bp, yr); break;
          case 4: tile<4>(xr, KG, w0, w1, 32 * p, N, l, st, sp, rs, bp, yr); break;
          case 5: tile<5>(xr, KG, w0, w1, 32 * p, N, l, st, sp, rs, bp, yr); break;
          case 6: tile<6>(xr, KG, w0, w1, 32 * p, N, l, st, sp, rs, bp, yr); break;
          case 7: tile<7>(xr, KG, w0, w1, 32 * p, N, l, st, sp, rs, bp, yr); break;
          default: tile<8>(xr, KG, w0, w1, 32 * p, N, l, st, sp, rs, bp, yr);
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(duolm_int8, m) {
  m.def("linear(Tensor x, Tensor packed, Tensor scale, Tensor row_sums, Tensor? bias, int N) -> Tensor");
}

TORCH_LIBRARY_IMPL(duolm_int8, CPU, m) { m.impl("linear", &linear); }
