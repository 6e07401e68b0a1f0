// Creating, filling, copying and moving tensors: CPU loops here, CUDA through the context's
// device kernels and the CUDA runtime. Every function takes the rank's Context.
#pragma once

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "shardkit/core/context.hpp"
#include "shardkit/core/half_runs.hpp"
#include "shardkit/core/philox_batch.hpp"
#include "shardkit/core/strided_loop.hpp"
#include "shardkit/core/tensor.hpp"
#include "shardkit/core/transpose_blocks.hpp"

namespace shardkit {

namespace detail {

inline void check_on_context(const Context& ctx, const Tensor& t, const char* op) {
  check(t.defined(), op, ": the tensor is undefined");
  check(t.device().is_cpu() || t.device() == ctx.device(), op, ": tensor on ", t.device().str(),
        " used with a context on ", ctx.device().str(), "; move it with sk::to_device first");
}

inline Allocator& allocator_for(const Context& ctx, Device device) {
  if (device == ctx.device()) return ctx.allocator();
  check(device.is_cpu(), "cannot allocate on ", device.str(), " from a context on ",
        ctx.device().str(), "; use that device's own context");
  return ctx.host_allocator();
}

inline const std::shared_ptr<Allocator>& allocator_ptr_for(const Context& ctx, Device device) {
  (void)allocator_for(ctx, device);  // validates
  return device == ctx.device() ? ctx.allocator_ptr() : ctx.host_allocator_ptr();
}

// The bytes a tensor's elements can touch, [first, last).
inline std::pair<const char*, const char*> byte_span(const Tensor& t) {
  std::int64_t low = 0, high = 0;
  for (std::size_t d = 0; d < t.shape().size(); ++d)
    (t.strides()[d] < 0 ? low : high) += (t.shape()[d] - 1) * t.strides()[d];
  const auto* base = static_cast<const char*>(t.data_ptr());
  const auto size = static_cast<std::int64_t>(t.element_size());
  return {base + low * size, base + (high + 1) * size};
}

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
// copies and additions between floating-point storage (`Threaded`) take the threaded strided
// and tiled paths: those are the large tensors training moves; integer tensors (labels,
// indices) stay on one thread, which keeps copies between every pair of dtypes from compiling
// each path 49 times. (fill and divide_ use host_contiguous_or_strided below; a transposing
// copy within one 4- or 2-byte dtype, integers included, moves bytes in transposing_copy.)
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
// strides, every pair of dtypes: the host loop of copy and of add_.
template <class Update>
void host_update(Context& ctx, bool parallel, const Tensor& dst, const Tensor& src, Update update) {
  visit_dtype(dst.dtype(), [&](auto dst_tag) {
    using D = decltype(dst_tag);
    visit_dtype(src.dtype(), [&](auto src_tag) {
      using S = decltype(src_tag);
      D* out = static_cast<D*>(dst.data_ptr());
      const S* in = static_cast<const S*>(src.data_ptr());
      host_elementwise<is_floating_storage_v<D> && is_floating_storage_v<S>>(
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

}  // namespace detail

// Uninitialised tensor on `device` (default: the context's), counted under `category`.
inline Tensor empty(Context& ctx, Shape shape, DType dtype,
                    MemoryCategory category = MemoryCategory::other) {
  const auto bytes = static_cast<std::size_t>(shape_numel(shape)) * dtype_size(dtype);
  return Tensor(std::make_shared<Storage>(ctx.allocator_ptr(), bytes, category), std::move(shape),
                dtype);
}

inline Tensor empty_on(Context& ctx, Device device, Shape shape, DType dtype,
                       MemoryCategory category = MemoryCategory::other) {
  const auto bytes = static_cast<std::size_t>(shape_numel(shape)) * dtype_size(dtype);
  return Tensor(std::make_shared<Storage>(detail::allocator_ptr_for(ctx, device), bytes, category),
                std::move(shape), dtype);
}

inline void fill(Context& ctx, const Tensor& t, double value) {
  detail::check_on_context(ctx, t, "fill");
  if (t.device().is_cuda()) return ctx.kernels().fill(ctx, t, value);
  visit_dtype(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    T* data = static_cast<T*>(t.data_ptr());
    const T converted = convert_value<T>(value);
    detail::host_contiguous_or_strided(ctx, t, [&](std::int64_t at) { data[at] = converted; });
  });
}

inline Tensor full(Context& ctx, Shape shape, DType dtype, double value,
                   MemoryCategory category = MemoryCategory::other) {
  Tensor t = empty(ctx, std::move(shape), dtype, category);
  fill(ctx, t, value);
  return t;
}

inline Tensor zeros(Context& ctx, Shape shape, DType dtype,
                    MemoryCategory category = MemoryCategory::other) {
  return full(ctx, std::move(shape), dtype, 0.0, category);
}

namespace detail {

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

inline void copy_on_host(Context& ctx, const Tensor& dst, const Tensor& src) {
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

}  // namespace detail

inline Tensor contiguous(Context& ctx, const Tensor& t);

// dst = src, elementwise. Same shape; any strides. Dtypes may differ on one device (the values
// are converted); between host and device they must match. Copies between host and device
// return when the data has arrived.
inline void copy(Context& ctx, const Tensor& dst, const Tensor& src) {
  detail::check_on_context(ctx, dst, "copy (destination)");
  detail::check_on_context(ctx, src, "copy (source)");
  check(dst.shape() == src.shape(), "copy: destination shape ", shape_str(dst.shape()),
        " differs from source shape ", shape_str(src.shape()));
  if (dst.numel() == 0) return;
  const bool dst_cuda = dst.device().is_cuda(), src_cuda = src.device().is_cuda();
  if (!dst_cuda && !src_cuda) return detail::copy_on_host(ctx, dst, src);
  if (dst_cuda && src_cuda) return ctx.kernels().copy(ctx, dst, src);
#if SK_WITH_CUDA
  check(dst.dtype() == src.dtype(), "copy between host and device needs equal dtypes, got ",
        dtype_name(src.dtype()), " -> ", dtype_name(dst.dtype()),
        "; convert on one side first (sk::copy into a tensor of the wanted dtype)");
  // Transfers move contiguous bytes: stage non-contiguous sides through contiguous temporaries.
  const Tensor packed_src = contiguous(ctx, src);
  const Tensor packed_dst =
      dst.is_contiguous() ? dst : empty_on(ctx, dst.device(), dst.shape(), dst.dtype());
  CudaDeviceGuard guard(ctx.device().index);
  SK_CUDA_CHECK(cudaMemcpyAsync(packed_dst.data_ptr(), packed_src.data_ptr(), dst.nbytes(),
                                cudaMemcpyDefault, ctx.stream()));
  ctx.synchronize();
  if (!dst.is_contiguous()) copy(ctx, dst, packed_dst);
#else
  fail<NotAvailable>("copy to or from ", (dst_cuda ? dst : src).device().str(),
                     " in a build without CUDA; rebuild with -Dcuda=enabled");
#endif
}

// dst = src without waiting for a transfer between host and device: the copy is queued on the
// context's stream and the host may go on (CPU offload overlaps its host-side work with the
// transfers this way); neither side may be touched by the host before ctx.synchronize(). Both
// sides contiguous, of one dtype; the host side should be pinned memory, or the driver copies
// synchronously. On the host alone, and for anything else, it is copy().
inline void copy_async(Context& ctx, const Tensor& dst, const Tensor& src) {
#if SK_WITH_CUDA
  detail::check_on_context(ctx, dst, "copy_async (destination)");
  detail::check_on_context(ctx, src, "copy_async (source)");
  const bool transfer = dst.device().is_cuda() != src.device().is_cuda();
  if (transfer && dst.numel() > 0 && dst.shape() == src.shape() && dst.dtype() == src.dtype() &&
      dst.is_contiguous() && src.is_contiguous()) {
    CudaDeviceGuard guard(ctx.device().index);
    SK_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), dst.nbytes(), cudaMemcpyDefault,
                                  ctx.stream()));
    return;
  }
#endif
  copy(ctx, dst, src);
}

// dst += src, elementwise, on one device. Same shape, any strides; src is converted to dst's
// dtype, the sum is formed as add_value does (floats in f32, f64 for f64 tensors, rounded once;
// integers exactly). How gradients that arrive in pieces (accumulation, reductions landing
// beside their target) are added, and batch-norm's counter counts.
inline void add_(Context& ctx, const Tensor& dst, const Tensor& src) {
  detail::check_on_context(ctx, dst, "add_ (destination)");
  detail::check_on_context(ctx, src, "add_ (source)");
  check(dst.shape() == src.shape(), "add_: destination shape ", shape_str(dst.shape()),
        " differs from source shape ", shape_str(src.shape()));
  check(dst.device() == src.device(), "add_: destination on ", dst.device().str(),
        " but source on ", src.device().str(), "; copy one side over first");
  if (dst.numel() == 0) return;
  if (dst.device().is_cuda()) return ctx.kernels().add(ctx, dst, src);
  detail::host_update(
      ctx, detail::loop_may_run_in_parallel(dst, src), dst, src, [](auto& out, auto in) {
        out = add_value(out, convert_value<std::remove_reference_t<decltype(out)>>(in));
      });
}

// t /= divisor, elementwise, any strides: formed in f32 (f64 for f64 tensors) and rounded once
// -- the collectives' average (comm/reduction.hpp), for sums reduced in more than one step.
inline void divide_(Context& ctx, const Tensor& t, double divisor) {
  detail::check_on_context(ctx, t, "divide_");
  check(divisor != 0.0, "divide_: the divisor is 0; pass a non-zero divisor");
  if (t.numel() == 0) return;
  if (t.device().is_cuda()) return ctx.kernels().divide(ctx, t, divisor);
  visit_dtype(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
    T* data = static_cast<T*>(t.data_ptr());
    const Acc by = static_cast<Acc>(divisor);
    detail::host_contiguous_or_strided(ctx, t, [&](std::int64_t at) {
      data[at] = convert_value<T>(convert_value<Acc>(data[at]) / by);
    });
  });
}

// `t` itself if already contiguous, else a contiguous copy on the same device.
inline Tensor contiguous(Context& ctx, const Tensor& t) {
  if (t.is_contiguous()) return t;
  Tensor out = empty_on(ctx, t.device(), t.shape(), t.dtype(), t.storage()->category());
  copy(ctx, out, t);
  return out;
}

inline Tensor clone(Context& ctx, const Tensor& t) {
  Tensor out = empty_on(ctx, t.device(), t.shape(), t.dtype(), t.storage()->category());
  copy(ctx, out, t);
  return out;
}

// A copy of `t` on `device` (the context's device or the CPU), contiguous, same category.
inline Tensor to_device(Context& ctx, const Tensor& t, Device device) {
  Tensor out = empty_on(ctx, device, t.shape(), t.dtype(), t.storage()->category());
  copy(ctx, out, t);
  return out;
}

// A copy of `t` converted to `dtype`, on the same device.
inline Tensor cast(Context& ctx, const Tensor& t, DType dtype) {
  Tensor out = empty_on(ctx, t.device(), t.shape(), dtype, t.storage()->category());
  copy(ctx, out, t);
  return out;
}

// A tensor on the context's device holding `values` (row-major), shaped `shape` (waits for the
// upload; counted in ctx.host_waits() on every device).
template <class T>
Tensor from_vector(Context& ctx, const std::vector<T>& values, Shape shape,
                   MemoryCategory category = MemoryCategory::other) {
  check(shape_numel(shape) == static_cast<std::int64_t>(values.size()),
        "from_vector: ", values.size(), " values do not fill shape ", shape_str(shape));
  ctx.count_host_upload();
  auto host_storage =
      Storage::borrow(const_cast<T*>(values.data()), values.size() * sizeof(T), Device::cpu());
  const Tensor host(host_storage, shape, dtype_of<T>);
  Tensor out = empty(ctx, std::move(shape), dtype_of<T>, category);
  copy(ctx, out, host);
  return out;
}

// The elements of `t` in row-major order, on the host (waits for the device; counted in
// ctx.host_waits() on every device).
template <class T>
std::vector<T> to_vector(Context& ctx, const Tensor& t) {
  check(dtype_of<T> == t.dtype(), "to_vector<", dtype_name(dtype_of<T>), "> of a ",
        dtype_name(t.dtype()), " tensor; ask for its own element type or cast first");
  ctx.count_host_read();
  std::vector<T> values(static_cast<std::size_t>(t.numel()));
  auto host_storage = Storage::borrow(values.data(), values.size() * sizeof(T), Device::cpu());
  copy(ctx, Tensor(host_storage, t.shape(), t.dtype()), t);
  return values;
}

namespace detail {

inline void random_fill(Context& ctx, const Tensor& t, RandomSpec spec, const char* op) {
  check_on_context(ctx, t, op);
  check(is_floating(t.dtype()), op, " needs a floating-point tensor, got ", dtype_name(t.dtype()));
  spec.seed = ctx.seed();
  spec.counter_base =
      ctx.take_random_blocks(spec.blocks_for(static_cast<std::uint64_t>(t.numel())));
  if (t.device().is_cuda()) return ctx.kernels().random(ctx, t, spec);
  visit_dtype(t.dtype(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (std::is_floating_point_v<T> || std::is_same_v<T, Half> ||
                  std::is_same_v<T, BFloat16>) {
      T* data = static_cast<T*>(t.data_ptr());
      if (!t.is_contiguous()) {  // (rare) one Philox block per element, in order
        for_each_element(t.shape(), t.strides(), t.strides(),
                         [&](std::int64_t index, std::int64_t at, std::int64_t) {
                           data[at] =
                               convert_value<T>(spec.value_at(static_cast<std::uint64_t>(index)));
                         });
        return;
      }
      // Each block drawn once for the elements it gives, tasks of whole batches of blocks on
      // the rank's threads: element i gets value_at(i) whatever the thread count.
      const auto count = static_cast<std::uint64_t>(t.numel());
      const std::uint64_t per_block = spec.elements_per_block();
      const std::uint64_t blocks = spec.blocks_for(count);
      static_assert(kElementsPerTask % (4 * kPhiloxBatch) == 0, "tasks of whole batches");
      for_each_chunk(
          ctx.cpu_pool(), static_cast<std::int64_t>(blocks),
          static_cast<std::int64_t>(kElementsPerTask / per_block),
          [&](std::int64_t first, std::int64_t last) {
            // (A copy the stores cannot alias, so g++ keeps a and b in registers and
            // vectorises the element loops below.)
            const RandomSpec rule = spec;
            std::uint32_t words[4 * kPhiloxBatch];
            for (auto k = static_cast<std::uint64_t>(first); k < static_cast<std::uint64_t>(last);
                 k += kPhiloxBatch) {
              philox_batch(spec.seed, spec.counter_base + k, words);  // (past `last`: unused)
              const std::uint64_t begin = k * per_block;
              const std::uint64_t end =
                  std::min({count, static_cast<std::uint64_t>(last) * per_block,
                            (k + kPhiloxBatch) * per_block});
              T* out = data + begin;
              if (spec.kind == RandomKind::uniform) {  // word j is element begin + j
                for (std::uint64_t j = 0; j < end - begin; ++j)
                  out[j] = convert_value<T>(rule.uniform_value(words[j]));
              } else {  // words 2j, 2j + 1 are element begin + j's
                for (std::uint64_t j = 0; j < end - begin; ++j)
                  out[j] = convert_value<T>(rule.normal_value(words[2 * j], words[2 * j + 1]));
              }
            }
          });
    }
  });
}

}  // namespace detail

// Uniform on [low, high), from the context's counter-based stream (same numbers on any device).
inline void uniform_(Context& ctx, const Tensor& t, double low, double high) {
  check(low <= high, "uniform_: low ", low, " is above high ", high);
  detail::random_fill(ctx, t, RandomSpec{RandomKind::uniform, low, high, 0, 0}, "uniform_");
}

// Normal with `mean` and `stddev`, from the context's counter-based stream.
inline void normal_(Context& ctx, const Tensor& t, double mean, double stddev) {
  check(stddev >= 0, "normal_: stddev must be >= 0, got ", stddev);
  detail::random_fill(ctx, t, RandomSpec{RandomKind::normal, mean, stddev, 0, 0}, "normal_");
}

}  // namespace shardkit
