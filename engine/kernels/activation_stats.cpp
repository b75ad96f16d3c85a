// The numerics watch's one pass over an activation: its largest |x|, its largest row sum of x^2
// (what a half-precision accumulation of a norm's mean square would hold), and whether it holds an
// inf or a NaN, max-merged into a 3-float slot in place. One dispatch per tensor instead of the
// four or five torch ops the same figures take, so the watch can stay on every step.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

template <typename T>
void stats(const at::Tensor& x, float* slot) {
  const int64_t width = x.size(-1), rows = width ? x.numel() / width : 0;
  const T* p = x.data_ptr<T>();
  const int threads = at::get_num_threads();
  std::vector<float> amax(threads, 0.f), sumsq(threads, 0.f);
  std::vector<char> bad(threads, 0);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    const int t = at::get_thread_num();
    float a = 0.f, s = 0.f;
    bool nonfinite = false;
    for (int64_t r = begin; r < end; ++r) {
      const T* row = p + r * width;
      double acc = 0.0;  // in double, so only an inf or a NaN in the row makes it non-finite
      float m = 0.f;
      for (int64_t d = 0; d < width; ++d) {
        const float v = static_cast<float>(row[d]);
        acc += static_cast<double>(v) * v;
        m = std::max(m, std::fabs(v));
      }
      // a NaN compares false, so max() would drop it: count it apart
      nonfinite |= !std::isfinite(acc);
      a = std::max(a, m);
      s = std::max(s, static_cast<float>(std::min(acc, 3.0e38)));
    }
    amax[t] = std::max(amax[t], a);
    sumsq[t] = std::max(sumsq[t], s);
    bad[t] |= nonfinite;
  });
  for (int t = 0; t < threads; ++t) {
    slot[0] = std::max(slot[0], amax[t]);
    slot[1] = std::max(slot[1], sumsq[t]);
    if (bad[t]) slot[2] = 1.f;
  }
}

}  // namespace

// x: any float tensor on the CPU, contiguous, rows along its last dimension; slot: 3 fp32
// values (max |x|, max row sum of x^2, nonfinite flag) updated in place.
void note(const at::Tensor& x, at::Tensor slot) {
  TORCH_CHECK(x.is_contiguous() && x.dim() >= 1, "activation_stats: x must be contiguous");
  TORCH_CHECK(slot.scalar_type() == at::kFloat && slot.is_contiguous() && slot.numel() == 3,
              "activation_stats: slot must be 3 contiguous fp32 values");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "activation_stats", [&] {
    stats<scalar_t>(x, slot.data_ptr<float>());
  });
}

// Many small tensors in one call: xs[i] merged into buffer's slot slots[i] (buffer [slots, 3]
// fp32). A decode step's activations are a few rows each, where a dispatch per tensor costs
// more than the pass itself: the watch gathers them and notes them all at the step's end.
void note_many(at::TensorList xs, at::IntArrayRef slots, at::Tensor buffer) {
  TORCH_CHECK(xs.size() == slots.size(), "activation_stats: one slot per tensor");
  TORCH_CHECK(buffer.scalar_type() == at::kFloat && buffer.is_contiguous() && buffer.dim() == 2 && buffer.size(1) == 3,
              "activation_stats: buffer must be contiguous fp32 [slots, 3]");
  float* base = buffer.data_ptr<float>();
  for (size_t i = 0; i < xs.size(); ++i) {
    TORCH_CHECK(slots[i] >= 0 && slots[i] < buffer.size(0), "activation_stats: slot ", slots[i], " out of range");
    const at::Tensor x = xs[i].contiguous();
    if (x.numel() == 0) continue;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "activation_stats", [&] {
      stats<scalar_t>(x, base + slots[i] * 3);
    });
  }
}

TORCH_LIBRARY(moectl_watch, m) {
  m.def("note(Tensor x, Tensor(a!) slot) -> ()");
  m.def("note_many(Tensor[] xs, int[] slots, Tensor(a!) buffer) -> ()");
  m.impl("note", c10::DispatchKey::CPU, TORCH_FN(note));
  m.impl("note_many", c10::DispatchKey::CPU, TORCH_FN(note_many));
}
