// pdserve: decode attention over the paged KV cache on CPU (kernels/cpu_native.py builds it).
//
// One query token per sequence, float32. q [S, H_q, D]; layer_cache [N, 2, H_kv, B, D], one
// layer's strided view of the cache (rows of D contiguous); context_lens [S]; block_tables
// [S, M]. Work items are (sequence, KV head) pairs over torch's threads; each reads its K and
// V rows once, in place (no gather), for all the query heads of its group, with an online
// softmax block by block. Only positions a query may see are read (from the window's first
// key, or 0, to context_len - 1), so slots behind a window, padding and stale data are never
// touched. Scores stay finite (the running max starts at -FLT_MAX), which -ffast-math needs.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <vector>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor cache, torch::Tensor lens,
                           torch::Tensor tables, double scale, int64_t window) {
  TORCH_CHECK(q.dtype() == torch::kFloat && cache.dtype() == torch::kFloat, "float32 only");
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5 && tables.dim() == 2, "bad ranks");
  TORCH_CHECK(q.size(1) % cache.size(2) == 0 && q.size(2) == cache.size(4), "head shapes differ");
  const int64_t S = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = cache.size(2), B = cache.size(3);
  const int64_t G = Hq / Hkv;
  auto out = torch::empty_like(q);
  auto qc = q.contiguous();
  auto lens64 = lens.to(torch::kLong).contiguous();
  auto tab = tables.to(torch::kLong).contiguous();
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* cp = cache.data_ptr<float>();
  const int64_t sN = cache.stride(0), sKV = cache.stride(1), sH = cache.stride(2), sB = cache.stride(3);
  TORCH_CHECK(cache.stride(4) == 1, "cache rows must be contiguous");
  const int64_t* lp = lens64.data_ptr<int64_t>();
  const int64_t* tp = tab.data_ptr<int64_t>();
  const int64_t M = tab.size(1);
  const float fscale = (float)scale;
  at::parallel_for(0, S * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(G * D), m(G), l(G), sc(G * B);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t s = w / Hkv, h = w % Hkv;
      const int64_t ctx = lp[s];
      const int64_t first = window > 0 ? std::max<int64_t>(ctx - window, 0) : 0;
      const float* qs = qp + (s * Hq + h * G) * D;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -FLT_MAX);
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t b = first / B; b * B < ctx; ++b) {
        TORCH_CHECK(b < M, "sequence ", s, " has more tokens than its block table holds");
        const int64_t blk = tp[s * M + b];
        TORCH_CHECK(blk >= 0 && blk < cache.size(0), "block ", blk, " of sequence ", s, " is not in the cache");
        const float* kb = cp + blk * sN + h * sH;
        const float* vb = kb + sKV;
        const int64_t t0 = std::max<int64_t>(b * B, first) - b * B;
        const int64_t t1 = std::min<int64_t>(ctx - b * B, B);
        const int64_t n = t1 - t0;
        for (int64_t t = t0; t < t1; ++t) {
          const float* kr = kb + t * sB;
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qs + g * D;
            float dot = 0.f;
#pragma omp simd reduction(+:dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * kr[d];
            sc[g * B + t - t0] = dot * fscale;
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          float* sg = sc.data() + g * B;
          float mx = m[g];
          for (int64_t i = 0; i < n; ++i) mx = std::max(mx, sg[i]);
          const float corr = std::exp(m[g] - mx);
          float lsum = 0.f;
#pragma omp simd reduction(+:lsum)
          for (int64_t i = 0; i < n; ++i) { sg[i] = std::exp(sg[i] - mx); lsum += sg[i]; }
          l[g] = l[g] * corr + lsum;
          m[g] = mx;
          float* ag = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) ag[d] *= corr;
        }
        for (int64_t t = t0; t < t1; ++t) {
          const float* vr = vb + t * sB;
          for (int64_t g = 0; g < G; ++g) {
            const float p = sc[g * B + t - t0];
            float* ag = acc.data() + g * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ag[d] += p * vr[d];
          }
        }
      }
      float* os = op + (s * Hq + h * G) * D;
      for (int64_t g = 0; g < G; ++g) {
        const float inv = 1.f / l[g];
        for (int64_t d = 0; d < D; ++d) os[g * D + d] = acc[g * D + d] * inv;
      }
    }
  });
  return out;
}
// The GIL is released while it runs, as torch releases it in its own ops: the service's
// event loop keeps serving (pulls, heartbeats) during a decode step.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, py::call_guard<py::gil_scoped_release>());
}

