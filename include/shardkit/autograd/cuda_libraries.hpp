// cuBLAS and cuDNN for the heavy autograd ops on a CUDA context: per-context handles on the
// context's stream, RAII descriptors, a growing workspace, and the calls themselves (GEMM,
// convolution). What a cuDNN call describes -- its descriptors, and a
// convolution's algorithms (cuDNN's heuristic ranking, or with Libraries::benchmark the fastest
// found by running them, as torch.backends.cudnn.benchmark) -- is made once per shape and kept
// in a per-context cache: after the first step an op costs the host a map lookup, not the
// creation, setting and destruction of two to four descriptors.
// Host code only (library calls, no kernels); compiled when SK_WITH_CUDA.
#pragma once

#include "shardkit/core/config.hpp"

#if SK_WITH_CUDA

#include <cublas_v2.h>
#include <cudnn.h>

#include <algorithm>
#include <array>
#include <map>
#include <memory>
#include <tuple>
#include <utility>
#include <vector>

#include "shardkit/autograd/cpu_conv.hpp"
#include "shardkit/autograd/ranked_algorithms.hpp"
#include "shardkit/core/channels_last.hpp"
#include "shardkit/core/cublas_check.hpp"
#include "shardkit/core/cudnn_check.hpp"
#include "shardkit/core/tensor_ops.hpp"

namespace shardkit::autograd::cuda {

struct ConvAlgorithms {
  RankedAlgorithms<cudnnConvolutionFwdAlgo_t> forward;
  RankedAlgorithms<cudnnConvolutionBwdDataAlgo_t> backward_data;
  RankedAlgorithms<cudnnConvolutionBwdFilterAlgo_t> backward_filter;
};

// One per context (Context::resource): handles bound to the context's stream, the workspace,
// and the convolution algorithm cache keyed by geometry and dtype.
class Libraries {
 public:
  explicit Libraries(Context& ctx) : device_(ctx.device().index) {
    CudaDeviceGuard guard(device_);
    SK_CUBLAS_CHECK(cublasCreate(&blas_));
    SK_CUBLAS_CHECK(cublasSetStream(blas_, ctx.stream()));
    SK_CUDNN_CHECK(cudnnCreate(&dnn_));
    SK_CUDNN_CHECK(cudnnSetStream(dnn_, ctx.stream()));
  }
  ~Libraries() {
    CudaDeviceGuard guard(device_);
    cudnnDestroy(dnn_);
    cublasDestroy(blas_);
  }
  Libraries(const Libraries&) = delete;
  Libraries& operator=(const Libraries&) = delete;

  cublasHandle_t blas() const { return blas_; }
  cudnnHandle_t dnn() const { return dnn_; }

  // TF32 tensor cores for f32 GEMM and convolution: faster, ~1e-3 relative error. Off by
  // default so f32 matches the CPU to 1e-4; PyTorch's convolutions default to on.
  bool allow_tf32 = false;
  // Convolution algorithms that cuDNN marks deterministic, preferred over faster ones that are
  // not (some backward-data and backward-filter algorithms add with atomics, so their last bits
  // vary from run to run), as torch.backends.cudnn.deterministic = True: a captured step then
  // replays the eager step's bits, and a run repeats its own. False takes cuDNN's first choice
  // (PyTorch's default). Plans are kept per setting (conv_plan's key).
  bool deterministic = true;
  // Largest workspace an algorithm may ask for.
  std::size_t workspace_limit = std::size_t{1} << 30;
  // Convolution algorithms found by running every candidate once per shape (cudnnFind*, as
  // torch.backends.cudnn.benchmark = True) instead of cuDNN's heuristic ranking. Off by default:
  // the search synchronises the device and allocates its buffers (so a new shape may not meet
  // it inside a captured step), and its winner -- with it the results' last bits -- can differ
  // from run to run. Set it before the first convolution of a shape: plans are kept per shape.
  bool benchmark = false;

  // A scratch buffer of at least `bytes` (stream-ordered, so reuse across calls is safe).
  // A captured step (core/step_graph.hpp) replays its convolutions with the workspace's address,
  // so a workspace used inside a capture is kept, not freed, when a larger one replaces it (an
  // eager evaluation of larger images, another key's warm-up): freed, its memory could be handed
  // to any later allocation while the graph still writes there. Its successor is then at least
  // twice its size, so what is kept stays below the largest workspace.
  void* workspace(Context& ctx, std::size_t bytes) {
    if (bytes == 0) return nullptr;
    if (!workspace_.defined() || workspace_.nbytes() < bytes) {
      if (workspace_captured_) {
        bytes = std::max(bytes, 2 * workspace_.nbytes());
        kept_for_graphs_.push_back(std::move(workspace_));
      }
      workspace_ = Tensor();  // (freed before its successor is allocated)
      workspace_ = empty(ctx, {static_cast<std::int64_t>(bytes)}, DType::u8, MemoryCategory::other);
      workspace_captured_ = false;
    }
    if (ctx.capturing()) workspace_captured_ = true;
    return workspace_.data_ptr();
  }
  // Workspaces that captured steps use, replaced by larger ones (kept while the context lives).
  std::size_t kept_workspaces() const { return kept_for_graphs_.size(); }

 private:
  int device_;
  cublasHandle_t blas_ = nullptr;
  cudnnHandle_t dnn_ = nullptr;
  Tensor workspace_;
  bool workspace_captured_ = false;      // workspace_ was used inside a capture
  std::vector<Tensor> kept_for_graphs_;  // earlier workspaces that captured steps use
};

inline Libraries& libraries(Context& ctx) {
  return ctx.resource<Libraries>([&ctx] { return std::make_shared<Libraries>(ctx); });
}

inline cudnnDataType_t cudnn_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return CUDNN_DATA_FLOAT;
    case DType::f64:
      return CUDNN_DATA_DOUBLE;
    case DType::f16:
      return CUDNN_DATA_HALF;
    case DType::bf16:
      return CUDNN_DATA_BFLOAT16;
    default:
      break;
  }
  fail<InvalidArgument>("cuDNN ops take f32, f64, f16 or bf16 tensors, got ", dtype_name(dtype));
}

// alpha = 1, beta = 0 (or 1) in the scalar type cuDNN wants: double for double data, else float.
struct Blend {
  float f[3] = {1.0f, 0.0f, 1.0f};
  double d[3] = {1.0, 0.0, 1.0};
  bool wide;
  explicit Blend(DType dtype) : wide(dtype == DType::f64) {}
  const void* one() const { return wide ? static_cast<const void*>(&d[0]) : &f[0]; }
  const void* zero() const { return wide ? static_cast<const void*>(&d[1]) : &f[1]; }
};

// A per-context cache of plans (descriptors, algorithms) by shape: made at a shape's first call,
// found by a map lookup after. One per plan type (Context::resource).
template <class Plan, std::size_t N>
class PlanCache {
 public:
  using Key = std::array<std::int64_t, N>;
  template <class Make>
  Plan& get(const Key& key, Make&& make) {
    auto found = plans_.find(key);
    if (found == plans_.end()) found = plans_.emplace(key, make()).first;
    return *found->second;
  }
  std::size_t size() const { return plans_.size(); }
  std::vector<Key> keys() const {
    std::vector<Key> out;
    for (const auto& entry : plans_) out.push_back(entry.first);
    return out;
  }

 private:
  std::map<Key, std::unique_ptr<Plan>> plans_;
};

template <class Plan, std::size_t N>
PlanCache<Plan, N>& plan_cache(Context& ctx) {
  return ctx.resource<PlanCache<Plan, N>>([] { return std::make_shared<PlanCache<Plan, N>>(); });
}

// A cuDNN descriptor owned for its scope: created here, set by the derived class, destroyed with
// it.
template <class Handle, cudnnStatus_t (*Create)(Handle*), cudnnStatus_t (*Destroy)(Handle)>
class CudnnDescriptor {
 public:
  CudnnDescriptor() { SK_CUDNN_CHECK(Create(&desc_)); }
  ~CudnnDescriptor() { Destroy(desc_); }
  CudnnDescriptor(const CudnnDescriptor&) = delete;
  CudnnDescriptor& operator=(const CudnnDescriptor&) = delete;
  Handle get() const { return desc_; }

 protected:
  Handle desc_ = nullptr;
};

// A 4-D tensor [n, c, h, w] stored NCHW, or NHWC (channels-last: core/channels_last.hpp).
class TensorDesc : public CudnnDescriptor<cudnnTensorDescriptor_t, cudnnCreateTensorDescriptor,
                                          cudnnDestroyTensorDescriptor> {
 public:
  TensorDesc(DType dtype, std::int64_t n, std::int64_t c, std::int64_t h, std::int64_t w,
             bool nhwc = false) {
    SK_CUDNN_CHECK(cudnnSetTensor4dDescriptor(desc_, nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW,
                                              cudnn_type(dtype), int(n), int(c), int(h), int(w)));
  }
};

// A filter [k, c, h, w] stored KCRS, or KRSC beside NHWC tensors (cuDNN's NHWC kernels want
// the filter's channels innermost too, as PyTorch's channels-last convolutions give it).
class FilterDesc : public CudnnDescriptor<cudnnFilterDescriptor_t, cudnnCreateFilterDescriptor,
                                          cudnnDestroyFilterDescriptor> {
 public:
  FilterDesc(DType dtype, std::int64_t k, std::int64_t c, std::int64_t h, std::int64_t w,
             bool nhwc = false) {
    SK_CUDNN_CHECK(cudnnSetFilter4dDescriptor(desc_, cudnn_type(dtype),
                                              nhwc ? CUDNN_TENSOR_NHWC : CUDNN_TENSOR_NCHW, int(k),
                                              int(c), int(h), int(w)));
  }
};

class ConvDesc
    : public CudnnDescriptor<cudnnConvolutionDescriptor_t, cudnnCreateConvolutionDescriptor,
                             cudnnDestroyConvolutionDescriptor> {
 public:
  ConvDesc(const ConvGeometry& g, DType dtype, bool allow_tf32) {
    // Half types accumulate in f32; double in double.
    const cudnnDataType_t compute = dtype == DType::f64 ? CUDNN_DATA_DOUBLE : CUDNN_DATA_FLOAT;
    SK_CUDNN_CHECK(cudnnSetConvolution2dDescriptor(
        desc_, int(g.pad_h), int(g.pad_w), int(g.stride_h), int(g.stride_w), int(g.dilation_h),
        int(g.dilation_w), CUDNN_CROSS_CORRELATION, compute));
    cudnnMathType_t math = CUDNN_TENSOR_OP_MATH;
    if (dtype == DType::f32) math = allow_tf32 ? CUDNN_DEFAULT_MATH : CUDNN_FMA_MATH;
    if (dtype == DType::f64) math = CUDNN_DEFAULT_MATH;
    SK_CUDNN_CHECK(cudnnSetConvolutionMathType(desc_, math));
    // A grouped convolution: the filter descriptor holds a group's input channels.
    if (g.groups > 1) SK_CUDNN_CHECK(cudnnSetConvolutionGroupCount(desc_, int(g.groups)));
  }
};

// The descriptors of one convolution shape and layout and its algorithms, made once
// (conv_plan).
struct ConvPlan {
  TensorDesc x, y;
  FilterDesc w;
  ConvDesc conv;
  ConvAlgorithms algorithms;

  ConvPlan(Context& ctx, const ConvGeometry& g, DType dtype, bool nhwc)
      : x(dtype, g.batch, g.in_channels, g.height, g.width, nhwc),
        y(dtype, g.batch, g.out_channels, g.out_h, g.out_w, nhwc),
        w(dtype, g.out_channels, g.in_channels / g.groups, g.kernel_h, g.kernel_w, nhwc),
        conv(g, dtype, libraries(ctx).allow_tf32) {
    auto& libs = libraries(ctx);
    algorithms = libs.benchmark ? search(ctx, libs, g, dtype) : choose(libs);
  }

 private:
  // cuDNN's heuristics, best first; the first that succeeds within the workspace limit wins
  // (what PyTorch does with cudnn.benchmark off).
  ConvAlgorithms choose(Libraries& libs) {
    ConvAlgorithms a;
    constexpr int kMax = 16;
    int count = 0;
    cudnnConvolutionFwdAlgoPerf_t fwd[kMax];
    SK_CUDNN_CHECK(cudnnGetConvolutionForwardAlgorithm_v7(libs.dnn(), x.get(), w.get(), conv.get(),
                                                          y.get(), kMax, &count, fwd));
    a.forward = ranked_within_limit(fwd, count, libs.workspace_limit, "forward convolution",
                                    libs.deterministic, workspace(libs));
    cudnnConvolutionBwdDataAlgoPerf_t data[kMax];
    SK_CUDNN_CHECK(cudnnGetConvolutionBackwardDataAlgorithm_v7(
        libs.dnn(), w.get(), y.get(), conv.get(), x.get(), kMax, &count, data));
    a.backward_data = ranked_within_limit(data, count, libs.workspace_limit, "backward-data",
                                          libs.deterministic, workspace(libs));
    cudnnConvolutionBwdFilterAlgoPerf_t filter[kMax];
    SK_CUDNN_CHECK(cudnnGetConvolutionBackwardFilterAlgorithm_v7(
        libs.dnn(), x.get(), y.get(), conv.get(), w.get(), kMax, &count, filter));
    a.backward_filter = ranked_within_limit(filter, count, libs.workspace_limit, "backward-filter",
                                            libs.deterministic, workspace(libs));
    return a;
  }

  // ranked_within_limit's question: what an algorithm needs of the workspace with this plan's
  // descriptors, or that they do not support it.
  struct WorkspaceQuery {
    cudnnHandle_t dnn;
    const ConvPlan& plan;
    cudnnStatus_t operator()(cudnnConvolutionFwdAlgo_t algo, std::size_t* bytes) const {
      return cudnnGetConvolutionForwardWorkspaceSize(dnn, plan.x.get(), plan.w.get(),
                                                     plan.conv.get(), plan.y.get(), algo, bytes);
    }
    cudnnStatus_t operator()(cudnnConvolutionBwdDataAlgo_t algo, std::size_t* bytes) const {
      return cudnnGetConvolutionBackwardDataWorkspaceSize(
          dnn, plan.w.get(), plan.y.get(), plan.conv.get(), plan.x.get(), algo, bytes);
    }
    cudnnStatus_t operator()(cudnnConvolutionBwdFilterAlgo_t algo, std::size_t* bytes) const {
      return cudnnGetConvolutionBackwardFilterWorkspaceSize(
          dnn, plan.x.get(), plan.y.get(), plan.conv.get(), plan.w.get(), algo, bytes);
    }
  };
  WorkspaceQuery workspace(Libraries& libs) const { return {libs.dnn(), *this}; }

  // Libraries::benchmark: every candidate run once on scratch buffers of the shape (their
  // contents do not matter to the timing), fastest first; the first that ran within the
  // workspace it was given wins. The scratch and the workspace (at most 256 MiB, or the limit)
  // go back when the search ends.
  ConvAlgorithms search(Context& ctx, Libraries& libs, const ConvGeometry& g, DType dtype) {
    ctx.refuse_in_capture(
        "a cuDNN algorithm search (Libraries::benchmark) for a new convolution "
        "shape",
        "it runs and times every candidate; warm the step up uncaptured first "
        "(StepGraphOptions::warmup_steps)");
    const Tensor xs = empty(ctx, {g.batch, g.in_channels, g.height, g.width}, dtype);
    const Tensor ys = empty(ctx, {g.batch, g.out_channels, g.out_h, g.out_w}, dtype);
    const Tensor ws =
        empty(ctx, {g.out_channels, g.in_channels / g.groups, g.kernel_h, g.kernel_w}, dtype);
    const std::size_t space = std::min(libs.workspace_limit, std::size_t{256} << 20);
    const Tensor scratch = empty(ctx, {static_cast<std::int64_t>(space)}, DType::u8);
    ConvAlgorithms a;
    constexpr int kMax = 16;
    int count = 0;
    cudnnConvolutionFwdAlgoPerf_t fwd[kMax];
    SK_CUDNN_CHECK(cudnnFindConvolutionForwardAlgorithmEx(
        libs.dnn(), x.get(), xs.data_ptr(), w.get(), ws.data_ptr(), conv.get(), y.get(),
        ys.data_ptr(), kMax, &count, fwd, scratch.data_ptr(), space));
    a.forward = ranked_within_limit(fwd, count, space, "forward convolution", libs.deterministic,
                                    workspace(libs));
    cudnnConvolutionBwdDataAlgoPerf_t data[kMax];
    SK_CUDNN_CHECK(cudnnFindConvolutionBackwardDataAlgorithmEx(
        libs.dnn(), w.get(), ws.data_ptr(), y.get(), ys.data_ptr(), conv.get(), x.get(),
        xs.data_ptr(), kMax, &count, data, scratch.data_ptr(), space));
    a.backward_data = ranked_within_limit(data, count, space, "backward-data", libs.deterministic,
                                          workspace(libs));
    cudnnConvolutionBwdFilterAlgoPerf_t filter[kMax];
    SK_CUDNN_CHECK(cudnnFindConvolutionBackwardFilterAlgorithmEx(
        libs.dnn(), x.get(), xs.data_ptr(), y.get(), ys.data_ptr(), conv.get(), w.get(),
        ws.data_ptr(), kMax, &count, filter, scratch.data_ptr(), space));
    a.backward_filter = ranked_within_limit(filter, count, space, "backward-filter",
                                            libs.deterministic, workspace(libs));
    return a;
  }
};

// ctx's convolution plans, keyed by geometry, dtype, TF32, search, the algorithms' limits
// (deterministic ones only, the workspace's bound: a plan made under other limits may break
// them) and layout (NHWC last).
using ConvPlanCache = PlanCache<ConvPlan, 20>;
inline ConvPlanCache& conv_plans(Context& ctx) { return plan_cache<ConvPlan, 20>(ctx); }

// The plan of convolution `g` over `dtype` in a layout on ctx, made at the shape's first call.
inline ConvPlan& conv_plan(Context& ctx, const ConvGeometry& g, DType dtype, bool nhwc) {
  auto& libs = libraries(ctx);
  const ConvPlanCache::Key key{g.batch,
                               g.in_channels,
                               g.height,
                               g.width,
                               g.out_channels,
                               g.kernel_h,
                               g.kernel_w,
                               g.stride_h,
                               g.stride_w,
                               g.pad_h,
                               g.pad_w,
                               g.dilation_h,
                               g.dilation_w,
                               static_cast<std::int64_t>(dtype),
                               libs.allow_tf32 ? 1 : 0,
                               libs.benchmark ? 1 : 0,
                               g.groups,
                               libs.deterministic ? 1 : 0,
                               static_cast<std::int64_t>(libs.workspace_limit),
                               nhwc ? 1 : 0};
  return conv_plans(ctx).get(key, [&] { return std::make_unique<ConvPlan>(ctx, g, dtype, nhwc); });
}

// Whether a convolution runs NHWC: where its output (or gradient) `y` is channels-last (core/
// channels_last.hpp), or, where y's layout does not tell (one channel, 1 x 1 planes: both at
// once), where its input is.
inline bool runs_nhwc(const Tensor& x, const Tensor& y) {
  if (y.is_contiguous() != is_channels_last(y)) return is_channels_last(y);
  return is_channels_last(x) && !x.is_contiguous();
}

// An uninitialised tensor of `like`'s shape for a result in the convolution's layout: `like`
// itself where it is stored so, else a temporary (copied into `like` after), counted as scratch.
inline Tensor result_in_layout(Context& ctx, const Tensor& like, bool nhwc) {
  if (nhwc ? is_channels_last(like) : like.is_contiguous()) return like;
  return nhwc ? empty_channels_last(ctx, like.device(), like.shape(), like.dtype(),
                                    MemoryCategory::other)
              : empty_on(ctx, like.device(), like.shape(), like.dtype(), MemoryCategory::other);
}

// `t` stored in the convolution's layout: itself where it is, else a temporary copy (an NCHW
// input of a network's first convolution; a weight, always KCRS, for an NHWC convolution: a few
// KiB), counted as scratch, not as what t is.
inline Tensor in_layout(Context& ctx, const Tensor& t, bool nhwc) {
  Tensor out = result_in_layout(ctx, t, nhwc);
  if (out.data_ptr() != t.data_ptr()) copy(ctx, out, t);
  return out;
}

// In y's layout (runs_nhwc); the weight is copied to KRSC for an NHWC convolution.
inline void conv2d_forward(Context& ctx, const Tensor& x, const Tensor& weight, const Tensor& y,
                           const ConvGeometry& g) {
  CudaDeviceGuard guard(ctx.device().index);
  auto& libs = libraries(ctx);
  const bool nhwc = runs_nhwc(x, y);
  const Tensor xl = in_layout(ctx, x, nhwc), wl = in_layout(ctx, weight, nhwc);
  const Tensor yl = result_in_layout(ctx, y, nhwc);
  ConvPlan& plan = conv_plan(ctx, g, x.dtype(), nhwc);
  const Blend blend(x.dtype());
  run_ranked(plan.algorithms.forward, "cudnnConvolutionForward", ctx.capturing(),
             [&](auto algo, std::size_t bytes) {
               void* ws = libs.workspace(ctx, bytes);
               return cudnnConvolutionForward(libs.dnn(), blend.one(), plan.x.get(), xl.data_ptr(),
                                              plan.w.get(), wl.data_ptr(), plan.conv.get(), algo,
                                              ws, bytes, blend.zero(), plan.y.get(), yl.data_ptr());
             });
  if (yl.data_ptr() != y.data_ptr()) copy(ctx, y, yl);
}

// In grad_y's layout (runs_nhwc); an NHWC convolution's weight gradient comes out KRSC and is
// copied into grad_weight (KCRS).
inline void conv2d_backward(Context& ctx, const Tensor& x, const Tensor& weight,
                            const Tensor& grad_y, const Tensor& grad_x, const Tensor& grad_weight,
                            const ConvGeometry& g) {
  CudaDeviceGuard guard(ctx.device().index);
  auto& libs = libraries(ctx);
  const bool nhwc = runs_nhwc(x, grad_y);
  const Tensor gyl = in_layout(ctx, grad_y, nhwc);
  ConvPlan& plan = conv_plan(ctx, g, x.dtype(), nhwc);
  const Blend blend(x.dtype());
  if (grad_x.defined()) {
    const Tensor wl = in_layout(ctx, weight, nhwc);
    const Tensor gxl = result_in_layout(ctx, grad_x, nhwc);
    run_ranked(plan.algorithms.backward_data, "cudnnConvolutionBackwardData", ctx.capturing(),
               [&](auto algo, std::size_t bytes) {
                 void* ws = libs.workspace(ctx, bytes);
                 return cudnnConvolutionBackwardData(libs.dnn(), blend.one(), plan.w.get(),
                                                     wl.data_ptr(), plan.y.get(), gyl.data_ptr(),
                                                     plan.conv.get(), algo, ws, bytes, blend.zero(),
                                                     plan.x.get(), gxl.data_ptr());
               });
    if (gxl.data_ptr() != grad_x.data_ptr()) copy(ctx, grad_x, gxl);
  }
  if (grad_weight.defined()) {
    const Tensor xl = in_layout(ctx, x, nhwc);
    const Tensor gwl = result_in_layout(ctx, grad_weight, nhwc);
    run_ranked(plan.algorithms.backward_filter, "cudnnConvolutionBackwardFilter", ctx.capturing(),
               [&](auto algo, std::size_t bytes) {
                 void* ws = libs.workspace(ctx, bytes);
                 return cudnnConvolutionBackwardFilter(libs.dnn(), blend.one(), plan.x.get(),
                                                       xl.data_ptr(), plan.y.get(), gyl.data_ptr(),
                                                       plan.conv.get(), algo, ws, bytes,
                                                       blend.zero(), plan.w.get(), gwl.data_ptr());
               });
    if (gwl.data_ptr() != grad_weight.data_ptr()) copy(ctx, grad_weight, gwl);
  }
}

// Row-major C = alpha op(A) op(B) + beta C through column-major cuBLAS: C^T = op(B)^T op(A)^T.
inline void gemm(Context& ctx, const Tensor& a, bool transpose_a, const Tensor& b, bool transpose_b,
                 const Tensor& c, double alpha, double beta) {
  CudaDeviceGuard guard(ctx.device().index);
  auto& libs = libraries(ctx);
  const int m = int(c.size(1)), n = int(c.size(0));
  const int k = int(transpose_a ? a.size(0) : a.size(1));
  cudaDataType_t type = CUDA_R_32F;
  cublasComputeType_t compute = libs.allow_tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  switch (c.dtype()) {
    case DType::f32:
      break;
    case DType::f16:
      type = CUDA_R_16F;
      compute = CUBLAS_COMPUTE_32F;
      break;
    case DType::bf16:
      type = CUDA_R_16BF;
      compute = CUBLAS_COMPUTE_32F;
      break;
    case DType::f64:
      type = CUDA_R_64F;
      compute = CUBLAS_COMPUTE_64F;
      break;
    default:
      fail<InvalidArgument>("gemm takes f32, f64, f16 or bf16, got ", dtype_name(c.dtype()));
  }
  const float alpha_f = float(alpha), beta_f = float(beta);
  const void* alpha_p = c.dtype() == DType::f64 ? static_cast<const void*>(&alpha) : &alpha_f;
  const void* beta_p = c.dtype() == DType::f64 ? static_cast<const void*>(&beta) : &beta_f;
  SK_CUBLAS_CHECK(cublasGemmEx(
      libs.blas(), transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N, transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N,
      m, n, k, alpha_p, b.data_ptr(), type, int(b.size(1)), a.data_ptr(), type, int(a.size(1)),
      beta_p, c.data_ptr(), type, int(c.size(1)), compute, CUBLAS_GEMM_DEFAULT));
}

}  // namespace shardkit::autograd::cuda

#endif  // SK_WITH_CUDA
