// Decode attention that reads every K/V entry once, in place in the paged cache: no gather of
// each row's blocks into a padded buffer, no GQA expansion, no mask tensor. Two passes over a
// sequence's keys (scores, then the weighted sum of values), fp32 accumulation whatever the
// cache dtype.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float dot(const float* q, const T* k, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < n; ++d) acc += q[d] * static_cast<float>(k[d]);
  return acc;
}

// One task per sequence: its slots are visited once, in block order, and every query head
// scores its KV head's key while the slot's [Hk, D] row is in cache. (Per (sequence, KV head)
// tasks touched each slot Hk times, half a cache line apart.) With fewer sequences than threads
// (batch 1, say) that leaves threads idle, so then a task is one (sequence, KV head): the
// slot's row is read in Hk pieces, but every thread works.
template <typename T>
void decode(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& tables,
            const at::Tensor& lens, const at::Tensor& lo, const at::Tensor& sinks, double scale, bool latent,
            at::Tensor& out, at::Tensor& mass) {
  const int64_t B = q.size(0), Hq = q.size(1), Dq = q.size(2);
  const int64_t bs = kc.size(1), Hk = kc.size(2), Dk = kc.size(3), Dv = vc.size(3);
  const int64_t G = Hq / Hk, W = tables.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* op = lo.data_ptr<int64_t>();
  const float* sp = sinks.numel() ? sinks.data_ptr<float>() : nullptr;
  float* mp = mass.numel() ? mass.data_ptr<float>() : nullptr;  // [B, Hk, W]: attention per table block
  T* outp = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  // KV heads [h0, h1) of row b: their query heads [h0 * G, h1 * G)
  auto attend = [&](int64_t b, int64_t h0, int64_t h1, std::vector<float>& qf, std::vector<float>& acc,
                    std::vector<float>& scores) {
    const int64_t n = lp[b], first = op[b], span = std::max<int64_t>(n - first, 0);
    const int64_t q0 = h0 * G, q1 = h1 * G;
    const int64_t* table = tp + b * W;
    for (int64_t j = q0 * Dq; j < q1 * Dq; ++j) qf[j] = static_cast<float>(qp[b * Hq * Dq + j]) * fscale;
    scores.resize(span * Hq);  // [Hq][span]
    for (int64_t i = first; i < n;) {
      const int64_t block = table[i / bs], stop = std::min(n, (i / bs + 1) * bs);
      for (; i < stop; ++i) {
        const int64_t slot = block * bs + i % bs;
        for (int64_t h = h0; h < h1; ++h) {
          const T* k = kp + (slot * Hk + h) * Dk;
          const T* v = vp + (slot * Hk + h) * Dv;
          for (int64_t g = 0; g < G; ++g) {
            const int64_t head = h * G + g;
            const float* qh = qf.data() + head * Dq;
            // MLA's latent keys: the key is [latent; rope key] and the latent is also the value
            scores[head * span + i - first] = latent ? dot(qh, v, Dv) + dot(qh + Dv, k, Dk) : dot(qh, k, Dk);
          }
        }
      }
    }
    for (int64_t head = q0; head < q1; ++head) {
      float* sh = scores.data() + head * span;
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t j = 0; j < span; ++j) mx = std::max(mx, sh[j]);
      // a sink joins the softmax as one more logit, with no value (gpt-oss)
      if (sp) mx = std::max(mx, sp[head]);
      float den = sp ? std::exp(sp[head] - mx) : 0.f;
      for (int64_t j = 0; j < span; ++j) {
        sh[j] = std::exp(sh[j] - mx);
        den += sh[j];
      }
      const float inv = den > 0.f ? 1.f / den : 0.f;
      for (int64_t j = 0; j < span; ++j) sh[j] *= inv;
      // KV retention's scores: the probability each table block's keys drew (this task owns row
      // b's KV heads [h0, h1), so no other thread writes these entries)
      if (mp) {
        float* mrow = mp + (b * Hk + head / G) * W;
        for (int64_t j = 0; j < span; ++j) mrow[(first + j) / bs] += sh[j];
      }
    }
    std::fill(acc.begin() + q0 * Dv, acc.begin() + q1 * Dv, 0.f);
    for (int64_t i = first; i < n;) {
      const int64_t block = table[i / bs], stop = std::min(n, (i / bs + 1) * bs);
      for (; i < stop; ++i) {
        const T* vslot = vp + (block * bs + i % bs) * Hk * Dv;
        for (int64_t head = q0; head < q1; ++head) {
          const float w = scores[head * span + i - first];
          const T* v = vslot + (head / G) * Dv;
          float* a = acc.data() + head * Dv;
#pragma omp simd
          for (int64_t d = 0; d < Dv; ++d) a[d] += w * static_cast<float>(v[d]);
        }
      }
    }
    for (int64_t j = q0 * Dv; j < q1 * Dv; ++j) outp[b * Hq * Dv + j] = static_cast<T>(acc[j]);
  };
  const bool per_head = B < at::get_num_threads() && Hk > 1;
  at::parallel_for(0, per_head ? B * Hk : B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(Hq * Dq), acc(Hq * Dv), scores;
    for (int64_t t = begin; t < end; ++t) {
      if (per_head)
        attend(t / Hk, t % Hk, t % Hk + 1, qf, acc, scores);
      else
        attend(t, 0, Hk, qf, acc, scores);
    }
  });
}

}  // namespace

static void check_rows(const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& lo, int64_t block_size,
                int64_t blocks) {
  const int64_t capacity = tables.size(1) * block_size;
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* op = lo.data_ptr<int64_t>();
  for (int64_t b = 0; b < tables.size(0); ++b) {
    TORCH_CHECK(lp[b] >= 0 && lp[b] <= capacity, "paged_decode: row ", b, " has ", lp[b], " keys, its table holds ",
                capacity);
    TORCH_CHECK(op[b] >= 0, "paged_decode: row ", b, " starts at key ", op[b]);
  }
  for (int64_t j = 0; j < tables.numel(); ++j)
    TORCH_CHECK(tp[j] >= 0 && tp[j] < blocks, "paged_decode: block id ", tp[j], " outside the cache's ", blocks);
}

// q [B, Hq, Dq]; k_cache [blocks, block_size, Hk, Dk]; v_cache [blocks, block_size, Hk, Dv];
// tables [B, W] int64 (each row's blocks, padded); lens [B]: keys of each row, counted from its
// table's first slot; lo [B]: the first key each row sees (sliding window; 0 otherwise); sinks
// [Hq] fp32 or empty; checked: skip the rows' checks (see below); mass: [B, Hk, W] fp32 to which
// each table block's attention probability (summed over its query heads) is added, or empty.
// Returns [B, Hq, Dv].
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& tables, const at::Tensor& lens, const at::Tensor& lo, const at::Tensor& sinks,
                        double scale, bool latent, bool checked, at::Tensor mass) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_decode: bad ranks");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous() && tables.is_contiguous(),
              "paged_decode: inputs must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(),
              "paged_decode: q and the cache must share a dtype");
  TORCH_CHECK(k_cache.size(2) > 0 && q.size(1) % k_cache.size(2) == 0,
              "paged_decode: query heads not a multiple of KV heads");
  TORCH_CHECK(v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == k_cache.size(1) &&
                  v_cache.size(2) == k_cache.size(2),
              "paged_decode: K and V caches differ in blocks, block size or heads");
  TORCH_CHECK(tables.dim() == 2, "paged_decode: tables must be [rows, blocks]");
  TORCH_CHECK(sinks.numel() == 0 || (sinks.scalar_type() == at::kFloat && sinks.is_contiguous() &&
                                     sinks.numel() == q.size(1)),
              "paged_decode: sinks must be fp32, one per query head");
  TORCH_CHECK(latent ? q.size(2) == v_cache.size(3) + k_cache.size(3) : q.size(2) == k_cache.size(3),
              "paged_decode: query width does not match the keys");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong && lo.scalar_type() == at::kLong &&
                  lens.is_contiguous() && lo.is_contiguous() && lens.numel() == q.size(0) && lo.numel() == q.size(0) &&
                  tables.size(0) == q.size(0),
              "paged_decode: tables, lens and lo must be contiguous int64, one row per query");
  TORCH_CHECK(mass.numel() == 0 || (mass.scalar_type() == at::kFloat && mass.is_contiguous() && mass.dim() == 3 &&
                                    mass.size(0) == q.size(0) && mass.size(1) == k_cache.size(2) &&
                                    mass.size(2) == tables.size(1)),
              "paged_decode: mass must be fp32 [rows, KV heads, table width]");
  // a row that claims more keys than its table holds would read other sequences' blocks (or
  // beyond the cache): refuse it here rather than read garbage. checked: the caller already ran
  // these checks on these very tables, lens and lo against a cache of this shape (the first
  // layer of a step does; the rest of the step's layers share them)
  if (!checked) check_rows(tables, lens, lo, k_cache.size(1), k_cache.size(0));
  auto out = at::empty({q.size(0), q.size(1), v_cache.size(3)}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(q, k_cache, v_cache, tables, lens, lo, sinks, scale, latent, out, mass);
  });
  return out;
}

// A torch op (torch.ops.moectl.paged_decode) rather than a Python module: the build needs only
// ATen's headers, not torch/extension.h and pybind11, which cuts its compile time severalfold.
TORCH_LIBRARY(moectl, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lens, Tensor lo, "
        "Tensor sinks, float scale, bool latent, bool checked, Tensor(a!) mass) -> Tensor");
  m.impl("paged_decode", c10::DispatchKey::CPU, TORCH_FN(paged_decode));
}
