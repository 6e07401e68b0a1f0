// The CPU backend of the fused ops: the functors run through cpu_apply.hpp's loops on the host,
// spread over the context's CPU threads (Context::cpu_pool).
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "shardkit/core/tensor_ops.hpp"
#include "shardkit/ops/backend.hpp"
#include "shardkit/ops/clip.hpp"
#include "shardkit/ops/cpu_apply.hpp"
#include "shardkit/ops/cpu_larc.hpp"
#include "shardkit/ops/larc_param_squares.hpp"
#include "shardkit/ops/norm_tree.hpp"
#include "shardkit/ops/norms.hpp"
#include "shardkit/ops/quantize.hpp"
#include "shardkit/ops/sgd.hpp"

namespace shardkit::ops {

struct Cpu {
  static constexpr std::string_view name = "cpu";

  static void check_context(const Context& ctx, const char* op) {
    check(ctx.device().is_cpu(), op, "<sk::ops::Cpu> needs a CPU context, got ", ctx.device(),
          "; use sk::ops::Cuda from <kernels/ops/cuda_backend.cuh>");
  }

  // An optimizer functor that writes an f16/bf16 parameter copy runs without it
  // (F::WithoutCopy), and cpu::LowCopy converts each chunk's updated params after it.
  template <class F>
  static void apply(Context& ctx, const F& op, const SpanList<F::kDepth>& spans) {
    static_assert(F::kSums == 0, "summing functors go through apply_sums");
    cpu::with_low_copy(op, [&](const auto& rule, const cpu::LowCopy& copy) {
      cpu::apply(ctx.cpu_pool(), rule, spans, nullptr, copy);
    });
  }

  template <class F>
  static void apply_sums(Context& ctx, const F& op, const SpanList<F::kDepth>& spans,
                         const Tensor& sums, const Tensor& found_nonfinite) {
    static_assert(F::kSums > 0, "apply_sums needs a summing functor");
    const auto n = spans.size();
    double* out = sums.data<double>();
    cpu::apply(ctx.cpu_pool(), op, spans, out);
    if (found_nonfinite.defined())
      for (std::size_t s = 0; s < F::kSums * n; ++s)
        if (!is_finite_sum(out[s])) found_nonfinite.data<float>()[0] = 1.0f;
  }

  static void larc_coefficients(Context&, const LarcOptions& larc, float lr, float inv_grad_scale,
                                const Tensor& sums, const Tensor& coefficients, const float* gate) {
    if (gate != nullptr) {
      inv_grad_scale *= gate[kGateGradFactor];
      lr = gate[kGateRate];
    }
    const auto n = sums.size(1);
    const double* s = sums.data<double>();
    auto* out = static_cast<SgdCoefficients*>(coefficients.data_ptr());
    const bool per_param_decay = sums.size(0) == 3;
    for (std::int64_t i = 0; i < n; ++i)
      out[i] = per_param_decay
                   ? ops::larc_coefficients(s[i], s[n + i], larc, lr, inv_grad_scale, s[2 * n + i])
                   : ops::larc_coefficients(s[i], s[n + i], larc, lr, inv_grad_scale);
  }

  // Every leaf is its own sum, so chunks of whole leaves run on the pool's threads, each
  // writing its own leaves: the same bits on any thread count.
  static void leaf_sums_of_squares(Context& ctx, const SpanList<1>& spans, DType dtype,
                                   double* leaves) {
    leaf_sums<1>(ctx, spans, {dtype}, {leaves});
  }

  // Two lists of equal sizes (params and their grads) in one pass: each task alternates
  // between them every 16 leaves, so one thread streams both from memory at once -- the norms
  // pass is bound by memory, not arithmetic (docs/performance.md, bench_offload's LARC rows).
  static void leaf_sums_of_squares_pair(Context& ctx, const SpanList<2>& spans,
                                        const std::array<DType, 2>& dtypes,
                                        const std::array<double*, 2>& leaves) {
    leaf_sums<2>(ctx, spans, dtypes, leaves);
  }

  // Each node is its own tree, so nodes run on the pool's threads as tasks: the same bits on
  // any thread count.
  static void norm_subtree_sums(Context& ctx, const double* leaves,
                                std::span<const NormSubtree> nodes, const std::int64_t*,
                                double* out) {
    ctx.cpu_pool().parallel_for(static_cast<std::int64_t>(nodes.size()), [&](std::int64_t i) {
      thread_local std::vector<double> scratch;
      const NormSubtree& node = nodes[static_cast<std::size_t>(i)];
      out[i] = norm_subtree(leaves + node.first, std::int64_t{1} << node.level, scratch);
    });
  }

  static void clip_norm_and_factor(Context&, const double* total, double max_norm,
                                   float inv_grad_scale, double* norm, float* factor) {
    const ClipResult r = clip_result(*total, max_norm, inv_grad_scale);
    if (norm != nullptr) *norm = r.norm;
    if (factor != nullptr) *factor *= r.coefficient;
  }

  // A few words per root: on the calling thread.
  static void norm_roots(Context&, const double* values, const std::int64_t* table,
                         std::int64_t roots, double* out) {
    const std::int64_t* words = table + roots + 1;
    for (std::int64_t r = 0; r < roots; ++r)
      out[r] = run_norm_root_program(values, words, table[r], table[r + 1]);
  }

  // Norms, coefficients and update, pipelined over batches of whole tensors (cpu_larc.hpp).
  // With param_squares the update also squares the params it writes, and when the squares
  // describe these params the norms read only the grads. A parameter copy is converted after
  // each 256-element block of the update (cpu::LowCopy).
  template <class Sgd>
  static void larc_sgd(Context& ctx, Sgd op, const SpanList<4>& spans, const LarcOptions& larc,
                       float lr, float inv_grad_scale, LarcParamSquares* param_squares) {
    cpu::with_low_copy(op, [&](const auto& rule, const cpu::LowCopy& copy) {
      ThreadPool& pool = ctx.cpu_pool();
      if (param_squares == nullptr) {
        cpu::larc_sgd_pipelined<cpu::ChunkSums<2>, false>(pool, rule, copy, spans, larc, lr,
                                                          inv_grad_scale, nullptr);
        return;
      }
      // The kept squares are read (before a span's update) and rewritten (after it) in place.
      const bool known = param_squares->describes(spans);
      Tensor squares = known ? param_squares->sums()
                             : empty(ctx, {static_cast<std::int64_t>(spans.size())}, DType::f64,
                                     MemoryCategory::optimizer_state);
      if (known)
        cpu::larc_sgd_pipelined<cpu::ChunkSums<1>, true>(pool, rule, copy, spans, larc, lr,
                                                         inv_grad_scale, squares.data<double>());
      else
        cpu::larc_sgd_pipelined<cpu::ChunkSums<2>, true>(pool, rule, copy, spans, larc, lr,
                                                         inv_grad_scale, squares.data<double>());
      param_squares->record(spans, squares);
    });
  }

  // LARC-SGD with the norm tree's norms (cpu::TreeSums), pipelined as larc_sgd is: the bits
  // of ParamNorms' sums, larc_coefficients and sgd_step with coefficients. `decays` holds each
  // span's weight decay (nullptr: larc.weight_decay).
  template <class Sgd>
  static void larc_sgd_tree(Context& ctx, Sgd op, const SpanList<4>& spans, const LarcOptions& larc,
                            float lr, float inv_grad_scale, const double* decays) {
    cpu::with_low_copy(op, [&](const auto& rule, const cpu::LowCopy& copy) {
      cpu::larc_sgd_pipelined<cpu::TreeSums<operand_t<Sgd, 1>>, false>(
          ctx.cpu_pool(), rule, copy, spans, larc, lr, inv_grad_scale, nullptr, decays);
    });
  }

  // The codes' loops work through runs of this many values (even: int4 runs start on a byte).
  static constexpr std::int64_t kQuantRun = 256;

  // Values [at, at + m) of a run's codes decoded into `out` (m <= kQuantRun; `at` even for
  // int4, whose bytes are unpacked first so that both loops vectorise).
  template <class Code>
  static void decode_run(const std::uint8_t* q, std::int64_t at, std::int64_t m, float scale,
                         float* out) {
    if constexpr (Code::kPerByte == 1) {
      for (std::int64_t j = 0; j < m; ++j) out[j] = Code::decode(q[at + j], scale);
    } else {
      std::uint8_t codes[kQuantRun];
      const std::uint8_t* const packed = q + at / 2;
      for (std::int64_t j = 0; j < (m + 1) / 2; ++j) {
        codes[2 * j] = packed[j] & 0xf;
        codes[2 * j + 1] = packed[j] >> 4;
      }
      for (std::int64_t j = 0; j < m; ++j) out[j] = Code::decode(codes[j], scale);
    }
  }

  // quantize.hpp's format, a block a task: n values of `dtype` into one run's payload.
  static void quantize_blocks(Context& ctx, QuantFormat format, DType dtype, const void* values,
                              std::int64_t n, std::int64_t block, std::uint8_t* payload) {
    const std::int64_t blocks = quant_block_count(n, block);
    std::uint8_t* q = payload + 4 * blocks;
    visit_quant_format(format, [&]<class Code>() {
      visit_element_dtype(dtype, [&]<class T>() {
        const T* x = static_cast<const T*>(values);
        ctx.cpu_pool().parallel_for(blocks, [&](std::int64_t b) {
          const std::int64_t lo = b * block, hi = std::min(n, lo + block);
          std::uint32_t amax_bits = 0;
          for (std::int64_t i = lo; i < hi; ++i)
            amax_bits = std::max(amax_bits, abs_bits(load_element(x + i)));
          const float amax = bits_to_float(amax_bits);
          const float scale = block_scale<Code>(amax);
          std::memcpy(payload + 4 * b, &scale, sizeof scale);
          const float inverse = inverse_step<Code>(amax);
          if constexpr (Code::kPerByte == 1) {
            // Through locals: a byte store may alias anything, the lambda's captured pointers
            // too, and reloading them at every store kept this loop scalar.
            std::uint8_t* const codes = q;
            const T* const in = x;
            for (std::int64_t i = lo; i < hi; ++i)
              codes[i] = Code::encode(load_element(in + i), inverse);
          } else {  // two codes a byte; lo is even (int4 blocks are)
            // A run of codes a byte each first (a loop that vectorises), then packed in pairs:
            // encoding pair by pair kept both scalar.
            std::uint8_t codes[kQuantRun];
            std::uint8_t* const packed = q;
            const T* const in = x;
            for (std::int64_t at = lo; at < hi; at += kQuantRun) {
              const std::int64_t m = std::min(kQuantRun, hi - at);
              for (std::int64_t j = 0; j < m; ++j)
                codes[j] = Code::encode(load_element(in + at + j), inverse);
              if (m % 2 == 1) codes[m] = 0;  // the last value alone: its byte's high nibble is 0
              for (std::int64_t j = 0; j < (m + 1) / 2; ++j)
                packed[at / 2 + j] =
                    static_cast<std::uint8_t>(codes[2 * j] | (codes[2 * j + 1] << 4));
            }
          }
        });
      });
    });
    // The padding too: a payload's bytes are a function of the values alone.
    std::fill(payload + 4 * blocks + quant_code_bytes(n, format),
              payload + quant_payload_bytes(n, block, format), std::uint8_t{0});
  }

  // The n values of one run's payload back into `values` (of `dtype`); with `accumulate`,
  // added to them (f32 values).
  static void dequantize_blocks(Context& ctx, QuantFormat format, DType dtype,
                                const std::uint8_t* payload, std::int64_t n, std::int64_t block,
                                void* values, bool accumulate) {
    const std::int64_t blocks = quant_block_count(n, block);
    const std::uint8_t* q = payload + 4 * blocks;
    visit_quant_format(format, [&]<class Code>() {
      visit_element_dtype(dtype, [&]<class T>() {
        T* x = static_cast<T*>(values);
        ctx.cpu_pool().parallel_for(blocks, [&](std::int64_t b) {
          const std::int64_t lo = b * block, hi = std::min(n, lo + block);
          float scale;
          std::memcpy(&scale, payload + 4 * b, sizeof scale);
          if (accumulate || Code::kPerByte == 2) {
            // A run of values decoded into a buffer, then stored or added: with `accumulate`
            // the product and the sum rounded apart, as a dequantise then an add (GCC would
            // fuse a product that feeds a sum directly); int4's codes unpacked a byte at a time
            // (decode_run), where code_at's shift per value kept the loop scalar.
            float run[kQuantRun];
            for (std::int64_t at = lo; at < hi; at += kQuantRun) {
              const std::int64_t m = std::min(kQuantRun, hi - at);
              decode_run<Code>(q, at, m, scale, run);
              if (accumulate)
                for (std::int64_t j = 0; j < m; ++j)
                  store_element(x + at + j, load_element(x + at + j) + run[j]);
              else
                for (std::int64_t j = 0; j < m; ++j) store_element(x + at + j, run[j]);
            }
          } else
            for (std::int64_t i = lo; i < hi; ++i)
              store_element(x + i, Code::decode(code_at<Code>(q, i), scale));
        });
      });
    });
  }

  // Per-tensor scales (quantize.hpp): a chunk a task for the maxima, folded into amax in chunk
  // order (a maximum is exact: any order gives the same result).
  static void slot_abs_max(Context& ctx, DType dtype, const void* values,
                           const std::int64_t* chunks, std::int64_t count, float* amax) {
    visit_element_dtype(dtype, [&]<class T>() {
      const T* x = static_cast<const T*>(values);
      std::vector<float> maxima(static_cast<std::size_t>(count));
      ctx.cpu_pool().parallel_for(count, [&](std::int64_t c) {
        const std::int64_t* row = chunks + 3 * c;
        std::uint32_t m = 0;
        for (std::int64_t i = row[0]; i < row[0] + row[1]; ++i)
          m = std::max(m, abs_bits(load_element(x + i)));
        // (a NaN's maximum as +inf: an all-reduce of the maxima by NCCL's fmaxf or an MPI's
        // `a > b ? a : b` may drop a NaN, never an inf -- and an inf scale decodes the whole
        // tensor as NaN, as a NaN one did)
        maxima[static_cast<std::size_t>(c)] = bits_to_float(std::min(m, 0x7f800000u));
      });
      for (std::int64_t c = 0; c < count; ++c)
        amax[chunks[3 * c + 2]] =
            abs_max(amax[chunks[3 * c + 2]], maxima[static_cast<std::size_t>(c)]);
    });
  }
  static void quantize_by_slots(Context& ctx, QuantFormat format, DType dtype, const void* values,
                                const std::int64_t* chunks, std::int64_t count, const float* amax,
                                std::uint8_t* codes) {
    visit_quant_format(format, [&]<class Code>() {
      if constexpr (Code::kPerByte == 1)
        visit_element_dtype(dtype, [&]<class T>() {
          const T* x = static_cast<const T*>(values);
          ctx.cpu_pool().parallel_for(count, [&](std::int64_t c) {
            const std::int64_t* row = chunks + 3 * c;
            const float inverse = inverse_step<Code>(amax[row[2]]);
            // Locals, the chunk's bounds too: a byte store may alias the table, and reloading
            // the bound at every store kept this loop scalar (see quantize_blocks).
            std::uint8_t* const out = codes;
            const T* const in = x;
            const std::int64_t lo = row[0], hi = row[0] + row[1];
            for (std::int64_t i = lo; i < hi; ++i)
              out[i] = Code::encode(load_element(in + i), inverse);
          });
        });
    });
  }
  static void dequantize_by_slots(Context& ctx, QuantFormat format, DType dtype,
                                  const std::uint8_t* codes, const std::int64_t* chunks,
                                  std::int64_t count, const float* amax, void* values) {
    visit_quant_format(format, [&]<class Code>() {
      if constexpr (Code::kPerByte == 1)
        visit_element_dtype(dtype, [&]<class T>() {
          T* x = static_cast<T*>(values);
          ctx.cpu_pool().parallel_for(count, [&](std::int64_t c) {
            const std::int64_t* row = chunks + 3 * c;
            const float scale = block_scale<Code>(amax[row[2]]);
            for (std::int64_t i = row[0]; i < row[0] + row[1]; ++i)
              store_element(x + i, Code::decode(codes[i], scale));
          });
        });
    });
  }

 private:
  template <int Depth>
  static void leaf_sums(Context& ctx, const SpanList<Depth>& spans,
                        const std::array<DType, Depth>& dtypes,
                        const std::array<double*, Depth>& leaves) {
    static_assert(kChunkElements % kNormLeaf == 0, "chunks must hold whole leaves");
    std::vector<cpu::Chunk> chunks;
    cpu::cut_into_chunks(spans, 0, spans.size(), chunks);
    std::vector<std::int64_t> first(spans.size());  // each span's first leaf
    for (std::size_t s = 0, at = 0; s < spans.size(); ++s) {
      first[s] = static_cast<std::int64_t>(at);
      at += static_cast<std::size_t>(norm_leaves(spans[s].size));
    }
    auto run = [&]<class T0, class T1>() {
      ctx.cpu_pool().parallel_for(static_cast<std::int64_t>(chunks.size()), [&](std::int64_t c) {
        const cpu::Chunk& chunk = chunks[static_cast<std::size_t>(c)];
        const auto& span = spans[chunk.span];
        const std::int64_t leaf = first[chunk.span] + chunk.lo / kNormLeaf;
        if constexpr (Depth == 1) {
          cpu::leaf_sums_range(static_cast<const T0*>(span.data[0]), span.size, chunk.lo, chunk.hi,
                               leaves[0] + leaf);
        } else {
          constexpr std::int64_t kStride = 16 * kNormLeaf;  // elements per turn
          for (std::int64_t lo = chunk.lo; lo < chunk.hi; lo += kStride) {
            const std::int64_t hi = std::min(chunk.hi, lo + kStride);
            const std::int64_t at = leaf + (lo - chunk.lo) / kNormLeaf;
            cpu::leaf_sums_range(static_cast<const T0*>(span.data[0]), span.size, lo, hi,
                                 leaves[0] + at);
            cpu::leaf_sums_range(static_cast<const T1*>(span.data[1]), span.size, lo, hi,
                                 leaves[1] + at);
          }
        }
      });
    };
    visit_element_dtype(dtypes[0], [&]<class T0>() {
      if constexpr (Depth == 1)
        run.template operator()<T0, T0>();
      else
        visit_element_dtype(dtypes[1], [&]<class T1>() { run.template operator()<T0, T1>(); });
    });
  }
};

static_assert(OpsBackend<Cpu>);

}  // namespace shardkit::ops
