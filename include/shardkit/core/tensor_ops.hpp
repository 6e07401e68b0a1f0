// Creating, filling, copying and moving tensors, on the CPU through its loops
// (cpu_tensor_kernels.hpp), on a GPU through the context's device kernels and the CUDA runtime.
// Every function takes the rank's Context.
#pragma once

#include <utility>
#include <vector>

#include "shardkit/core/context.hpp"
#include "shardkit/core/cpu_kernel_table.hpp"
#include "shardkit/core/small_object_pool.hpp"
#include "shardkit/core/tensor.hpp"

namespace shardkit {

namespace detail {

inline void check_on_context(const Context& ctx, const Tensor& t, const char* op) {
  check(t.defined(), op, ": the tensor is undefined");
  check(t.device().is_cpu() || t.device() == ctx.device(), op, ": tensor on ", t.device(),
        " used with a context on ", ctx.device(), "; move it with sk::to_device first");
}

inline Allocator& allocator_for(const Context& ctx, Device device) {
  if (device == ctx.device()) return ctx.allocator();
  check(device.is_cpu(), "cannot allocate on ", device, " from a context on ", ctx.device(),
        "; use that device's own context");
  return ctx.host_allocator();
}

inline const std::shared_ptr<Allocator>& allocator_ptr_for(const Context& ctx, Device device) {
  (void)allocator_for(ctx, device);  // validates
  return device == ctx.device() ? ctx.allocator_ptr() : ctx.host_allocator_ptr();
}

// The tensor kernels of t's device: the CPU's loops (cpu_kernel_table.hpp) or the CUDA
// kernels the context carries.
inline const DeviceKernels& tensor_kernels_for(const Context& ctx, const Tensor& t) {
  return t.device().is_cpu() ? cpu_tensor_kernels() : ctx.kernels();
}

}  // namespace detail

namespace detail {

// What touching a parameter built under DeferredParameters says.
inline constexpr const char* kDeferredReason =
    "a parameter built under DeferredParameters has no memory yet: ShardedModule gives it its "
    "values when it wraps the module (each rank making the values it keeps: under fsdp its "
    "shards), or nn::materialize(ctx, module) does; until then only whole-tensor sk::fill, "
    "sk::uniform_ and sk::normal_ (and nn::init's) are recorded";

// Whether `t` is all of its storage, in row-major order (what a recipe describes).
inline bool covers_storage(const Tensor& t) {
  return t.offset() == 0 && t.is_contiguous() && t.nbytes() == t.storage()->bytes();
}

// A fill of a deferred tensor: recorded on its storage, which it must cover whole.
inline void record_deferred_init(const Tensor& t, const InitRecipe& recipe, const char* op) {
  check<StateError>(covers_storage(t), op, " of part of a deferred tensor (", shape_text(t.shape()),
                    " at element ", t.offset(),
                    "): a parameter built under DeferredParameters records one fill of all of "
                    "it; initialise it whole, or build it outside the scope");
  t.storage()->record_init(recipe);
}

// The bytes of a new tensor of `shape` in `dtype`, refused by name where a size is negative or
// the count overflows (a wrapped product, 0 for [2^32, 2^32], gave a tensor without memory).
inline std::size_t storage_bytes(const Shape& shape, DType dtype) {
  check_sizes(shape);
  std::int64_t count = 1;
  bool overflow = false;
  for (const std::int64_t size : shape)
    overflow = overflow || __builtin_mul_overflow(count, size, &count);
  std::size_t bytes = 0;
  overflow = overflow ||
             __builtin_mul_overflow(static_cast<std::size_t>(count), dtype_size(dtype), &bytes);
  check(!overflow, "Tensor shape ", shape_text(shape), " of ", dtype_name(dtype),
        " holds more bytes than a size_t counts; a dimension is wrong");
  return bytes;
}

}  // namespace detail

// Built under DeferredParameters without memory and not materialized since (deferred_init.hpp).
inline bool is_deferred(const Tensor& t) { return t.defined() && t.storage()->deferred(); }

// Uninitialised tensor on `device` (default: the context's), counted under `category`. A
// parameter's under DeferredParameters gets no memory (deferred_init.hpp).
inline Tensor empty(Context& ctx, Shape shape, DType dtype,
                    MemoryCategory category = MemoryCategory::other) {
  const auto bytes = detail::storage_bytes(shape, dtype);
  if (category == MemoryCategory::parameters && ctx.defers_parameters()) [[unlikely]]
    return Tensor(make_pooled<Storage>(Storage::Deferred{}, ctx.allocator_ptr(), bytes, category,
                                       detail::kDeferredReason),
                  std::move(shape), dtype);
  return Tensor(make_pooled<Storage>(ctx.allocator_ptr(), bytes, category), std::move(shape),
                dtype);
}

inline Tensor empty_on(Context& ctx, Device device, Shape shape, DType dtype,
                       MemoryCategory category = MemoryCategory::other) {
  const auto bytes = detail::storage_bytes(shape, dtype);
  return Tensor(make_pooled<Storage>(detail::allocator_ptr_for(ctx, device), bytes, category),
                std::move(shape), dtype);
}

inline void fill(Context& ctx, const Tensor& t, double value) {
  detail::check_on_context(ctx, t, "fill");
  if (is_deferred(t)) [[unlikely]]
    return detail::record_deferred_init(t, InitRecipe::constant_fill(value), "fill");
  detail::tensor_kernels_for(ctx, t).fill(ctx, t, value);
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

inline Tensor contiguous(Context& ctx, const Tensor& t);
inline Tensor clone(Context& ctx, const Tensor& t);

namespace detail {

// Whether `src` shares bytes with `dst` without being the very same view (first element,
// strides, dtype). copy and add_ between such views read `src` as it was before the call --
// memmove's semantics -- on every device, by staging `src` first: the CUDA kernels visit the
// elements in no order, cudaMemcpy of overlapping ranges is undefined, and the host's in-order
// loop let a strided destination ahead of its source read values the call had already written.
inline bool overlaps_another_view(const Tensor& dst, const Tensor& src) {
  if (dst.data_ptr() == src.data_ptr() && dst.strides() == src.strides() &&
      dst.dtype() == src.dtype())
    return false;  // element i reads and writes element i only
  const auto [dst_first, dst_last] = byte_span(dst);
  const auto [src_first, src_last] = byte_span(src);
  return dst_first < src_last && src_first < dst_last;
}

}  // namespace detail

// dst = src, elementwise. Same shape; any strides; views of one buffer may overlap (src is read
// as it was, as memmove reads). Dtypes may differ on one device (the values are converted);
// between host and device they must match. Copies between host and device
// return when the data has arrived.
inline void copy(Context& ctx, const Tensor& dst, const Tensor& src) {
  detail::check_on_context(ctx, dst, "copy (destination)");
  detail::check_on_context(ctx, src, "copy (source)");
  check(dst.shape() == src.shape(), "copy: destination shape ", shape_text(dst.shape()),
        " differs from source shape ", shape_text(src.shape()));
  if (dst.numel() == 0) return;
  const bool dst_cuda = dst.device().is_cuda(), src_cuda = src.device().is_cuda();
  if (dst_cuda == src_cuda) {
    if (detail::overlaps_another_view(dst, src)) [[unlikely]]
      return detail::tensor_kernels_for(ctx, dst).copy(ctx, dst, clone(ctx, src));
    return detail::tensor_kernels_for(ctx, dst).copy(ctx, dst, src);
  }
#if SK_WITH_CUDA
  check(dst.dtype() == src.dtype(), "copy between host and device needs equal dtypes, got ",
        dtype_name(src.dtype()), " -> ", dtype_name(dst.dtype()),
        "; convert on one side first (sk::copy into a tensor of the wanted dtype)");
  // (refused before anything is queued: the synchronisation below would be, after a copy the
  // capture may already have failed on)
  ctx.refuse_in_capture("a copy between host and device (copy)",
                        "move the data before or after the step, or keep it on one device");
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
  fail<NotAvailable>("copy to or from ", (dst_cuda ? dst : src).device(),
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

// dst += src, elementwise, on one device. Same shape, any strides (overlapping views: src as it
// was before the call, as in copy); src is converted to dst's dtype, the sum is formed as
// add_value does (floats in f32, f64 for f64 tensors, rounded once; integers exactly). How
// gradients that arrive in pieces (accumulation, reductions landing beside their target) are added,
// and batch-norm's counter counts.
inline void add_(Context& ctx, const Tensor& dst, const Tensor& src) {
  detail::check_on_context(ctx, dst, "add_ (destination)");
  detail::check_on_context(ctx, src, "add_ (source)");
  check(dst.shape() == src.shape(), "add_: destination shape ", shape_text(dst.shape()),
        " differs from source shape ", shape_text(src.shape()));
  check(dst.device() == src.device(), "add_: destination on ", dst.device(), " but source on ",
        src.device(), "; copy one side over first");
  if (dst.numel() == 0) return;
  if (detail::overlaps_another_view(dst, src)) [[unlikely]]
    return detail::tensor_kernels_for(ctx, dst).add(ctx, dst, clone(ctx, src));
  detail::tensor_kernels_for(ctx, dst).add(ctx, dst, src);
}

// t /= divisor, elementwise, any strides: formed in f32 (f64 for f64 tensors) and rounded once
// -- the collectives' average (comm/reduction.hpp), for sums reduced in more than one step.
inline void divide_(Context& ctx, const Tensor& t, double divisor) {
  detail::check_on_context(ctx, t, "divide_");
  check(divisor != 0.0, "divide_: the divisor is 0; pass a non-zero divisor");
  if (t.numel() == 0) return;
  detail::tensor_kernels_for(ctx, t).divide(ctx, t, divisor);
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
        "from_vector: ", values.size(), " values do not fill shape ", shape_text(shape));
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
  // (A deferred tensor draws its blocks all the same: later fills get the same numbers as in an
  // eager build.)
  if (is_deferred(t)) [[unlikely]]
    return record_deferred_init(t, InitRecipe::random_fill(spec), op);
  tensor_kernels_for(ctx, t).random(ctx, t, spec);
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
