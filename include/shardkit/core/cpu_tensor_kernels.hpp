// The CPU's tensor loops: what fill, copy, add_, divide_ and the random fills (tensor_ops.hpp)
// run on host memory, for every dtype and any strides, on the context's CPU threads where no
// element is written twice. The CPU's DeviceKernels table (cpu_kernel_table.hpp) is made of
// them, as the CUDA one is of kernels/core/tensor_kernels.cuh.
#pragma once

#include <algorithm>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>

#include "shardkit/core/context.hpp"
#include "shardkit/core/half_runs.hpp"
#include "shardkit/core/philox_batch.hpp"
#include "shardkit/core/small_object_pool.hpp"
#include "shardkit/core/strided_loop.hpp"
#include "shardkit/core/tensor.hpp"
#include "shardkit/core/transpose_blocks.hpp"

namespace shardkit::detail {

// Whether an element-wise host loop writing `dst` may run on the rank's CPU threads: each call
// writes one element of a contiguous tensor (no element is written twice), and reads `src`
// (if defined) only where no other call writes. Otherwise the loop runs on one thread, in
// order, which is what overlapping copies mean.
inline bool loop_may_run_in_parallel(const Tensor& dst, const Tensor& src = {}) {
  if (!dst.is_contiguous()) return false;
  if (!src.defined() || src.numel() == 0) return true;
  const auto [dst_first, dst_last] = byte_span(dst);
  const auto [src_first, src_last] = byte_span(src);
  return dst_last <= src_first || src_last <= dst_first;
}

template <class T>
inline constexpr bool is_floating_storage_v =
    std::is_floating_point_v<T> || std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>;

// for_each_element on `ctx`'s CPU threads when loop_may_run_in_parallel says it may. Only
// copies and additions within one floating-point dtype (`Threaded`) take the threaded strided
// and tiled paths: those are the large tensors training moves. Integer tensors (labels,
// indices) and copies between two dtypes stay on one thread -- except the contiguous casts
// between f32 and f16 / bf16, which run as SIMD runs on the threads (copy_on_host) -- which keeps
// the paths from being compiled for every pair of dtypes. (fill and divide_ use
// host_contiguous_or_strided below; a transposing copy within one 4- or 2-byte dtype, integers
// included, moves bytes in transposing_copy.)
template <bool Threaded, class Fn>
void host_elementwise(Context& ctx, bool parallel, const Tensor& dst, const Shape& src_strides,
                      Fn&& fn) {
  if constexpr (Threaded) {
    if (parallel)
      return parallel_for_each_element(ctx.cpu_pool(), dst.shape(), dst.strides(), src_strides, fn);
  }
  for_each_element(dst.shape(), dst.strides(), src_strides, fn);
}

// update(dst[i], src[i]) for every element (update assigns to its first argument), any
// strides, every pair of dtypes: the host loop of copy.
template <class Update>
void host_update(Context& ctx, bool parallel, const Tensor& dst, const Tensor& src, Update update) {
  visit_dtype(dst.dtype(), [&](auto dst_tag) {
    using D = decltype(dst_tag);
    visit_dtype(src.dtype(), [&](auto src_tag) {
      using S = decltype(src_tag);
      D* out = static_cast<D*>(dst.data_ptr());
      const S* in = static_cast<const S*>(src.data_ptr());
      host_elementwise<std::is_same_v<D, S> && is_floating_storage_v<D>>(
          ctx, parallel, dst, src.strides(),
          [&](std::int64_t, std::int64_t d, std::int64_t s) { update(out[d], in[s]); });
    });
  });
}

// fn(offset) for every element of one tensor that nothing else reads: a contiguous tensor's
// elements are one flat range, cut into tasks on `ctx`'s CPU threads with a plain loop the
// compiler vectorises; a strided one is walked on the calling thread (views being filled or
// scaled are small). Neither path can tile, so it compiles cheaply for every dtype.
template <class Fn>
void host_contiguous_or_strided(Context& ctx, const Tensor& t, Fn&& fn) {
  if (!t.is_contiguous())
    return for_each_element(t.shape(), t.strides(), t.strides(),
                            [&](std::int64_t, std::int64_t at, std::int64_t) { fn(at); });
  for_each_chunk(ctx.cpu_pool(), t.numel(), kElementsPerTask,
                 [&](std::int64_t first, std::int64_t end) {
                   for (std::int64_t at = first; at < end; ++at) fn(at);
                 });
}

// A copy between tensors of one dtype that reads `src` across `dst`'s rows with unit stride
// along one of them (x.transpose(...) made contiguous, the common case): tiles of SIMD-transposed
// blocks (transpose_blocks.hpp) on the context's threads. False when the layout is another.
inline bool transposing_copy(Context& ctx, const Tensor& dst, const Tensor& src) {
  const std::size_t bytes = dtype_size(dst.dtype());
  if (dst.dtype() != src.dtype() || !has_transpose_kernel(bytes) || !dst.is_contiguous())
    return false;
  const std::int64_t k = transposed_dimension(dst.shape(), src.strides());
  if (k < 0 || src.strides()[static_cast<std::size_t>(k)] != 1) return false;
  const auto d = static_cast<std::size_t>(k), last = static_cast<std::size_t>(dst.dim() - 1);
  const std::int64_t ld_in = src.strides()[last], ld_out = dst.strides()[d];
  auto* out = static_cast<char*>(dst.data_ptr());
  const auto* in = static_cast<const char*>(src.data_ptr());
  constexpr std::int64_t kTile = 64;  // 16 KiB of f32 each way
  for_each_tile(ctx.cpu_pool(), dst.shape(), dst.strides(), src.strides(), d, kTile,
                [&](std::int64_t, std::int64_t base_a, std::int64_t base_b, std::int64_t i_begin,
                    std::int64_t i_end, std::int64_t j_begin, std::int64_t j_end) {
                  const std::int64_t at_out = base_a + i_begin * ld_out + j_begin;
                  const std::int64_t at_in = base_b + j_begin * ld_in + i_begin;
                  const auto step = static_cast<std::int64_t>(bytes);
                  if (bytes == 4)
                    transpose_block<4>(in + at_in * step, ld_in, out + at_out * step, ld_out,
                                       i_end - i_begin, j_end - j_begin);
                  else
                    transpose_block<2>(in + at_in * step, ld_in, out + at_out * step, ld_out,
                                       i_end - i_begin, j_end - j_begin);
                });
  return true;
}

// dst and src with their dimensions put in dst's memory order (outermost first), when that
// makes dst contiguous: a dense tensor stored in another order of its dimensions, as a
// channels-last one (core/channels_last.hpp).
inline std::optional<std::pair<Tensor, Tensor>> in_memory_order(const Tensor& dst,
                                                                const Tensor& src) {
  const std::size_t rank = static_cast<std::size_t>(dst.dim());
  SmallVector<std::size_t, 6> order(rank);
  for (std::size_t d = 0; d < rank; ++d) order[d] = d;
  std::stable_sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return dst.strides()[a] > dst.strides()[b];
  });
  Shape shape(rank), dst_strides(rank), src_strides(rank);
  for (std::size_t d = 0; d < rank; ++d) {
    shape[d] = dst.shape()[order[d]];
    dst_strides[d] = dst.strides()[order[d]];
    src_strides[d] = src.strides()[order[d]];
  }
  Tensor permuted(dst.storage(), shape, std::move(dst_strides), dst.dtype(), dst.offset());
  if (!permuted.is_contiguous()) return std::nullopt;
  return std::pair{std::move(permuted), Tensor(src.storage(), std::move(shape),
                                               std::move(src_strides), src.dtype(), src.offset())};
}

inline void copy_on_host(Context& ctx, const Tensor& dst, const Tensor& src) {
  if (!dst.is_contiguous() && dst.dim() > 1) {
    if (const auto permuted = in_memory_order(dst, src)) {
      copy_on_host(ctx, permuted->first, permuted->second);
      return;
    }
  }
  const bool parallel = loop_may_run_in_parallel(dst, src);
  if (parallel && transposing_copy(ctx, dst, src)) return;
  if (dst.dtype() == src.dtype() && dst.is_contiguous() && src.is_contiguous()) {
    if (!parallel) {  // overlapping: memmove's semantics
      std::memmove(dst.data_ptr(), src.data_ptr(), dst.nbytes());
      return;
    }
    auto* out = static_cast<char*>(dst.data_ptr());
    const auto* in = static_cast<const char*>(src.data_ptr());
    constexpr std::int64_t kBytesPerTask = std::int64_t{1} << 20;
    for_each_chunk(ctx.cpu_pool(), static_cast<std::int64_t>(dst.nbytes()), kBytesPerTask,
                   [&](std::int64_t first, std::int64_t end) {
                     std::memcpy(out + first, in + first, static_cast<std::size_t>(end - first));
                   });
    return;
  }
  bool converted = false;  // by a SIMD run (half_runs.hpp), the same bits
  if (parallel && dst.is_contiguous() && src.is_contiguous())
    visit_dtype(dst.dtype(), [&](auto dst_tag) {
      using D = decltype(dst_tag);
      visit_dtype(src.dtype(), [&](auto src_tag) {
        using S = decltype(src_tag);
        if constexpr (has_convert_run<S, D>) {
          D* out = static_cast<D*>(dst.data_ptr());
          const S* in = static_cast<const S*>(src.data_ptr());
          for_each_chunk(ctx.cpu_pool(), dst.numel(), kElementsPerTask,
                         [&](std::int64_t first, std::int64_t end) {
                           convert_run(in + first, out + first, end - first);
                         });
          converted = true;
        }
      });
    });
  if (converted) return;
  host_update(ctx, parallel, dst, src, [](auto& out, auto in) {
    out = convert_value<std::remove_reference_t<decltype(out)>>(in);
  });
}

inline void fill_on_host(Context& ctx, const Tensor& t, double value) {
  visit_dtype(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* data = static_cast<T*>(t.data_ptr());
    const T converted = convert_value<T>(value);
    host_contiguous_or_strided(ctx, t, [&](std::int64_t at) { data[at] = converted; });
  });
}

// dst += src. Between two dtypes, src is first converted into a dst-typed copy (copy_on_host's
// conversion: the value the sum would convert it to) and then added within one dtype, the same
// bits as converting each element inside the loop: the addition's loops are compiled for the
// seven dtypes instead of the 49 pairs, which were more than a quarter of the CPU's kernel
// tables' code and of their compile (docs/design.md, "Build"). Gradients are added within one
// dtype; a sum across dtypes is rare and pays a copy.
inline void add_on_host(Context& ctx, const Tensor& dst, const Tensor& src) {
  if (dst.dtype() != src.dtype()) {
    const auto bytes = static_cast<std::size_t>(src.numel()) * dtype_size(dst.dtype());
    const Tensor converted(
        make_pooled<Storage>(ctx.host_allocator_ptr(), bytes, MemoryCategory::other), src.shape(),
        dst.dtype());
    copy_on_host(ctx, converted, src);
    return add_on_host(ctx, dst, converted);
  }
  visit_dtype(dst.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* out = static_cast<T*>(dst.data_ptr());
    const T* in = static_cast<const T*>(src.data_ptr());
    host_elementwise<is_floating_storage_v<T>>(
        ctx, loop_may_run_in_parallel(dst, src), dst, src.strides(),
        [&](std::int64_t, std::int64_t d, std::int64_t s) { out[d] = add_value(out[d], in[s]); });
  });
}

inline void divide_on_host(Context& ctx, const Tensor& t, double divisor) {
  visit_dtype(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
    T* data = static_cast<T*>(t.data_ptr());
    const Acc by = static_cast<Acc>(divisor);
    host_contiguous_or_strided(ctx, t, [&](std::int64_t at) {
      data[at] = convert_value<T>(convert_value<Acc>(data[at]) / by);
    });
  });
}

inline void random_on_host(Context& ctx, const Tensor& t, const RandomSpec& spec) {
  visit_dtype(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_floating_point_v<T> || std::is_same_v<T, Half> ||
                  std::is_same_v<T, BFloat16>) {
      T* data = static_cast<T*>(t.data_ptr());
      const T ceiling = spec.uniform_ceiling<T>();
      if (!t.is_contiguous()) {  // (rare) one Philox block per element, in order
        for_each_element(t.shape(), t.strides(), t.strides(),
                         [&](std::int64_t index, std::int64_t at, std::int64_t) {
                           data[at] = spec.stored_as<T>(
                               spec.value_at(static_cast<std::uint64_t>(index)), ceiling);
                         });
        return;
      }
      auto count = static_cast<std::uint64_t>(t.numel());
      const std::uint64_t per_block = spec.elements_per_block();
      RandomSpec whole = spec;
      if (whole.skip != 0) {  // (a range from inside a block) its first elements one by one
        const std::uint64_t head = std::min(count, per_block - whole.skip);
        for (std::uint64_t j = 0; j < head; ++j)
          data[j] = whole.stored_as<T>(whole.value_at(j), ceiling);
        whole = whole.from_element(head);
        data += head;
        count -= head;
      }
      // Each block drawn once for the elements it gives, tasks of whole batches of blocks on
      // the rank's threads: element i gets value_at(i) whatever the thread count.
      const std::uint64_t blocks = whole.blocks_for(count);
      static_assert(kElementsPerTask % (4 * kPhiloxBatch) == 0, "tasks of whole batches");
      for_each_chunk(
          ctx.cpu_pool(), static_cast<std::int64_t>(blocks),
          static_cast<std::int64_t>(kElementsPerTask / per_block),
          [&](std::int64_t first, std::int64_t last) {
            // (A copy the stores cannot alias, so g++ keeps a and b in registers and
            // vectorises the element loops below.)
            const RandomSpec rule = whole;
            std::uint32_t words[4 * kPhiloxBatch];
            for (auto k = static_cast<std::uint64_t>(first); k < static_cast<std::uint64_t>(last);
                 k += kPhiloxBatch) {
              philox_batch(whole.seed, whole.counter_base + k, words);  // (past `last`: unused)
              const std::uint64_t begin = k * per_block;
              const std::uint64_t end =
                  std::min({count, static_cast<std::uint64_t>(last) * per_block,
                            (k + kPhiloxBatch) * per_block});
              T* out = data + begin;
              if (whole.kind == RandomKind::uniform) {  // word j is element begin + j
                for (std::uint64_t j = 0; j < end - begin; ++j)
                  out[j] = rule.stored_as<T>(rule.uniform_value(words[j]), ceiling);
              } else if (whole.kind == RandomKind::keep_mask) {  // (the same)
                for (std::uint64_t j = 0; j < end - begin; ++j)
                  out[j] = rule.stored_as<T>(rule.mask_value(words[j]), ceiling);
              } else {  // words 2j, 2j + 1 are element begin + j's
                for (std::uint64_t j = 0; j < end - begin; ++j)
                  out[j] =
                      rule.stored_as<T>(rule.normal_value(words[2 * j], words[2 * j + 1]), ceiling);
              }
            }
          });
    }
  });
}

}  // namespace shardkit::detail
