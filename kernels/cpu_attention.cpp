// pdserve: decode and prefill attention over the paged KV cache on CPU (kernels/cpu_native.py
// builds it).
//
// Decode: one query token per sequence, float32. q [S, H_q, D]; layer_cache [N, 2, H_kv, B, D], one
// layer's strided view of the cache (rows of D contiguous); context_lens [S]; block_tables
// [S, M]. Work items are (sequence, KV head) pairs over torch's threads; each reads its K and
// V rows once, in place (no gather), for all the query heads of its group, with an online
// softmax block by block. Only positions a query may see are read (from the window's first
// key, or 0, to context_len - 1), so slots behind a window, padding and stale data are never
// touched. Scores stay finite (the running max starts at -FLT_MAX), which -ffast-math needs.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <vector>

namespace {

// The vector width and register block follow the ISA this file is compiled for
// (kernels/cpu_native.py builds one library per ISA and loads the one the CPU runs): a
// vector is one register, and the RB x 2 accumulators of a micro-tile plus the two operand
// vectors and a broadcast fit the register file (AVX-512: 32 zmm, RB 8; AVX2 and SSE: 16
// ymm/xmm, RB 6, as in the classic 6x16 SGEMM tile). A vector wider than a register (the
// AVX-512 sizing compiled for AVX2) spills on every FMA: 0.05x the reference.
#if defined(__AVX512F__)
#define PDSERVE_ISA "avx512"
constexpr int64_t VW = 16;
constexpr int64_t RB = 8;
#elif defined(__AVX2__) && defined(__FMA__)
#define PDSERVE_ISA "avx2"
constexpr int64_t VW = 8;
constexpr int64_t RB = 6;
#elif defined(__AVX__)
#define PDSERVE_ISA "avx"
constexpr int64_t VW = 8;
constexpr int64_t RB = 6;
#else
#define PDSERVE_ISA "sse"
constexpr int64_t VW = 4;
constexpr int64_t RB = 6;
#endif
constexpr int64_t QT = 32;  // query tokens per tile
constexpr int64_t PD = 8;   // decode: rows prefetched ahead
typedef float vf __attribute__((vector_size(VW * sizeof(float))));

inline vf vload(const float* p) { vf v; __builtin_memcpy(&v, p, sizeof(vf)); return v; }
inline void vstore(float* p, vf v) { __builtin_memcpy(p, &v, sizeof(vf)); }

// the sum of a vector's lanes as a tree of halves (a loop over lanes compiles to VW scalar
// adds)
template <int W>
inline float hsum_of(const float* t) {
  if constexpr (W == 1) {
    return t[0];
  } else {
    float h[W / 2];
    for (int i = 0; i < W / 2; ++i) h[i] = t[i] + t[i + W / 2];
    return hsum_of<W / 2>(h);
  }
}
inline float hsum(vf a) {
  float t[VW];
  vstore(t, a);
  return hsum_of<VW>(t);
}

struct Item { int64_t s, h, t0, t1, cost; };

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor cache, torch::Tensor lens,
                           torch::Tensor tables, double scale, int64_t window) {
  TORCH_CHECK(q.dtype() == torch::kFloat && cache.dtype() == torch::kFloat, "float32 only");
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5 && tables.dim() == 2, "bad ranks");
  TORCH_CHECK(q.size(1) % cache.size(2) == 0 && q.size(2) == cache.size(4), "head shapes differ");
  TORCH_CHECK(q.size(2) % 16 == 0, "head_dim must be a multiple of 16");
  const int64_t S = q.size(0), Hq = q.size(1), D = q.size(2), DC = D / VW;
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
  // (sequence, KV head) items taken as threads come free (as in paged_prefill)
  const int64_t items = S * Hkv;
  const int64_t lanes = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, lanes, 1, [&](int64_t, int64_t) {
    std::vector<float> acc(G * D), m(G), l(G), sc(G * B);
    for (int64_t w; (w = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
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
        const float* nkb = nullptr;  // the next block's K rows, if any
        if ((b + 1) * B < ctx && b + 1 < M) {
          const int64_t nxt = tp[s * M + b + 1];
          if (nxt >= 0 && nxt < cache.size(0)) nkb = cp + nxt * sN + h * sH;
        }
        // scores: each K row once for the G heads, VW dims a vector, then summed across
        for (int64_t t = t0; t < t1; ++t) {
          const float* kr = kb + t * sB;
          // K and V rows PD ahead, into the next block at the end of this one: the
          // hardware's prefetchers lag on these 16 KB runs (1.4x at batch 16)
          const float* ahead = t + PD < t1 ? kb + (t + PD) * sB
                               : nkb != nullptr ? nkb + (t + PD - t1) * sB : nullptr;
          if (ahead != nullptr) {
            for (int64_t off = 0; off < D; off += 16) {
              __builtin_prefetch(ahead + off);
              __builtin_prefetch(ahead + sKV + off);
            }
          }
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qs + g * D;
            vf a = vload(qg) * vload(kr);
            for (int64_t dc = 1; dc < DC; ++dc) a += vload(qg + dc * VW) * vload(kr + dc * VW);
            sc[g * B + t - t0] = hsum(a) * fscale;
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
        // acc += P V: a head's VW dims in a register over the block's V rows
        for (int64_t g = 0; g < G; ++g) {
          const float* pg = sc.data() + g * B;
          for (int64_t dc = 0; dc < DC; ++dc) {
            float* ag = acc.data() + g * D + dc * VW;
            vf a = vload(ag);
            for (int64_t t = t0; t < t1; ++t) a += pg[t - t0] * vload(vb + t * sB + dc * VW);
            vstore(ag, a);
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
// Prefill attention over the paged cache, which already holds the new tokens' K/V.
//
// q [T, H_q, D] holds the query tokens of S sequences back to back (cu_seqlens [S + 1]); the
// queries of sequence s are its last q_len positions, ctx - q_len .. ctx - 1, and position p
// sees keys max(p - window + 1, 0) .. p (0 .. p without a window). Work items are (sequence,
// KV head, tile of QT query tokens): the G query heads of the KV head over the tile, QT * G
// rows, attend block by block over the keys any of them sees, flash style (online softmax),
// reading K and V where they lie, once per tile; GQA needs no repeated K/V, and only blocks
// that hold a visible key are read. Within a block, QK^T runs as RB rows x 2 vectors of keys of
// register accumulators over a transposed copy of the K block (D x B, in L1), and PV as RB
// rows x 2 vectors of dims over the V rows; these are GCC/Clang vector types of one
// register of the ISA compiled for (VW, RB above; on AVX-512 RB 8 measured best of 4, 6, 8,
// 16, and two vectors a row 1.1x one, on this project's 2-core AVX-512 machine: ~235-280
// GFLOP/s of causal attention against 70-135 for the reference's SDPA,
// benchmarks/cpu_prefill_attention.py).
// Items, the costliest first, are taken by torch's threads as each comes free (an atomic
// counter): a thread that the OS preempts (a shared machine, or the prefill and decode
// services on the same cores) leaves its share to the others instead of holding the call
// up. D is a multiple of 16 (the caller checks).

torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor cache, torch::Tensor cu_seqlens,
                            torch::Tensor lens, torch::Tensor tables, double scale,
                            int64_t window) {
  TORCH_CHECK(q.dtype() == torch::kFloat && cache.dtype() == torch::kFloat, "float32 only");
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5 && tables.dim() == 2, "bad ranks");
  TORCH_CHECK(q.size(1) % cache.size(2) == 0 && q.size(2) == cache.size(4), "head shapes differ");
  TORCH_CHECK(q.size(2) % 16 == 0 && q.size(2) <= 512, "head_dim must be a multiple of 16, at most 512");
  TORCH_CHECK(cache.stride(4) == 1, "cache rows must be contiguous");
  const int64_t Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = cache.size(2), B = cache.size(3), N = cache.size(0);
  const int64_t G = Hq / Hkv, R = QT * G, DC = D / VW, Bp = (B + VW - 1) / VW * VW;
  auto out = torch::empty_like(q);
  auto qc = q.contiguous();
  auto cu = cu_seqlens.to(torch::kLong).contiguous();
  auto lens64 = lens.to(torch::kLong).contiguous();
  auto tab = tables.to(torch::kLong).contiguous();
  const int64_t S = lens64.size(0), M = tab.size(1);
  TORCH_CHECK(cu.size(0) == S + 1 && tab.size(0) == S, "cu_seqlens, context_lens and block_tables disagree");
  const int64_t* cup = cu.data_ptr<int64_t>();
  const int64_t* lp = lens64.data_ptr<int64_t>();
  const int64_t* tp = tab.data_ptr<int64_t>();
  TORCH_CHECK(cup[S] == q.size(0), "cu_seqlens does not end at the number of query tokens");
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* cp = cache.data_ptr<float>();
  const int64_t sN = cache.stride(0), sKV = cache.stride(1), sH = cache.stride(2), sB = cache.stride(3);
  const float fscale = (float)scale;

  std::vector<Item> items;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = cup[s + 1] - cup[s];
    TORCH_CHECK(q_len >= 0 && q_len <= lp[s], "sequence ", s, " has more queries than context");
    for (int64_t t0 = 0; t0 < q_len; t0 += QT) {
      const int64_t t1 = std::min(t0 + QT, q_len);
      const int64_t last = lp[s] - q_len + t1 - 1;  // the tile's last position
      const int64_t span = window > 0 ? std::min(last + 1, window + QT) : last + 1;
      for (int64_t h = 0; h < Hkv; ++h) items.push_back({s, h, t0, t1, span * (t1 - t0)});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t lanes = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items.size()));

  std::atomic<size_t> next{0};
  at::parallel_for(0, lanes, 1, [&](int64_t, int64_t) {
    std::vector<float> qt(R * D), acc(R * D), kt(D * Bp), sc(R * Bp), m(R), l(R);
    std::vector<int64_t> lo(R), hi(R);
    {
      for (size_t it; (it = next.fetch_add(1, std::memory_order_relaxed)) < items.size();) {
        const Item& w = items[it];
        const int64_t ctx = lp[w.s], q_len = cup[w.s + 1] - cup[w.s];
        const int64_t rows = (w.t1 - w.t0) * G;
        // rows are (token, head) pairs, token-major; each with its visible key range
        for (int64_t t = w.t0; t < w.t1; ++t) {
          const int64_t pos = ctx - q_len + t;
          const float* src = qp + ((cup[w.s] + t) * Hq + w.h * G) * D;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t r = (t - w.t0) * G + g;
            for (int64_t d = 0; d < D; ++d) qt[r * D + d] = src[g * D + d] * fscale;
            lo[r] = window > 0 ? std::max<int64_t>(pos - window + 1, 0) : 0;
            hi[r] = pos + 1;
          }
        }
        std::fill(acc.begin(), acc.begin() + rows * D, 0.f);
        std::fill(m.begin(), m.begin() + rows, -FLT_MAX);
        std::fill(l.begin(), l.begin() + rows, 0.f);
        const int64_t key_lo = lo[0], key_hi = hi[rows - 1];
        for (int64_t b = key_lo / B; b * B < key_hi; ++b) {
          TORCH_CHECK(b < M, "sequence ", w.s, " has more tokens than its block table holds");
          const int64_t blk = tp[w.s * M + b];
          TORCH_CHECK(blk >= 0 && blk < N, "block ", blk, " of sequence ", w.s, " is not in the cache");
          const float* kb = cp + blk * sN + w.h * sH;
          const float* vb = kb + sKV;
          const int64_t j0 = std::max<int64_t>(key_lo - b * B, 0);
          const int64_t j1 = std::min<int64_t>(key_hi - b * B, B);
          const int64_t nj = j1 - j0, njc = (nj + VW - 1) / VW, njp = njc * VW;
          // K block transposed, kt[d * njp + j] (zero past nj), reading K rows in order; the
          // V rows, which PV walks a column at a time, are fetched meanwhile
          for (int64_t j = 0; j < nj; ++j) {
            const float* kr = kb + (j0 + j) * sB;
            for (int64_t off = 0; off < D; off += 16) __builtin_prefetch(vb + (j0 + j) * sB + off);
            for (int64_t d = 0; d < D; ++d) kt[d * njp + j] = kr[d];
          }
          for (int64_t d = 0; d < D; ++d)
            for (int64_t j = nj; j < njp; ++j) kt[d * njp + j] = 0.f;
          // scores: RB rows x 2 vectors of keys at a time (one where one is left)
          for (int64_t r0 = 0; r0 < rows; r0 += RB) {
            const float* qr[RB];
            for (int64_t i = 0; i < RB; ++i) qr[i] = qt.data() + std::min(r0 + i, rows - 1) * D;
            int64_t jc = 0;
            for (; jc + 2 <= njc; jc += 2) {
              vf a[RB] = {}, c[RB] = {};
              const float* kc = kt.data() + jc * VW;
              for (int64_t d = 0; d < D; ++d) {
                const vf k0 = vload(kc + d * njp), k1 = vload(kc + d * njp + VW);
#pragma GCC unroll 8
                for (int64_t i = 0; i < RB; ++i) { a[i] += qr[i][d] * k0; c[i] += qr[i][d] * k1; }
              }
              for (int64_t i = 0; i < RB && r0 + i < rows; ++i) {
                vstore(sc.data() + (r0 + i) * Bp + jc * VW, a[i]);
                vstore(sc.data() + (r0 + i) * Bp + jc * VW + VW, c[i]);
              }
            }
            for (; jc < njc; ++jc) {
              vf a[RB] = {};
              for (int64_t d = 0; d < D; ++d) {
                const vf k = vload(kt.data() + d * njp + jc * VW);
#pragma GCC unroll 8
                for (int64_t i = 0; i < RB; ++i) a[i] += qr[i][d] * k;
              }
              for (int64_t i = 0; i < RB && r0 + i < rows; ++i) vstore(sc.data() + (r0 + i) * Bp + jc * VW, a[i]);
            }
          }
          // online softmax per row over the keys it sees in this block; others weigh 0
          for (int64_t r = 0; r < rows; ++r) {
            float* sr = sc.data() + r * Bp;
            const int64_t a = std::max<int64_t>(lo[r] - b * B, j0) - j0;
            const int64_t e = std::min<int64_t>(hi[r] - b * B, j1) - j0;
            if (e <= a) { std::fill(sr, sr + njp, 0.f); continue; }
            float mx = m[r];
            for (int64_t j = a; j < e; ++j) mx = std::max(mx, sr[j]);
            const float corr = std::exp(m[r] - mx);
            float lsum = 0.f;
            for (int64_t j = 0; j < a; ++j) sr[j] = 0.f;
#pragma omp simd reduction(+:lsum)
            for (int64_t j = a; j < e; ++j) { sr[j] = std::exp(sr[j] - mx); lsum += sr[j]; }
            for (int64_t j = e; j < njp; ++j) sr[j] = 0.f;
            l[r] = l[r] * corr + lsum;
            m[r] = mx;
            float* ar = acc.data() + r * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) ar[d] *= corr;
          }
          // acc += P V: RB rows x 2 vectors of dims at a time (one where one is left)
          for (int64_t r0 = 0; r0 < rows; r0 += RB) {
            const float* pr[RB];
            float* ar[RB];
            for (int64_t i = 0; i < RB; ++i) {
              pr[i] = sc.data() + std::min(r0 + i, rows - 1) * Bp;
              ar[i] = acc.data() + std::min(r0 + i, rows - 1) * D;
            }
            int64_t dc = 0;
            for (; dc + 2 <= DC; dc += 2) {
              vf a[RB], c[RB];
              for (int64_t i = 0; i < RB; ++i) { a[i] = vload(ar[i] + dc * VW); c[i] = vload(ar[i] + dc * VW + VW); }
              for (int64_t j = 0; j < nj; ++j) {
                const float* vr = vb + (j0 + j) * sB + dc * VW;
                const vf v0 = vload(vr), v1 = vload(vr + VW);
#pragma GCC unroll 8
                for (int64_t i = 0; i < RB; ++i) { a[i] += pr[i][j] * v0; c[i] += pr[i][j] * v1; }
              }
              for (int64_t i = 0; i < RB && r0 + i < rows; ++i) { vstore(ar[i] + dc * VW, a[i]); vstore(ar[i] + dc * VW + VW, c[i]); }
            }
            for (; dc < DC; ++dc) {
              vf a[RB];
              for (int64_t i = 0; i < RB; ++i) a[i] = vload(ar[i] + dc * VW);
              for (int64_t j = 0; j < nj; ++j) {
                const vf v = vload(vb + (j0 + j) * sB + dc * VW);
#pragma GCC unroll 8
                for (int64_t i = 0; i < RB; ++i) a[i] += pr[i][j] * v;
              }
              for (int64_t i = 0; i < RB && r0 + i < rows; ++i) vstore(ar[i] + dc * VW, a[i]);
            }
          }
        }
        for (int64_t t = w.t0; t < w.t1; ++t) {
          float* dst = op + ((cup[w.s] + t) * Hq + w.h * G) * D;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t r = (t - w.t0) * G + g;
            const float inv = 1.f / l[r];
            for (int64_t d = 0; d < D; ++d) dst[g * D + d] = acc[r * D + d] * inv;
          }
        }
      }
    }
  });
  return out;
}

// The GIL is released while it runs, as torch releases it in its own ops: the service's
// event loop keeps serving (pulls, heartbeats) during a decode step.
// cpu_pointwise.cpp
std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                    c10::optional<torch::Tensor> residual);
void rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_and_mul(torch::Tensor gate_up);

// The ISA this library was compiled for (kernels/cpu_native.py checks it after loading).
std::string isa() { return PDSERVE_ISA; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa);
  m.def("paged_decode", &paged_decode, py::call_guard<py::gil_scoped_release>());
  m.def("paged_prefill", &paged_prefill, py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, py::call_guard<py::gil_scoped_release>());
  m.def("rotary", &rotary, py::call_guard<py::gil_scoped_release>());
  m.def("silu_and_mul", &silu_and_mul, py::call_guard<py::gil_scoped_release>());
}

