// pdserve: the model's pointwise ops on CPU in one pass each, float32 (kernels/cpu_native.py
// builds them with cpu_attention.cpp into one module).
//
// The torch reference (kernels/pointwise_ref.py) runs RMSNorm as six ops, rotary as ten and
// SiLU-and-mul as three, each a pass over memory and a dispatch: at decode sizes the
// dispatches, at prefill sizes the passes, are what they cost. Here each is one loop over
// rows, torch's threads over rows; the arithmetic is the reference's, in float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

// rows per parallel chunk: a few rows of a 4k hidden are already worth a thread
constexpr int64_t GRAIN = 8;

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.dtype() == torch::kFloat, name, " must be float32");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, " must be [rows, n] with contiguous rows");
}

}  // namespace

// (weight * x / rms(x), None) or, with a residual, (weight * t / rms(t), t) for t = x + residual.
std::vector<torch::Tensor> rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                                    c10::optional<torch::Tensor> residual) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dtype() == torch::kFloat && weight.dim() == 1 && weight.size(0) == x.size(1)
              && weight.stride(0) == 1, "weight must be float32 [n], contiguous");
  const int64_t T = x.size(0), H = x.size(1);
  auto out = torch::empty({T, H}, x.options());
  torch::Tensor total;
  const float* rp = nullptr;
  int64_t rs = 0;
  if (residual.has_value()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->size(0) == T && residual->size(1) == H, "residual must match x");
    total = torch::empty({T, H}, x.options());
    rp = residual->data_ptr<float>();
    rs = residual->stride(0);
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float* tp = total.defined() ? total.data_ptr<float>() : nullptr;
  const int64_t xs = x.stride(0);
  const float feps = (float)eps;
  at::parallel_for(0, T, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* xr = xp + t * xs;
      float* orow = op + t * H;
      const float* src = xr;
      if (tp) {
        float* trow = tp + t * H;
        const float* rr = rp + t * rs;
#pragma omp simd
        for (int64_t i = 0; i < H; ++i) trow[i] = xr[i] + rr[i];
        src = trow;
      }
      float ss = 0.f;
#pragma omp simd reduction(+:ss)
      for (int64_t i = 0; i < H; ++i) ss += src[i] * src[i];
      const float inv = 1.f / std::sqrt(ss / (float)H + feps);
#pragma omp simd
      for (int64_t i = 0; i < H; ++i) orow[i] = wp[i] * (src[i] * inv);
    }
  });
  if (residual.has_value()) return {out, total};  // tp is null when there are no rows
  return {out};
}

// q [T, H_q, D] and k [T, H_kv, D] rotated in place (rotate_half pairs i and i + D/2); they may
// be views into one packed qkv row. cos and sin [T, D].
void rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.dtype() == torch::kFloat && k.dtype() == torch::kFloat, "q and k must be float32");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "q [T, H_q, D] and k [T, H_kv, D] must agree");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "q and k need unit stride along head_dim");
  const int64_t T = q.size(0), D = q.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  auto c = cos.to(torch::kFloat).contiguous(), s = sin.to(torch::kFloat).contiguous();
  TORCH_CHECK(c.dim() == 2 && c.size(0) == T && c.size(1) == D && s.sizes() == c.sizes(),
              "cos and sin must be [T, D]");
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const float* cp = c.data_ptr<float>();
  const float* sp = s.data_ptr<float>();
  const int64_t Hq = q.size(1), Hk = k.size(1);
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  at::parallel_for(0, T, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = cp + t * D;
      const float* st = sp + t * D;
      for (int64_t h = 0; h < Hq + Hk; ++h) {
        float* x = h < Hq ? qp + t * qs0 + h * qs1 : kp + t * ks0 + (h - Hq) * ks1;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i], b = x[i + half];
          x[i] = a * ct[i] + (-b) * st[i];
          x[i + half] = b * ct[i + half] + a * st[i + half];
        }
      }
    }
  });
}

// silu(gate) * up for gate_up [T, 2I] -> [T, I]
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, gs = gate_up.stride(0);
  auto out = torch::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* g = gp + t * gs;
      const float* u = g + I;
      float* o = op + t * I;
#pragma omp simd
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}
