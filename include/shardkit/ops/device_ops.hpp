// The fused ops on whatever device a Context is on: what the layers above call.
//
// CPU or GPU, one idiom for every layer with device code (docs/design.md, "CPU or GPU"): the
// layer's device operations are a table of named function pointers, filled with designated
// initialisers (a swap of two entries of one signature cannot compile). The CPU's table is
// built here from the backend-generic implementations (fused_ops.hpp over ops::Cpu); the GPU's
// in kernels/ops/cuda_backend.cuh (ops::Cuda), and every CUDA Context carries it
// (CudaKernelTables::ops). fused_ops(ctx) picks by the context's device, so the optimizer, the
// engines, the trainers and the tests above are compiled once, by the host compiler, for both.
//
//   sk::ops::sgd_step(ctx, options, tensors);   // on ctx's device
//
// The templates of fused_ops.hpp (sgd_step<B> ...) are what the tables are made of; they stay
// callable for tests of one backend.
#pragma once

#include <span>
#include <string_view>

#include "shardkit/ops/cpu_backend.hpp"
#include "shardkit/ops/fused_ops.hpp"

namespace shardkit::ops {

struct FusedOps {
  std::string_view device;  // "cpu", "cuda"
  void (*sgd_step)(Context&, const SgdOptions&, const SgdTensors&);
  void (*sgd_step_with_coefficients)(Context&, const SgdOptions&, const SgdTensors&,
                                     const Tensor& coefficients);
  void (*segment_sums_of_squares)(Context&, std::span<const Tensor> first,
                                  std::span<const Tensor> second, const Tensor& sums);
  void (*leaf_sums_of_squares)(Context&, std::span<const Tensor>, const Tensor& leaves);
  void (*leaf_sums_of_squares_pair)(Context&, std::span<const Tensor> first,
                                    std::span<const Tensor> second, const Tensor& leaves);
  void (*norm_subtree_sums)(Context&, const Tensor& leaves, std::span<const NormSubtree> nodes,
                            const Tensor& out, const Tensor& nodes_on_device);
  void (*norm_roots)(Context&, const Tensor& values, const NormRootPlan& plan, const Tensor& out);
  void (*clip_norm_and_factor)(Context&, const Tensor& total, double max_norm, float inv_grad_scale,
                               const Tensor& norm, const Tensor& factor);
  void (*check_finite)(Context&, std::span<const Tensor>, const Tensor& found_nonfinite);
  void (*larc_coefficients)(Context&, const LarcOptions&, float lr, float inv_grad_scale,
                            const Tensor& sums, const Tensor& coefficients, const Tensor& gate);
  void (*larc_sgd_step)(Context&, const SgdOptions&, const LarcOptions&, const SgdTensors&,
                        LarcParamSquares*);
  // LARC-SGD with the norm tree's norms in one pipelined pass; null where the norms pass and
  // the update stay two launches (the GPU: fused_ops.hpp, has_larc_sgd_tree).
  void (*larc_sgd_step_tree)(Context&, const SgdOptions&, const LarcOptions&, const SgdTensors&,
                             std::span<const double> decays);
  void (*adam_step)(Context&, const AdamOptions&, const AdamTensors&);
  void (*cast)(Context&, std::span<const Tensor> src, std::span<const Tensor> dst);
  void (*unscale_and_check)(Context&, float inv_scale, std::span<const Tensor> grads,
                            const Tensor& found_nonfinite, const Tensor& sums);
  void (*quantize_blocks)(Context&, QuantFormat format, const Tensor& values, std::int64_t block,
                          const Tensor& payload);
  void (*dequantize_blocks)(Context&, QuantFormat format, const Tensor& payload, std::int64_t block,
                            const Tensor& values);
  void (*dequantize_add_blocks)(Context&, QuantFormat format, const Tensor& payload,
                                std::int64_t block, const Tensor& values);
  void (*slot_abs_max)(Context&, const Tensor& values, const Tensor& chunks, const Tensor& amax);
  void (*quantize_by_slots)(Context&, QuantFormat format, const Tensor& values,
                            const Tensor& chunks, const Tensor& amax, const Tensor& codes);
  void (*dequantize_by_slots)(Context&, QuantFormat format, const Tensor& codes,
                              const Tensor& chunks, const Tensor& amax, const Tensor& values);
  void (*loss_scale_phase)(Context&, LossScaleFunctor::Phase, const LossScaleRule&,
                           const Tensor& state);
  void (*count_applied_step)(Context&, const Tensor& gate);
  void (*follow_loss_scale)(Context&, std::span<const Tensor> values, const Tensor& state);
  void (*normalize_rows_by_leaves)(Context&, const Tensor& values, std::int64_t first,
                                   std::int64_t cols, const Tensor& leaves, double eps,
                                   const Tensor& gate);
};

// The table of backend B (ops::Cpu here, ops::Cuda in kernels/ops/cuda_backend.cuh).
template <class B>
constexpr FusedOps fused_ops_table() {
  SK_REQUIRE_OPS_BACKEND(B, "fused_ops_table");
  FusedOps table{
      .device = B::name,
      .sgd_step = &ops::sgd_step<B>,
      .sgd_step_with_coefficients = &ops::sgd_step<B>,
      .segment_sums_of_squares = &ops::segment_sums_of_squares<B>,
      .leaf_sums_of_squares = &ops::leaf_sums_of_squares<B>,
      .leaf_sums_of_squares_pair = &ops::leaf_sums_of_squares<B>,
      .norm_subtree_sums = &ops::norm_subtree_sums<B>,
      .norm_roots = &ops::norm_roots<B>,
      .clip_norm_and_factor = &ops::clip_norm_and_factor<B>,
      .check_finite = &ops::check_finite<B>,
      .larc_coefficients = &ops::larc_coefficients<B>,
      .larc_sgd_step = &ops::larc_sgd_step<B>,
      .larc_sgd_step_tree = nullptr,
      .adam_step = &ops::adam_step<B>,
      .cast = &ops::cast<B>,
      .unscale_and_check = &ops::unscale_and_check<B>,
      .quantize_blocks = &ops::quantize_blocks<B>,
      .dequantize_blocks = &ops::dequantize_blocks<B>,
      .dequantize_add_blocks = &ops::dequantize_add_blocks<B>,
      .slot_abs_max = &ops::slot_abs_max<B>,
      .quantize_by_slots = &ops::quantize_by_slots<B>,
      .dequantize_by_slots = &ops::dequantize_by_slots<B>,
      .loss_scale_phase = &ops::loss_scale_phase<B>,
      .count_applied_step = &ops::count_applied_step<B>,
      .follow_loss_scale = &ops::follow_loss_scale<B>,
      .normalize_rows_by_leaves = &ops::normalize_rows_by_leaves<B>,
  };
  if constexpr (has_larc_sgd_tree<B>) table.larc_sgd_step_tree = &ops::larc_sgd_step_tree<B>;
  return table;
}

// The CPU's table (core/config.hpp, SK_CPU_TABLES_ELSEWHERE: defined here, or only declared
// here and compiled once in kernels/shardkit_cpu.cpp).
inline namespace SK_CPU_KERNELS_ABI {  // (core/config.hpp)
#if SK_CPU_TABLES_ELSEWHERE
const FusedOps& cpu_fused_ops();
#else
SK_CPU_KERNELS_LINKAGE const FusedOps& cpu_fused_ops() {
  static constexpr FusedOps kTable = fused_ops_table<Cpu>();
  return kTable;
}
#endif
}  // namespace SK_CPU_KERNELS_ABI

// The fused ops of ctx's device.
inline const FusedOps& fused_ops(const Context& ctx) {
  if (ctx.device().is_cpu()) return cpu_fused_ops();
  const FusedOps* table = ctx.kernel_tables().ops;
  check<NotAvailable>(table != nullptr, "no fused-op kernels in this ", ctx.device(),
                      " context; create it with sk::make_cuda_context (<shardkit/cuda.hpp>)");
  return *table;
}

// --- the entry points on ctx's device (fused_ops.hpp says what each does) ------------------
inline void sgd_step(Context& ctx, const SgdOptions& options, const SgdTensors& tensors) {
  fused_ops(ctx).sgd_step(ctx, options, tensors);
}
inline void sgd_step(Context& ctx, const SgdOptions& options, const SgdTensors& tensors,
                     const Tensor& coefficients) {
  fused_ops(ctx).sgd_step_with_coefficients(ctx, options, tensors, coefficients);
}
inline void segment_sums_of_squares(Context& ctx, std::span<const Tensor> first,
                                    std::span<const Tensor> second, const Tensor& sums) {
  fused_ops(ctx).segment_sums_of_squares(ctx, first, second, sums);
}
inline void leaf_sums_of_squares(Context& ctx, std::span<const Tensor> tensors,
                                 const Tensor& leaves) {
  fused_ops(ctx).leaf_sums_of_squares(ctx, tensors, leaves);
}
inline void leaf_sums_of_squares(Context& ctx, std::span<const Tensor> first,
                                 std::span<const Tensor> second, const Tensor& leaves) {
  fused_ops(ctx).leaf_sums_of_squares_pair(ctx, first, second, leaves);
}
inline void norm_subtree_sums(Context& ctx, const Tensor& leaves,
                              std::span<const NormSubtree> nodes, const Tensor& out,
                              const Tensor& nodes_on_device = Tensor()) {
  fused_ops(ctx).norm_subtree_sums(ctx, leaves, nodes, out, nodes_on_device);
}
inline void norm_roots(Context& ctx, const Tensor& values, const NormRootPlan& plan,
                       const Tensor& out) {
  fused_ops(ctx).norm_roots(ctx, values, plan, out);
}
inline void clip_norm_and_factor(Context& ctx, const Tensor& total, double max_norm,
                                 float inv_grad_scale, const Tensor& norm, const Tensor& factor) {
  fused_ops(ctx).clip_norm_and_factor(ctx, total, max_norm, inv_grad_scale, norm, factor);
}
inline void check_finite(Context& ctx, std::span<const Tensor> tensors,
                         const Tensor& found_nonfinite) {
  fused_ops(ctx).check_finite(ctx, tensors, found_nonfinite);
}
inline void larc_coefficients(Context& ctx, const LarcOptions& larc, float lr, float inv_grad_scale,
                              const Tensor& sums, const Tensor& coefficients,
                              const Tensor& gate = Tensor()) {
  fused_ops(ctx).larc_coefficients(ctx, larc, lr, inv_grad_scale, sums, coefficients, gate);
}
inline void larc_sgd_step(Context& ctx, const SgdOptions& options, const LarcOptions& larc,
                          const SgdTensors& tensors, LarcParamSquares* param_squares = nullptr) {
  fused_ops(ctx).larc_sgd_step(ctx, options, larc, tensors, param_squares);
}
// Whether ctx's device pipelines LARC-SGD with the norm tree's norms (larc_sgd_step_tree).
inline bool has_larc_sgd_step_tree(const Context& ctx) {
  return fused_ops(ctx).larc_sgd_step_tree != nullptr;
}
inline void larc_sgd_step_tree(Context& ctx, const SgdOptions& options, const LarcOptions& larc,
                               const SgdTensors& tensors, std::span<const double> decays = {}) {
  const auto step = fused_ops(ctx).larc_sgd_step_tree;
  check<NotAvailable>(step != nullptr, "larc_sgd_step_tree: the ", ctx.device(),
                      " backend forms LARC's norms and the update in two passes; call "
                      "leaf_sums_of_squares, larc_coefficients and sgd_step with coefficients "
                      "(has_larc_sgd_step_tree(ctx) says which)");
  step(ctx, options, larc, tensors, decays);
}
inline void adam_step(Context& ctx, const AdamOptions& options, const AdamTensors& tensors) {
  fused_ops(ctx).adam_step(ctx, options, tensors);
}
inline void cast(Context& ctx, std::span<const Tensor> src, std::span<const Tensor> dst) {
  fused_ops(ctx).cast(ctx, src, dst);
}
inline void unscale_and_check(Context& ctx, float inv_scale, std::span<const Tensor> grads,
                              const Tensor& found_nonfinite, const Tensor& sums = Tensor()) {
  fused_ops(ctx).unscale_and_check(ctx, inv_scale, grads, found_nonfinite, sums);
}
inline void quantize_blocks(Context& ctx, QuantFormat format, const Tensor& values,
                            std::int64_t block, const Tensor& payload) {
  fused_ops(ctx).quantize_blocks(ctx, format, values, block, payload);
}
inline void dequantize_blocks(Context& ctx, QuantFormat format, const Tensor& payload,
                              std::int64_t block, const Tensor& values) {
  fused_ops(ctx).dequantize_blocks(ctx, format, payload, block, values);
}
inline void dequantize_add_blocks(Context& ctx, QuantFormat format, const Tensor& payload,
                                  std::int64_t block, const Tensor& values) {
  fused_ops(ctx).dequantize_add_blocks(ctx, format, payload, block, values);
}
inline void slot_abs_max(Context& ctx, const Tensor& values, const Tensor& chunks,
                         const Tensor& amax) {
  fused_ops(ctx).slot_abs_max(ctx, values, chunks, amax);
}
inline void quantize_by_slots(Context& ctx, QuantFormat format, const Tensor& values,
                              const Tensor& chunks, const Tensor& amax, const Tensor& codes) {
  fused_ops(ctx).quantize_by_slots(ctx, format, values, chunks, amax, codes);
}
inline void dequantize_by_slots(Context& ctx, QuantFormat format, const Tensor& codes,
                                const Tensor& chunks, const Tensor& amax, const Tensor& values) {
  fused_ops(ctx).dequantize_by_slots(ctx, format, codes, chunks, amax, values);
}
inline void loss_scale_phase(Context& ctx, LossScaleFunctor::Phase phase, const LossScaleRule& rule,
                             const Tensor& state) {
  fused_ops(ctx).loss_scale_phase(ctx, phase, rule, state);
}
inline void count_applied_step(Context& ctx, const Tensor& gate) {
  fused_ops(ctx).count_applied_step(ctx, gate);
}
inline void follow_loss_scale(Context& ctx, std::span<const Tensor> values, const Tensor& state) {
  fused_ops(ctx).follow_loss_scale(ctx, values, state);
}
inline void normalize_rows_by_leaves(Context& ctx, const Tensor& values, std::int64_t first,
                                     std::int64_t cols, const Tensor& leaves, double eps,
                                     const Tensor& gate = Tensor()) {
  fused_ops(ctx).normalize_rows_by_leaves(ctx, values, first, cols, leaves, eps, gate);
}
// The int8 format, qwZ's and qgZ's.
inline void quantize_int8_blocks(Context& ctx, const Tensor& values, std::int64_t block,
                                 const Tensor& payload) {
  quantize_blocks(ctx, QuantFormat::int8, values, block, payload);
}
inline void dequantize_int8_blocks(Context& ctx, const Tensor& payload, std::int64_t block,
                                   const Tensor& values) {
  dequantize_blocks(ctx, QuantFormat::int8, payload, block, values);
}

}  // namespace shardkit::ops
