// f32 convolutions and matrix products on the CPU through oneDNN (Debian's libdnnl 2.6, the
// library behind PyTorch's own CPU convolutions).
//
// Why: im2col + Eigen ran one image at a time on one thread at about a fifth of the core's FMA
// peak. oneDNN's JIT kernels (AVX2 / AVX-512) work on blocked layouts (nChw8c / nChw16c and
// blocked weights) that they choose per shape; shardkit's tensors stay NCHW / OIHW, and each
// call reorders its operands into the chosen layouts and its result back -- memory-bound copies,
// small beside the convolution's arithmetic (8-9% of a ResNet-18 step; a backward pass reorders
// the output gradient once for its backward-data and backward-weights calls). Primitives are
// made once per (shape, thread count) and cached in the Context; every buffer (reordered
// operands, oneDNN's scratchpad) comes from the context's allocator, so memory statistics count
// it and the host allocator's cache reuses it step after step. Channels-last tensors
// (core/channels_last.hpp) take primitives that read and write NHWC as it is, so a network kept
// channels-last runs its convolutions without reordering its activations; tensors held in
// channel blocks (core/channel_blocks.hpp) are already in the layout the NCHW primitives chose,
// so the same primitives run on them without a reorder.
//
// Threads: oneDNN here runs on OpenMP. Each call sets the calling thread's OpenMP thread count
// to the context's cpu_threads(), so local ranks (threads of one process) each get their share.
// Results are deterministic for a given shape and thread count (static partitioning; the
// backward-weights reduction runs in a fixed order), which is what the bitwise stage-equivalence
// tests need: the ranks being compared run the same shapes on the same thread counts.
//
// The C API (dnnl.h) rather than dnnl.hpp: these headers are also compiled by nvcc, which
// cannot compile dnnl.hpp's C++.
#pragma once

#include "shardkit/core/config.hpp"

#if SK_WITH_DNNL

#include <omp.h>

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "shardkit/autograd/cpu_conv.hpp"
#include "shardkit/core/channel_blocks.hpp"
#include "shardkit/core/channels_last.hpp"
#include "shardkit/core/dnnl_check.hpp"
#include "shardkit/core/tensor_ops.hpp"

namespace shardkit::autograd::cpu::dnnl {

// Owners of oneDNN handles.
struct Destroy {
  void operator()(dnnl_primitive_desc_t h) const { dnnl_primitive_desc_destroy(h); }
  void operator()(dnnl_primitive_t h) const { dnnl_primitive_destroy(h); }
  void operator()(dnnl_memory_t h) const { dnnl_memory_destroy(h); }
};
using PrimitiveDescHandle = std::unique_ptr<dnnl_primitive_desc, Destroy>;
using PrimitiveHandle = std::unique_ptr<dnnl_primitive, Destroy>;
using MemoryHandle = std::unique_ptr<dnnl_memory, Destroy>;

inline MemoryHandle make_memory(const dnnl_memory_desc_t& md, dnnl_engine_t engine) {
  dnnl_memory_t m = nullptr;
  SK_DNNL_CHECK(dnnl_memory_create(&m, &md, engine, DNNL_MEMORY_NONE));
  return MemoryHandle(m);
}

inline PrimitiveHandle make_primitive(dnnl_primitive_desc_t pd) {
  dnnl_primitive_t p = nullptr;
  SK_DNNL_CHECK(dnnl_primitive_create(&p, pd));
  return PrimitiveHandle(p);
}

// A 4-D activation's layout in our memory: NCHW, channels-last, or channel blocks of 8 or 16
// channels (core/channel_blocks.hpp; the value is then the block's width).
enum ActivationLayout : std::int64_t { kNchw = 0, kChannelsLast = 1 };

// Our layout of a tensor: row-major, or for a 4-D activation the given layout (oneDNN's abcd,
// acdb for channels-last, aBcd8b / aBcd16b for channel blocks).
inline dnnl_memory_desc_t plain_desc(std::initializer_list<std::int64_t> dims,
                                     std::int64_t layout = kNchw) {
  dnnl_dims_t d{};
  int n = 0;
  for (std::int64_t v : dims) d[n++] = v;
  const dnnl_format_tag_t tag = n == 5                    ? dnnl_abcde  // grouped weights: goihw
                                : n != 4                  ? dnnl_ab
                                : layout == kChannelsLast ? dnnl_acdb
                                : layout == 8             ? dnnl_aBcd8b
                                : layout == 16            ? dnnl_aBcd16b
                                                          : dnnl_abcd;
  dnnl_memory_desc_t md;
  SK_DNNL_CHECK(dnnl_memory_desc_init_by_tag(&md, n, d, dnnl_f32, tag));
  return md;
}

inline dnnl_memory_desc_t any_desc(const dnnl_memory_desc_t& plain) {
  dnnl_memory_desc_t md;
  SK_DNNL_CHECK(
      dnnl_memory_desc_init_by_tag(&md, plain.ndims, plain.dims, dnnl_f32, dnnl_format_tag_any));
  return md;
}

constexpr std::size_t kAlign = 64;
inline std::size_t aligned(std::size_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

// One operand of a primitive: the plain layout our tensor has, the layout the primitive chose,
// and the reorder between them (none when they are equal).
struct Operand {
  int arg = 0;
  bool input = true;
  dnnl_memory_desc_t plain{}, chosen{};
  MemoryHandle plain_memory, chosen_memory;
  PrimitiveHandle reorder;  // plain -> chosen for inputs, chosen -> plain for outputs
  std::size_t chosen_bytes = 0;

  bool reordered() const { return reorder.get() != nullptr; }
};

// A convolution primitive (forward, backward-data or backward-weights) with its three operands
// and the scratchpad it needs.
class Call {
 public:
  Call(dnnl_engine_t engine, PrimitiveDescHandle pd, std::array<Operand, 3> operands)
      : pd_(std::move(pd)), operands_(std::move(operands)) {
    for (Operand& o : operands_) {
      o.plain_memory = make_memory(o.plain, engine);
      if (dnnl_memory_desc_equal(&o.plain, &o.chosen)) continue;
      o.chosen_bytes = dnnl_memory_desc_get_size(&o.chosen);
      o.chosen_memory = make_memory(o.chosen, engine);
      const dnnl_memory_desc_t& from = o.input ? o.plain : o.chosen;
      const dnnl_memory_desc_t& to = o.input ? o.chosen : o.plain;
      dnnl_primitive_desc_t reorder_pd = nullptr;
      SK_DNNL_CHECK(
          dnnl_reorder_primitive_desc_create(&reorder_pd, &from, engine, &to, engine, nullptr));
      PrimitiveDescHandle owned(reorder_pd);
      o.reorder = make_primitive(reorder_pd);
    }
    const dnnl_memory_desc_t* scratch =
        dnnl_primitive_desc_query_md(pd_.get(), dnnl_query_scratchpad_md, 0);
    scratch_bytes_ = scratch != nullptr ? dnnl_memory_desc_get_size(scratch) : 0;
    if (scratch_bytes_ > 0) scratch_memory_ = make_memory(*scratch, engine);
    primitive_ = make_primitive(pd_.get());
  }

  // Whether input operand i is reordered before the primitive runs, and into which layout.
  bool reorders(std::size_t i) const { return operands_[i].reordered(); }
  const dnnl_memory_desc_t& chosen(std::size_t i) const { return operands_[i].chosen; }
  std::size_t chosen_bytes(std::size_t i) const { return operands_[i].chosen_bytes; }

  // Reorders input operand i from the plain buffer `from` into `to` (chosen_bytes(i) bytes), for
  // a run() given `to` as an operand already in the chosen layout.
  void reorder_input(dnnl_stream_t stream, std::size_t i, void* from, void* to) {
    Operand& o = operands_[i];
    SK_DNNL_CHECK(dnnl_memory_set_data_handle(o.plain_memory.get(), from));
    SK_DNNL_CHECK(dnnl_memory_set_data_handle(o.chosen_memory.get(), to));
    reorder(stream, o, o.plain_memory.get(), o.chosen_memory.get());
  }

  // Runs the primitive on plain buffers (in the operands' order) -- except operands marked
  // `in_chosen_layout`, already reordered by reorder_input; reordered copies and the scratchpad
  // live in one transient buffer from the context's allocator.
  void run(Context& ctx, dnnl_stream_t stream, std::array<void*, 3> buffers,
           std::array<bool, 3> in_chosen_layout = {}) {
    std::size_t bytes = aligned(scratch_bytes_);
    for (std::size_t i = 0; i < operands_.size(); ++i)
      if (!in_chosen_layout[i]) bytes += aligned(operands_[i].chosen_bytes);
    Tensor scratch;
    char* next = nullptr;
    if (bytes > 0) {
      scratch =
          empty(ctx, {static_cast<std::int64_t>(bytes)}, DType::u8, MemoryCategory::activations);
      next = static_cast<char*>(scratch.data_ptr());
    }
    // A plain array: nvcc's front end crashes destroying a std::vector of this unnamed C struct.
    dnnl_exec_arg_t args[4];
    int nargs = 0;
    for (std::size_t i = 0; i < operands_.size(); ++i) {
      Operand& o = operands_[i];
      if (in_chosen_layout[i]) {
        SK_ASSERT(o.reordered());  // (an operand given in the chosen layout has one)
        SK_DNNL_CHECK(dnnl_memory_set_data_handle(o.chosen_memory.get(), buffers[i]));
        args[nargs++] = {o.arg, o.chosen_memory.get()};
        continue;
      }
      SK_DNNL_CHECK(dnnl_memory_set_data_handle(o.plain_memory.get(), buffers[i]));
      if (!o.reordered()) {
        args[nargs++] = {o.arg, o.plain_memory.get()};
        continue;
      }
      SK_DNNL_CHECK(dnnl_memory_set_data_handle(o.chosen_memory.get(), next));
      next += aligned(o.chosen_bytes);
      args[nargs++] = {o.arg, o.chosen_memory.get()};
      if (o.input) reorder(stream, o, o.plain_memory.get(), o.chosen_memory.get());
    }
    if (scratch_bytes_ > 0) {
      SK_DNNL_CHECK(dnnl_memory_set_data_handle(scratch_memory_.get(), next));
      args[nargs++] = {DNNL_ARG_SCRATCHPAD, scratch_memory_.get()};
    }
    SK_DNNL_CHECK(dnnl_primitive_execute(primitive_.get(), stream, nargs, args));
    for (Operand& o : operands_)
      if (!o.input && o.reordered())
        reorder(stream, o, o.chosen_memory.get(), o.plain_memory.get());
    SK_DNNL_CHECK(dnnl_stream_wait(stream));
  }

  dnnl_primitive_desc_t pd() const { return pd_.get(); }

 private:
  static void reorder(dnnl_stream_t stream, const Operand& o, dnnl_memory_t from,
                      dnnl_memory_t to) {
    const dnnl_exec_arg_t args[2] = {{DNNL_ARG_FROM, from}, {DNNL_ARG_TO, to}};
    SK_DNNL_CHECK(dnnl_primitive_execute(o.reorder.get(), stream, 2, args));
  }

  PrimitiveDescHandle pd_;
  std::array<Operand, 3> operands_;
  PrimitiveHandle primitive_;
  MemoryHandle scratch_memory_;
  std::size_t scratch_bytes_ = 0;
};

inline Operand operand(int arg, bool input, const dnnl_memory_desc_t& plain,
                       dnnl_primitive_desc_t pd, dnnl_query_t query) {
  Operand o;
  o.arg = arg;
  o.input = input;
  o.plain = plain;
  o.chosen = *dnnl_primitive_desc_query_md(pd, query, 0);
  return o;
}

// The three primitives of one convolution geometry at one thread count.
struct ConvPlan {
  std::unique_ptr<Call> forward, backward_data, backward_weights;
  // Convolutions::output_block's answer for the NCHW-output plan, once asked (-1: not yet).
  std::int64_t output_block = -1;
};

// One per context: the CPU engine and stream, and the plans made so far.
class Convolutions {
 public:
  Convolutions() {
    SK_DNNL_CHECK(dnnl_engine_create(&engine_, dnnl_cpu, 0));
    SK_DNNL_CHECK(dnnl_stream_create(&stream_, engine_, dnnl_stream_default_flags));
    SK_DNNL_CHECK(dnnl_primitive_attr_create(&attr_));
    // The scratchpad comes from our allocator (counted, cached), not oneDNN's own.
    SK_DNNL_CHECK(dnnl_primitive_attr_set_scratchpad_mode(attr_, dnnl_scratchpad_mode_user));
  }
  ~Convolutions() {
    plans_.clear();
    dnnl_primitive_attr_destroy(attr_);
    dnnl_stream_destroy(stream_);
    dnnl_engine_destroy(engine_);
  }
  Convolutions(const Convolutions&) = delete;
  Convolutions& operator=(const Convolutions&) = delete;

  // The channel-block width (8 or 16) of the layout oneDNN's forward kernel for this geometry
  // and input writes its output in, or 0 when that is not a channel-blocked layout of whole
  // blocks: a convolution asked for blocked output (Conv2dOptions::channel_blocks) writes it so
  // when this is not 0.
  std::int64_t output_block(Context& ctx, const Tensor& x, const ConvGeometry& g) {
    std::lock_guard lock(mutex_);
    ConvPlan& plan = plan_for(ctx, g, {layout_of(x), kNchw});
    if (plan.output_block < 0) {
      plan.output_block = 0;
      const dnnl_memory_desc_t& chosen = plan.forward->chosen(2);
      for (std::int64_t b : {8, 16}) {
        if (g.out_channels % b != 0) continue;
        const dnnl_memory_desc_t blocked =
            plain_desc({g.batch, g.out_channels, g.out_h, g.out_w}, b);
        if (dnnl_memory_desc_equal(&blocked, &chosen)) {
          plan.output_block = b;
          break;
        }
      }
    }
    return plan.output_block;
  }

  void forward(Context& ctx, const Tensor& x, const Tensor& w, const Tensor& y,
               const ConvGeometry& g) {
    std::lock_guard lock(mutex_);
    ConvPlan& plan = plan_for(ctx, g, layouts(x, y));
    plan.forward->run(ctx, stream_, {x.data_ptr(), w.data_ptr(), y.data_ptr()});
  }

  void backward(Context& ctx, const Tensor& x, const Tensor& w, const Tensor& gy, const Tensor& gx,
                const Tensor& gw, const ConvGeometry& g) {
    std::lock_guard lock(mutex_);
    const Layouts l = layouts(x, gy);
    ConvPlan& plan = plan_for(ctx, g, l);
    if (gx.defined() && !plan.backward_data) make_backward_data(plan, g, l);
    if (gw.defined() && !plan.backward_weights) make_backward_weights(plan, g, l);
    // Both calls read the output gradient (operand 0 of backward-data, 1 of backward-weights);
    // when both want it in the same blocked layout it is reordered once for the two.
    Tensor shared_gy;
    if (gx.defined() && gw.defined()) {
      const Call& data = *plan.backward_data;
      const Call& weights = *plan.backward_weights;
      if (data.reorders(0) && weights.reorders(1) &&
          dnnl_memory_desc_equal(&data.chosen(0), &weights.chosen(1))) {
        shared_gy = empty(ctx, {static_cast<std::int64_t>(data.chosen_bytes(0))}, DType::u8,
                          MemoryCategory::activations);
        plan.backward_data->reorder_input(stream_, 0, gy.data_ptr(), shared_gy.data_ptr());
      }
    }
    const bool shared = shared_gy.defined();
    void* gy_data = shared ? shared_gy.data_ptr() : gy.data_ptr();
    if (gx.defined())
      plan.backward_data->run(ctx, stream_, {gy_data, w.data_ptr(), gx.data_ptr()},
                              {shared, false, false});
    if (gw.defined())
      plan.backward_weights->run(ctx, stream_, {x.data_ptr(), gy_data, gw.data_ptr()},
                                 {false, shared, false});
  }

 private:
  // The operands' layouts (ActivationLayout): the output's (and its gradient's) picks the
  // primitives -- channels-last ones read and write NHWC as it is (no reorders), the others
  // choose blocked layouts, which an operand already held in channel blocks matches (no
  // reorder either) -- and the input (and its gradient) is read in its own layout. An input
  // that is both contiguous and channels-last (one channel, as a network's images) is read as
  // NHWC by channels-last primitives: the same memory, no reorder.
  struct Layouts {
    std::int64_t src = kNchw, dst = kNchw;
  };
  static std::int64_t layout_of(const Tensor& t) {
    if (has_channel_block_form(t)) return t.size(4);
    return keeps_channels_last(t) ? kChannelsLast : kNchw;
  }
  static Layouts layouts(const Tensor& x, const Tensor& y) {
    const std::int64_t dst = layout_of(y);
    if (dst == kChannelsLast) return {is_channels_last(x) ? kChannelsLast : kNchw, dst};
    return {layout_of(x), dst};
  }

  struct Descs {
    dnnl_memory_desc_t src, weights, dst;
    dnnl_dims_t strides, dilates, pad_l, pad_r;
  };
  static Descs descs(const ConvGeometry& g, Layouts l) {
    Descs d;
    d.src = plain_desc({g.batch, g.in_channels, g.height, g.width}, l.src);
    // A grouped weight [out, in / groups, kh, kw] is oneDNN's [groups, out / groups, in / groups,
    // kh, kw] (goihw): the same memory.
    d.weights = g.groups == 1 ? plain_desc({g.out_channels, g.in_channels, g.kernel_h, g.kernel_w})
                              : plain_desc({g.groups, g.out_channels / g.groups,
                                            g.in_channels / g.groups, g.kernel_h, g.kernel_w});
    d.dst = plain_desc({g.batch, g.out_channels, g.out_h, g.out_w}, l.dst);
    d.strides[0] = g.stride_h, d.strides[1] = g.stride_w;
    d.dilates[0] = g.dilation_h - 1, d.dilates[1] = g.dilation_w - 1;  // oneDNN counts from 0
    d.pad_l[0] = g.pad_h, d.pad_l[1] = g.pad_w;
    // Symmetric, as ours: oneDNN also floors (in + pad_l + pad_r - extent) / stride + 1.
    d.pad_r[0] = g.pad_h, d.pad_r[1] = g.pad_w;
    return d;
  }

  PrimitiveDescHandle make_pd(const dnnl_convolution_desc_t* desc, dnnl_primitive_desc_t hint) {
    dnnl_primitive_desc_t pd = nullptr;
    SK_DNNL_CHECK(dnnl_primitive_desc_create(&pd, desc, attr_, engine_, hint));
    return PrimitiveDescHandle(pd);
  }

  // The primitives' own layouts for src and dst: NHWC for channels-last ones, else oneDNN's
  // choice (the same primitives for NCHW and channel-blocked operands).
  static void primitive_descs(const Descs& d, Layouts l, dnnl_memory_desc_t& src,
                              dnnl_memory_desc_t& weights, dnnl_memory_desc_t& dst) {
    weights = any_desc(d.weights);
    if (l.dst == kChannelsLast) {
      src = plain_desc({d.src.dims[0], d.src.dims[1], d.src.dims[2], d.src.dims[3]}, kChannelsLast);
      dst = d.dst;
    } else {
      src = any_desc(d.src);
      dst = any_desc(d.dst);
    }
  }

  ConvPlan& plan_for(Context& ctx, const ConvGeometry& g, Layouts l) {
    const int threads = ctx.cpu_threads();
    omp_set_num_threads(threads);  // this thread's OpenMP teams: for making and for running
    const std::array<std::int64_t, 16> key{
        g.batch,      g.in_channels, g.height,           g.width, g.out_channels, g.kernel_h,
        g.kernel_w,   g.stride_h,    g.stride_w,         g.pad_h, g.pad_w,        g.dilation_h,
        g.dilation_w, threads,       l.src + 32 * l.dst, g.groups};
    auto& slot = plans_[key];
    if (!slot) {
      auto plan = std::make_unique<ConvPlan>();
      Descs d = descs(g, l);
      dnnl_memory_desc_t src, weights, dst;
      primitive_descs(d, l, src, weights, dst);
      dnnl_convolution_desc_t desc;
      SK_DNNL_CHECK(dnnl_dilated_convolution_forward_desc_init(
          &desc, dnnl_forward_training, dnnl_convolution_direct, &src, &weights, nullptr, &dst,
          d.strides, d.dilates, d.pad_l, d.pad_r));
      PrimitiveDescHandle pd = make_pd(&desc, nullptr);
      dnnl_primitive_desc_t p = pd.get();
      std::array<Operand, 3> ops{
          operand(DNNL_ARG_SRC, true, d.src, p, dnnl_query_src_md),
          operand(DNNL_ARG_WEIGHTS, true, d.weights, p, dnnl_query_weights_md),
          operand(DNNL_ARG_DST, false, d.dst, p, dnnl_query_dst_md)};
      plan->forward = std::make_unique<Call>(engine_, std::move(pd), std::move(ops));
      slot = std::move(plan);
    }
    return *slot;
  }

  void make_backward_data(ConvPlan& plan, const ConvGeometry& g, Layouts l) {
    Descs d = descs(g, l);
    dnnl_memory_desc_t src, weights, dst;
    primitive_descs(d, l, src, weights, dst);
    dnnl_convolution_desc_t desc;
    SK_DNNL_CHECK(dnnl_dilated_convolution_backward_data_desc_init(&desc, dnnl_convolution_direct,
                                                                   &src, &weights, &dst, d.strides,
                                                                   d.dilates, d.pad_l, d.pad_r));
    PrimitiveDescHandle pd = make_pd(&desc, plan.forward->pd());
    dnnl_primitive_desc_t p = pd.get();
    std::array<Operand, 3> ops{operand(DNNL_ARG_DIFF_DST, true, d.dst, p, dnnl_query_diff_dst_md),
                               operand(DNNL_ARG_WEIGHTS, true, d.weights, p, dnnl_query_weights_md),
                               operand(DNNL_ARG_DIFF_SRC, false, d.src, p, dnnl_query_diff_src_md)};
    plan.backward_data = std::make_unique<Call>(engine_, std::move(pd), std::move(ops));
  }

  void make_backward_weights(ConvPlan& plan, const ConvGeometry& g, Layouts l) {
    Descs d = descs(g, l);
    dnnl_memory_desc_t src, weights, dst;
    primitive_descs(d, l, src, weights, dst);
    dnnl_convolution_desc_t desc;
    SK_DNNL_CHECK(dnnl_dilated_convolution_backward_weights_desc_init(
        &desc, dnnl_convolution_direct, &src, &weights, nullptr, &dst, d.strides, d.dilates,
        d.pad_l, d.pad_r));
    PrimitiveDescHandle pd = make_pd(&desc, plan.forward->pd());
    dnnl_primitive_desc_t p = pd.get();
    std::array<Operand, 3> ops{
        operand(DNNL_ARG_SRC, true, d.src, p, dnnl_query_src_md),
        operand(DNNL_ARG_DIFF_DST, true, d.dst, p, dnnl_query_diff_dst_md),
        operand(DNNL_ARG_DIFF_WEIGHTS, false, d.weights, p, dnnl_query_diff_weights_md)};
    plan.backward_weights = std::make_unique<Call>(engine_, std::move(pd), std::move(ops));
  }

  dnnl_engine_t engine_ = nullptr;
  dnnl_stream_t stream_ = nullptr;
  dnnl_primitive_attr_t attr_ = nullptr;
  std::mutex mutex_;
  std::map<std::array<std::int64_t, 16>, std::unique_ptr<ConvPlan>> plans_;
};

inline Convolutions& convolutions(Context& ctx) {
  return ctx.resource<Convolutions>([] { return std::make_shared<Convolutions>(); });
}

// C = alpha * op(A) op(B) + beta * C, row-major f32, on the context's threads.
inline void sgemm(Context& ctx, const Tensor& a, bool transpose_a, const Tensor& b,
                  bool transpose_b, const Tensor& c, double alpha, double beta) {
  omp_set_num_threads(ctx.cpu_threads());
  const std::int64_t m = c.size(0), n = c.size(1), k = transpose_a ? a.size(0) : a.size(1);
  SK_DNNL_CHECK(dnnl_sgemm(transpose_a ? 'T' : 'N', transpose_b ? 'T' : 'N', m, n, k,
                           static_cast<float>(alpha), static_cast<const float*>(a.data_ptr()),
                           a.size(1), static_cast<const float*>(b.data_ptr()), b.size(1),
                           static_cast<float>(beta), static_cast<float*>(c.data_ptr()), n));
}

}  // namespace shardkit::autograd::cpu::dnnl

#endif  // SK_WITH_DNNL
