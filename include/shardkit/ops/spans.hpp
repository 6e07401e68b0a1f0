// Spans: the unit every fused op walks. A span is one contiguous run of elements, the same run in
// each operand (param, grad, momentum, ...). A list of spans is a list of tensors, or segments
// of flat buffers (each segment a view at any element offset). Spans are cut into fixed chunks;
// reductions produce one partial per chunk, summed in a fixed order, so results never depend
// on scheduling.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "shardkit/core/context.hpp"
#include "shardkit/core/tensor.hpp"

namespace shardkit::ops {

// Elements per chunk: one CUDA block's work and the granularity of reduction partials. A power
// of two and a multiple of the vector width, so chunk starts keep a span's alignment.
inline constexpr std::int64_t kChunkElements = 8192;
// Elements per vector access: 16 bytes of f32, 8 bytes of f16/bf16.
inline constexpr int kVectorElements = 4;

template <int Depth>
struct Span {
  std::array<void*, Depth> data{};  // first element in each operand; nullptr for unused ones
  std::int64_t size = 0;            // elements
};

template <int Depth>
using SpanList = std::vector<Span<Depth>>;

inline std::int64_t chunks_of(std::int64_t size) {
  return (size + kChunkElements - 1) / kChunkElements;
}

template <int Depth>
std::int64_t total_chunks(const SpanList<Depth>& spans) {
  std::int64_t total = 0;
  for (const auto& span : spans) total += chunks_of(span.size);
  return total;
}

// One operand of an op: a list of tensors (one per span), its required dtype, and its name for
// error messages. An empty list means the operand is unused by this call.
struct OperandList {
  std::span<const Tensor> tensors;
  DType dtype = DType::f32;
  const char* name = "";
};

// Builds Depth-operand spans from tensor lists, checking what the kernels rely on: equal counts
// and sizes, the expected dtype, contiguity, and memory on the context's device (or the host
// for a CPU context). `required` operands must be given; others may be empty.
template <int Depth>
SpanList<Depth> make_spans(const Context& ctx, const char* op,
                           const std::array<OperandList, Depth>& operands,
                           const std::array<bool, Depth>& required) {
  std::size_t count = 0;
  for (const auto& operand : operands) count = std::max(count, operand.tensors.size());
  if (count == 0) return {};  // no parameters: nothing to do
  for (int k = 0; k < Depth; ++k) {
    const auto& operand = operands[static_cast<std::size_t>(k)];
    if (operand.tensors.empty()) {
      check(!required[static_cast<std::size_t>(k)], op, ": the ", operand.name,
            " list is empty but this op needs it; pass one tensor per parameter");
      continue;
    }
    check(operand.tensors.size() == count, op, ": ", operand.tensors.size(), " ", operand.name,
          " tensors but ", count, " in another list; pass one of each per parameter");
  }
  SpanList<Depth> spans(count);
  std::vector<bool> sized(count, false);
  for (int k = 0; k < Depth; ++k) {
    const auto& operand = operands[static_cast<std::size_t>(k)];
    for (std::size_t i = 0; i < operand.tensors.size(); ++i) {
      const Tensor& t = operand.tensors[i];
      check(t.defined(), op, ": ", operand.name, "[", i, "] is undefined");
      check(t.dtype() == operand.dtype, op, ": ", operand.name, "[", i, "] is ",
            dtype_name(t.dtype()), ", expected ", dtype_name(operand.dtype),
            "; cast it or pick the matching option");
      check(t.is_contiguous(), op, ": ", operand.name, "[", i, "] ", shape_text(t.shape()),
            " is not contiguous; fused ops walk contiguous memory (use sk::contiguous)");
      check(t.device() == ctx.device(), op, ": ", operand.name, "[", i, "] is on ", t.device(),
            " but the context is on ", ctx.device(), "; move it with sk::to_device");
      Span<Depth>& span = spans[i];
      if (!sized[i]) span.size = t.numel();
      sized[i] = true;
      check(t.numel() == span.size, op, ": ", operand.name, "[", i, "] has ", t.numel(),
            " elements but the other operands of parameter ", i, " have ", span.size);
      span.data[static_cast<std::size_t>(k)] = t.numel() > 0 ? t.data_ptr() : nullptr;
    }
  }
  return spans;
}

}  // namespace shardkit::ops
