// A decode step's weight-bound work at small batch, fp32 on a CPU: linear layers and the routed
// experts of an MoE layer for a few tokens, and their RMSNorms (whose cost there is all
// dispatch). There the work is reading each weight once; the BLAS path reads it at about half
// the rate this code does (bench/small_batch_bench.py), and the experts' per-expert loop in
// Python costs a dozen dispatches per expert. Each weight row is read once, its dot product
// taken with every input row while it is in cache, and the rows are split across torch's
// threads. Anything the ops do not take goes back to the torch path.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/rms_norm.h>
#include <ATen/ops/silu.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kMaxRows = 4;  // linear: the input rows it takes (bench/small_batch_bench.py times 1, 2 and 4)
constexpr int64_t kTileRows = 8;  // rows one register tile covers: 8 accumulators + a weight vector

#if defined(__AVX2__) && defined(__FMA__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// out[m * ldo + j] = x[m] . w[j] (+ b[j]) for every m < M and j in [lo, hi); x rows K apart
template <int M>
void rows(const float* x, const float* w, const float* b, float* out, int64_t K, int64_t ldo, int64_t lo,
          int64_t hi) {
  for (int64_t j = lo; j < hi; ++j) {
    const float* wj = w + j * K;
    float sums[M];
    int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    for (; k + 8 <= K; k += 8) {
      const __m256 wv = _mm256_loadu_ps(wj + k);
      for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), wv, acc[m]);
    }
    for (int m = 0; m < M; ++m) sums[m] = hsum(acc[m]);
#else
    for (int m = 0; m < M; ++m) sums[m] = 0.f;
#endif
    for (int m = 0; m < M; ++m) {
      for (int64_t r = k; r < K; ++r) sums[m] += x[m * K + r] * wj[r];
      out[m * ldo + j] = sums[m] + (b ? b[j] : 0.f);
    }
  }
}

void rows_any(int64_t M, const float* x, const float* w, const float* b, float* out, int64_t K, int64_t ldo,
              int64_t lo, int64_t hi) {
  switch (M) {
    case 1: rows<1>(x, w, b, out, K, ldo, lo, hi); break;
    case 2: rows<2>(x, w, b, out, K, ldo, lo, hi); break;
    case 3: rows<3>(x, w, b, out, K, ldo, lo, hi); break;
    case 4: rows<4>(x, w, b, out, K, ldo, lo, hi); break;
    case 5: rows<5>(x, w, b, out, K, ldo, lo, hi); break;
    case 6: rows<6>(x, w, b, out, K, ldo, lo, hi); break;
    case 7: rows<7>(x, w, b, out, K, ldo, lo, hi); break;
    default: rows<8>(x, w, b, out, K, ldo, lo, hi); break;
  }
}

bool cpu_float(const at::Tensor& t) { return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(); }

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  const bool bias_ok = !bias.has_value() || (cpu_float(*bias) && bias->dim() == 1 && bias->size(0) == w.size(0));
  if (x.dim() != 2 || w.dim() != 2 || x.size(0) == 0 || x.size(0) > kMaxRows || !cpu_float(x) || !cpu_float(w) ||
      x.size(1) != w.size(1) || !bias_ok) {
    return at::linear(x, w, bias);
  }
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  // about 64 KiB of W per task: a small layer stays on one thread (waking another costs more
  // than it saves), a large one (the LM head) is split across all of them
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, K * 4));
  at::parallel_for(0, N, grain, [&](int64_t lo, int64_t hi) { rows_any(M, xp, wp, bp, op, K, N, lo, hi); });
  return out;
}

// SwiGLU of n rows through one expert (w13 [2I, H], w2 [H, I]), kTileRows rows at a time: the
// same arithmetic for a row whichever op runs it (the tiles' rows never mix)
void small_group(const float* x, const float* w13, const float* w2, float* out, int64_t n, int64_t H, int64_t I,
                 std::vector<float>& gate_up, std::vector<float>& act) {
  for (int64_t r = 0; r < n; r += kTileRows) {
    const int64_t m = std::min(kTileRows, n - r);
    rows_any(m, x + r * H, w13, nullptr, gate_up.data(), H, 2 * I, 0, 2 * I);
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < I; ++j) {
        const float g = gate_up[i * 2 * I + j];
        act[i * I + j] = g / (1.f + std::exp(-g)) * gate_up[i * 2 * I + I + j];
      }
    rows_any(m, act.data(), w2, nullptr, out + r * H, I, H, 0, H);
  }
}

// The routed experts of a few tokens, SwiGLU (gate and up stacked in w13 [E, 2I, H], down in
// w2 [E, H, I]): out[t] = sum_j weights[t, j] * down(silu(gate) * up)(x[t]) over the token's
// chosen experts ids[t, j], the terms summed in j order. One task per (token, choice): the
// expert's weights are read once per token that chose it.
at::Tensor small_experts(const at::Tensor& x, const at::Tensor& weights, const at::Tensor& ids, const at::Tensor& w13,
                         const at::Tensor& w2) {
  TORCH_CHECK(x.dim() == 2 && weights.dim() == 2 && ids.sizes() == weights.sizes() && ids.size(0) == x.size(0) &&
                  w13.dim() == 3 && w2.dim() == 3,
              "small_experts: x [N, H], weights and ids [N, k], w13 [E, 2I, H], w2 [E, H, I]");
  TORCH_CHECK(cpu_float(x) && cpu_float(weights) && cpu_float(w13) && cpu_float(w2) && ids.is_contiguous() &&
                  ids.scalar_type() == at::kLong,
              "small_experts: contiguous fp32 tensors on the CPU, int64 ids");
  const int64_t N = x.size(0), k = ids.size(1), H = x.size(1), E = w13.size(0), I = w2.size(2);
  TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) == H && w2.size(0) == E && w2.size(1) == H,
              "small_experts: w13 [E, 2I, H] and w2 [E, H, I] for hidden ", H);
  const int64_t* idp = ids.data_ptr<int64_t>();
  for (int64_t p = 0; p < N * k; ++p) TORCH_CHECK(idp[p] >= 0 && idp[p] < E, "small_experts: expert id out of range");
  const float* xp = x.data_ptr<float>();
  const float* w13p = w13.data_ptr<float>();
  const float* w2p = w2.data_ptr<float>();
  std::vector<float> terms(N * k * H);
  at::parallel_for(0, N * k, 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> gate_up(kTileRows * 2 * I), act(kTileRows * I);
    for (int64_t p = lo; p < hi; ++p) {
      const int64_t e = idp[p];
      small_group(xp + (p / k) * H, w13p + e * 2 * I * H, w2p + e * H * I, terms.data() + p * H, 1, H, I, gate_up, act);
    }
  });
  auto out = at::zeros({N, H}, x.options());
  float* op = out.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  for (int64_t t = 0; t < N; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const float scale = wp[t * k + j];
      const float* term = terms.data() + (t * k + j) * H;
      for (int64_t h = 0; h < H; ++h) op[t * H + h] += scale * term[h];
    }
  return out;
}

// SwiGLU experts over tokens already grouped: group g is rows[g] consecutive rows of x_grouped
// for the expert whose weights are w13[ids[g]], w2[ids[g]]. A decode batch's groups (at most
// kGroupRows rows) are one task each, which reads the expert's weights once for its rows,
// kTileRows rows at a time: torch._grouped_mm on a CPU is a GEMM call per expert, and at a few
// rows each those calls cost more than reading the weights does (the bench's grouped rows).
// Larger groups take torch's own ops (at::linear, at::silu), one after another, each on all
// threads. A group's
// result depends only on its rows and weights (its size picks the path), never on the other
// groups: the same rows of an expert get the same bits on one device, on placed devices and
// from the expert cache.
constexpr int64_t kGroupRows = 16;

at::Tensor grouped_swiglu(const at::Tensor& x_grouped, const at::Tensor& ids, const at::Tensor& rows_per_group,
                          const at::Tensor& w13, const at::Tensor& w2) {
  TORCH_CHECK(x_grouped.dim() == 2 && cpu_float(x_grouped) && cpu_float(w13) && cpu_float(w2) && w13.dim() == 3 &&
                  w2.dim() == 3,
              "grouped_swiglu: contiguous fp32 x_grouped [R, H], w13 [E, 2I, H], w2 [E, H, I] on the CPU");
  TORCH_CHECK(ids.dim() == 1 && rows_per_group.sizes() == ids.sizes() && ids.scalar_type() == at::kLong &&
                  rows_per_group.scalar_type() == at::kLong && ids.device().is_cpu() &&
                  rows_per_group.device().is_cpu() && ids.is_contiguous() && rows_per_group.is_contiguous(),
              "grouped_swiglu: ids and rows, int64 [G] on the CPU");
  const int64_t R = x_grouped.size(0), H = x_grouped.size(1), E = w13.size(0), I = w2.size(2), G = ids.size(0);
  TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) == H && w2.size(0) == E && w2.size(1) == H,
              "grouped_swiglu: shapes do not match (hidden ", H, ", experts ", E, ")");
  const int64_t* idp = ids.data_ptr<int64_t>();
  const int64_t* np = rows_per_group.data_ptr<int64_t>();
  std::vector<int64_t> starts(G + 1, 0), small, large;
  for (int64_t g = 0; g < G; ++g) {
    TORCH_CHECK(np[g] >= 0 && np[g] <= R - starts[g] && idp[g] >= 0 && idp[g] < E, "grouped_swiglu: group ", g,
                " has expert ", idp[g], " of ", E, " and ", np[g], " rows (", R - starts[g], " left)");
    starts[g + 1] = starts[g] + np[g];
    if (np[g]) (np[g] <= kGroupRows ? small : large).push_back(g);
  }
  TORCH_CHECK(starts[G] == R, "grouped_swiglu: the groups hold ", starts[G], " rows, not the ", R, " given");
  auto out = at::empty({R, H}, x_grouped.options());
  for (int64_t g : large) {
    const auto x = x_grouped.narrow(0, starts[g], np[g]);
    const auto gate_up = at::linear(x, w13[idp[g]]).chunk(2, -1);
    out.narrow(0, starts[g], np[g]).copy_(at::linear(at::mul(at::silu(gate_up[0]), gate_up[1]), w2[idp[g]]));
  }
  const float* xp = x_grouped.data_ptr<float>();
  const float* w13p = w13.data_ptr<float>();
  const float* w2p = w2.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(small.size()), 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> gate_up(kTileRows * 2 * I), act(kTileRows * I);
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t g = small[t], e = idp[g];
      small_group(xp + starts[g] * H, w13p + e * 2 * I * H, w2p + e * H * I, op + starts[g] * H, np[g], H, I,
                  gate_up, act);
    }
  });
  return out;
}

// RMSNorm of a few fp32 rows: at one row of a few hundred values torch's fused kernel is its
// dispatch and thread start-up, and this loop is the arithmetic alone
at::Tensor small_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  if (x.dim() != 2 || x.size(0) > kMaxRows || !cpu_float(x) || !cpu_float(w) || w.dim() != 1 ||
      w.size(0) != x.size(1)) {
    return at::rms_norm(x, {x.size(-1)}, w, eps);
  }
  const int64_t M = x.size(0), D = x.size(1);
  auto out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* row = xp + m * D;
    float sq = 0.f;
    for (int64_t d = 0; d < D; ++d) sq += row[d] * row[d];
    const float inv = 1.f / std::sqrt(sq / static_cast<float>(D) + static_cast<float>(eps));
    for (int64_t d = 0; d < D; ++d) op[m * D + d] = row[d] * inv * wp[d];
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(moectl_small, m) {
  m.def("linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("experts(Tensor x, Tensor weights, Tensor ids, Tensor w13, Tensor w2) -> Tensor");
  m.impl("linear", c10::DispatchKey::CPU, TORCH_FN(small_linear));
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("grouped_swiglu(Tensor x_grouped, Tensor ids, Tensor rows, Tensor w13, Tensor w2) -> Tensor");
  m.impl("grouped_swiglu", c10::DispatchKey::CPU, TORCH_FN(grouped_swiglu));
  m.impl("experts", c10::DispatchKey::CPU, TORCH_FN(small_experts));
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(small_rms_norm));
}
