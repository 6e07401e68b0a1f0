// Channel-blocked activations (core/channel_blocks.hpp) against the same computation in NCHW:
// the conversions; convolutions that read and write channel blocks (the NCHW calls' own oneDNN
// kernels: bit for bit); batch-norm's double sums (sums of values bit for bit, sums of
// products to their last bits: FMA contraction is the compiler's choice per loop), and
// batch-norm in training (with and without a fused ReLU) and evaluation mode with its running
// statistics; max-pool (bit for bit); a ResNet with ResNetOptions::channel_blocks against the plain
// one (loss, every gradient, the running statistics).
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>

#include "gradcheck.hpp"
#include "shardkit/nn/nn.hpp"

namespace sk = shardkit;
namespace ag = shardkit::autograd;
using ag::Variable;

namespace {

// (cb_: the tests of a layer build as one unit, beside other files' helpers)
sk::Tensor cb_random(sk::Context& ctx, const sk::Shape& shape, double low = -1, double high = 1,
                     sk::DType dtype = sk::DType::f32) {
  sk::Tensor t = sk::empty(ctx, shape, dtype, sk::MemoryCategory::activations);
  sk::uniform_(ctx, t, low, high);
  return t;
}

// (doubles: an f64 tensor's values exactly, an f32 one's widened)
std::vector<double> cb_values(sk::Context& ctx, const sk::Tensor& t) {
  return sk::to_vector<double>(ctx, sk::cast(ctx, sk::contiguous(ctx, t), sk::DType::f64));
}

// [N, C, H, W] values of a tensor in either layout.
std::vector<double> nchw_values(sk::Context& ctx, const sk::Tensor& t) {
  return cb_values(ctx, sk::has_channel_block_form(t) ? sk::from_channel_blocks(ctx, t) : t);
}

bool blocked_build() { return SK_WITH_DNNL != 0; }

sk::nn::Module& cb_child(sk::nn::Module& parent, const std::string& name) {
  for (const auto& [child_name, child] : parent.children())
    if (child_name == name) return *child;
  FAIL("no child ", name);
  return parent;
}

}  // namespace

TEST_CASE("channel blocks: every element at (n, c / b, h, w, c % b), and back") {
  sk::Context ctx({.seed = 1});
  const sk::Tensor x = cb_random(ctx, {3, 32, 5, 7});
  const auto v = cb_values(ctx, x);
  for (std::int64_t b : {8, 16}) {
    CAPTURE(b);
    const sk::Tensor blocked = sk::to_channel_blocks(ctx, x, b);
    REQUIRE(blocked.shape() == sk::Shape{3, 32 / b, 5, 7, b});
    CHECK(blocked.is_contiguous());
    const auto bv = cb_values(ctx, blocked);
    bool placed = true;
    for (std::int64_t n = 0; n < 3; ++n)
      for (std::int64_t c = 0; c < 32; ++c)
        for (std::int64_t i = 0; i < 35; ++i)
          placed = placed &&
                   bv[static_cast<std::size_t>(((n * (32 / b) + c / b) * 35 + i) * b + c % b)] ==
                       v[static_cast<std::size_t>((n * 32 + c) * 35 + i)];
    CHECK(placed);
    CHECK(cb_values(ctx, sk::from_channel_blocks(ctx, blocked)) == v);
    // From a channels-last tensor too.
    CHECK(cb_values(ctx, sk::to_channel_blocks(ctx, sk::to_channels_last(ctx, x), b)) == bv);
  }
  CHECK_THROWS_WITH_AS(sk::to_channel_blocks(ctx, cb_random(ctx, {2, 12, 3, 3}), 8),
                       doctest::Contains("12 channels do not split into blocks of 8"),
                       sk::InvalidArgument);
  CHECK_THROWS_AS(sk::from_channel_blocks(ctx, cb_random(ctx, {2, 3, 3, 3, 4})),
                  sk::InvalidArgument);
}

TEST_CASE("convolutions in channel blocks give the NCHW bits, forward and backward") {
  sk::Context ctx({.seed = 2});
  struct Case {
    std::int64_t in, out, kernel, stride, groups = 1;
  };
  for (const Case& k :
       {Case{16, 32, 3, 1}, Case{32, 32, 3, 2}, Case{32, 64, 1, 2}, Case{1, 16, 3, 1},
        Case{16, 16, 1, 1}, Case{32, 32, 3, 1, 8}, Case{16, 16, 3, 2, 16}}) {
    CAPTURE(k.in);
    CAPTURE(k.out);
    CAPTURE(k.kernel);
    CAPTURE(k.stride);
    CAPTURE(k.groups);
    const sk::Tensor x = cb_random(ctx, {4, k.in, 9, 9});
    const sk::Tensor w = cb_random(ctx, {k.out, k.in / k.groups, k.kernel, k.kernel}, -0.3, 0.3);
    const sk::Tensor r =
        cb_random(ctx, {4, k.out, (9 + 2 * (k.kernel / 2) - k.kernel) / k.stride + 1,
                        (9 + 2 * (k.kernel / 2) - k.kernel) / k.stride + 1});
    std::vector<double> y[3], gx[3], gw[3];
    for (int mode = 0; mode < 3; ++mode) {  // NCHW; NCHW in, blocks out; blocks in and out
      ag::Conv2dOptions o = ag::Conv2dOptions::make(k.stride, k.kernel / 2, 1, k.groups);
      o.channel_blocks = mode > 0;
      Variable xv(sk::clone(ctx, x), true), wv(sk::clone(ctx, w), true);
      Variable in = xv;
      if (mode == 2 && k.in % 8 == 0) {
        const std::int64_t b = k.in % 16 == 0 ? 16 : 8;
        in = ag::to_channel_blocks(ctx, xv, b);
      }
      const Variable out = ag::conv2d(ctx, in, wv, Variable(), o);
      // (a grouped convolution of 4 channels a group computes in another layout; depthwise ones
      // in blocks)
      if (mode > 0 && blocked_build() && (k.groups == 1 || k.groups == k.in))
        CHECK(sk::has_channel_block_form(out.data()));
      if (mode == 0) CHECK(out.dim() == 4);
      // The same r whatever the output's layout.
      const sk::Tensor rr =
          sk::has_channel_block_form(out.data()) ? sk::to_channel_blocks(ctx, r, out.size(4)) : r;
      ag::backward(ctx, out, rr);
      y[mode] = nchw_values(ctx, out.data());
      gx[mode] = cb_values(ctx, xv.grad());
      gw[mode] = cb_values(ctx, wv.grad());
    }
    for (int mode = 1; mode < 3; ++mode) {
      CAPTURE(mode);
      CHECK(y[mode] == y[0]);
      CHECK(gx[mode] == gx[0]);
      CHECK(gw[mode] == gw[0]);
    }
  }
}

// f64 too: the sums' order shows in an f64 result's last bits, seldom in an f32 one's.
TEST_CASE("batch-norm in channel blocks equals the NCHW one: training, fused ReLU, evaluation") {
  sk::Context ctx({.seed = 3});
  for (sk::DType dtype : {sk::DType::f32, sk::DType::f64}) {
    for (std::int64_t b : {8, 16}) {
      for (bool relu : {false, true}) {
        for (bool training : {true, false}) {
          CAPTURE(dtype);
          CAPTURE(b);
          CAPTURE(relu);
          CAPTURE(training);
          // 29 values per plane: lane sums with a tail
          const sk::Tensor x = cb_random(ctx, {5, 32, 29, 1}, -2, 3, dtype);
          const sk::Tensor w = cb_random(ctx, {32}, 0.5, 1.5, dtype),
                           bias = cb_random(ctx, {32}, -1, 1, dtype);
          const sk::Tensor rm = cb_random(ctx, {32}, -1, 1, dtype),
                           rv = cb_random(ctx, {32}, 0.5, 2, dtype);
          const sk::Tensor r = cb_random(ctx, x.shape(), -1, 1, dtype);
          std::vector<double> y[2], gx[2], gw[2], gb[2], running[2];
          for (int blocked = 0; blocked < 2; ++blocked) {
            const sk::Tensor mean = sk::clone(ctx, rm), var = sk::clone(ctx, rv);
            Variable xv(sk::clone(ctx, x), true), wv(sk::clone(ctx, w), true),
                bv(sk::clone(ctx, bias), true);
            ag::BatchNormOptions o;
            o.training = training;
            o.relu = relu;
            o.channel_blocks = blocked == 1;
            const Variable in = blocked == 1 ? ag::to_channel_blocks(ctx, xv, b) : xv;
            const Variable out = ag::batch_norm(ctx, in, wv, bv, mean, var, o);
            CHECK(out.shape() == in.shape());
            ag::backward(ctx, out, blocked == 1 ? sk::to_channel_blocks(ctx, r, b) : r);
            y[blocked] = nchw_values(ctx, out.data());
            gx[blocked] = cb_values(ctx, xv.grad());
            gw[blocked] = cb_values(ctx, wv.grad());
            gb[blocked] = cb_values(ctx, bv.grad());
            running[blocked] = cb_values(ctx, mean);
            const auto rvar = cb_values(ctx, var);
            running[blocked].insert(running[blocked].end(), rvar.begin(), rvar.end());
          }
          // The bias gradient sums values: bit for bit. The rest goes through sums of
          // products (see the next test): to the last bits of the dtype.
          CHECK(gb[1] == gb[0]);
          const double bound = dtype == sk::DType::f32 ? 1e-6 : 1e-13;
          CHECK(ag::testing::scaled_error(y[1], y[0]) < bound);
          CHECK(ag::testing::scaled_error(gx[1], gx[0]) < bound);
          CHECK(ag::testing::scaled_error(gw[1], gw[0]) < bound);
          CHECK(ag::testing::scaled_error(running[1], running[0]) < bound);
        }
      }
    }
  }
}

// The per-channel sums in double, before anything is rounded to the tensors' dtype, through
// the kernel table (the library's compiled loops). Sums of values are additions only, in the
// NCHW rows' order: equal bit for bit, which a wrong lane or pairing would break. Sums of
// products may differ in their last bits: GCC contracts a multiply and an add into an FMA per
// loop as it vectorises it (the NCHW tail loop partly, the blocked loops wholly), so those are
// compared to 1e-14 of their scale.
TEST_CASE("batch-norm's double sums in channel blocks are the NCHW ones") {
  sk::Context ctx({.seed = 8});
  for (sk::DType dtype : {sk::DType::f32, sk::DType::f64}) {
    for (std::int64_t b : {8, 16}) {
      for (std::int64_t plane : {1, 7, 29, 64}) {
        CAPTURE(dtype);
        CAPTURE(b);
        CAPTURE(plane);
        const std::int64_t N = 5, C = 32;
        const sk::Tensor x = cb_random(ctx, {N, C, plane, 1}, -2, 3, dtype);
        const sk::Tensor g = cb_random(ctx, x.shape(), -1, 1, dtype);
        const sk::Tensor y = cb_random(ctx, x.shape(), -1, 1, dtype);  // a fused ReLU's output
        const sk::Tensor si = cb_random(ctx, {C}, 0.5, 2, dtype);      // 1 / std
        const sk::Tensor blocked[3] = {sk::to_channel_blocks(ctx, x, b),
                                       sk::to_channel_blocks(ctx, g, b),
                                       sk::to_channel_blocks(ctx, y, b)};
        // [0]: sums of values (mean, sum_g, masked sum_g); [1]: sums of products
        std::vector<double> values[2], products[2];
        const auto& kernels = ag::kernels_for(ctx, x);
        const auto take = [&](int k, const sk::Tensor& t, std::int64_t first) {
          const auto v = cb_values(ctx, t);
          values[k].insert(values[k].end(), v.begin() + first, v.begin() + first + C);
          products[k].insert(products[k].end(), v.begin() + first + C, v.begin() + first + 2 * C);
        };
        for (int k = 0; k < 2; ++k) {
          const sk::Tensor& xs = k == 0 ? x : blocked[0];
          const sk::Tensor& gs = k == 0 ? g : blocked[1];
          const sk::Tensor& ys = k == 0 ? y : blocked[2];
          const sk::Tensor m = sk::zeros(ctx, {1 + 2 * C}, sk::DType::f64);
          kernels.batch_norm_moments(ctx, xs, m, N, C, plane);
          take(k, m, 1);
          const sk::Tensor sm = sk::cast(ctx, m.slice(0, 1, 1 + C), dtype);
          const sk::Tensor out = sk::zeros(ctx, {2 * C}, sk::DType::f64);
          kernels.batch_norm_grad_sums(ctx, xs, gs, sm, si, sk::Tensor(), out, N, C, plane);
          take(k, out, 0);
          kernels.batch_norm_grad_sums(ctx, xs, gs, sm, si, ys, out, N, C, plane);
          take(k, out, 0);
        }
        CHECK(values[1] == values[0]);
        CHECK(ag::testing::scaled_error(products[1], products[0]) < 1e-14);
      }
    }
  }
}

// Max-pool reads channel blocks as they are: each channel's windows compared in the NCHW
// loops' order, so the same maxima (ties to the first, a NaN wins) and the same gradient sums
// where windows overlap, bit for bit; over the padded border, the square fast paths' kernels
// and others.
TEST_CASE("max-pool in channel blocks gives the NCHW bits, forward and backward") {
  sk::Context ctx({.seed = 8});
  struct Pool {
    std::int64_t kernel, stride, padding;
  };
  const auto same = [](const std::vector<double>& a, const std::vector<double>& b) {
    if (a.size() != b.size()) return false;
    for (std::size_t i = 0; i < a.size(); ++i)
      if (!(a[i] == b[i] || (std::isnan(a[i]) && std::isnan(b[i])))) return false;
    return true;
  };
  for (sk::DType dtype : {sk::DType::f32, sk::DType::f64}) {
    for (std::int64_t b : {8, 16}) {
      for (const Pool& pool : {Pool{3, 2, 1}, Pool{2, 2, 0}, Pool{3, 1, 1}, Pool{5, 3, 2}}) {
        CAPTURE(dtype);
        CAPTURE(b);
        CAPTURE(pool.kernel);
        CAPTURE(pool.stride);
        // Values on a coarse grid (ties in most windows) and a NaN in each of a few planes.
        sk::Tensor x = cb_random(ctx, {3, 32, 13, 11}, -4, 4, sk::DType::f64);
        std::vector<double> v = sk::to_vector<double>(ctx, x);
        for (double& e : v) e = std::round(e);
        for (std::size_t i = 7; i < v.size(); i += 1543) v[i] = std::nan("");
        x = sk::cast(ctx, sk::from_vector<double>(ctx, v, x.shape()), dtype);
        std::vector<double> y[2], gx[2];
        sk::Tensor g;  // the output gradient: its own value per element, so where a maximum went
                       // matters
        for (int blocked = 0; blocked < 2; ++blocked) {
          Variable xv(sk::clone(ctx, x), true);
          const Variable in = blocked == 1 ? ag::to_channel_blocks(ctx, xv, b) : xv;
          const Variable out =
              ag::max_pool2d(ctx, in, pool.kernel, pool.stride, pool.padding, blocked == 1);
          CHECK(out.dim() == (blocked == 1 ? 5 : 4));
          const sk::Tensor yd =
              blocked == 1 ? sk::from_channel_blocks(ctx, out.data()) : out.data();
          if (!g.defined()) g = cb_random(ctx, yd.shape(), -1, 1, dtype);
          ag::backward(ctx, out, blocked == 1 ? sk::to_channel_blocks(ctx, g, b) : g);
          y[blocked] = cb_values(ctx, yd);
          gx[blocked] = cb_values(ctx, xv.grad());
        }
        CHECK(same(y[1], y[0]));
        CHECK(same(gx[1], gx[0]));
      }
    }
  }
}

TEST_CASE("a ResNet in channel blocks equals the NCHW network") {
  for (bool small_stem : {true, false}) {
    for (std::int64_t width : {16, 8}) {
      CAPTURE(small_stem);
      CAPTURE(width);
      sk::nn::ResNetOptions options;
      options.num_classes = 10;
      options.small_image_stem = small_stem;
      options.base_channels = width;
      options.in_channels = small_stem ? 1 : 3;
      std::vector<double> losses[2], stage_shapes[2];
      std::vector<std::vector<double>> grads[2], buffers[2];
      bool inner_blocked = false, pool_blocked = false;
      for (int k = 0; k < 2; ++k) {
        sk::Context ctx({.seed = 5});
        options.channel_blocks = k == 1;
        const auto net = sk::nn::resnet18(ctx, options);
        // Hooks: the trunk's output is [N, C, H, W] in either network; before it the blocked
        // network's tensors are 5-D where oneDNN computes in blocks.
        cb_child(*net, "layer4")
            .register_forward_hook([&, k](sk::nn::Module&, const Variable&, const Variable& y) {
              stage_shapes[k].push_back(static_cast<double>(y.dim()));
            });
        auto& inner = static_cast<sk::nn::BasicBlock&>(cb_child(cb_child(*net, "layer2"), "0"));
        inner.bn1->register_forward_hook(
            [&, k](sk::nn::Module&, const Variable&, const Variable& y) {
              if (k == 1) inner_blocked = sk::has_channel_block_form(y.data());
            });
        if (!small_stem)  // (ImageNet's stem pools the blocks as they are)
          cb_child(*net, "maxpool")
              .register_forward_hook([&, k](sk::nn::Module&, const Variable&, const Variable& y) {
                if (k == 1) pool_blocked = sk::has_channel_block_form(y.data());
              });
        for (int step = 0; step < 2; ++step) {  // two steps: the running statistics move
          sk::Context dctx({.seed = static_cast<std::uint64_t>(7 + step)});
          const std::int64_t side = small_stem ? 12 : 32;
          const sk::Tensor pixels = cb_random(dctx, {4, options.in_channels, side, side});
          const sk::Tensor labels = sk::from_vector<std::int64_t>(ctx, {3, 7, 1, 0}, {4});
          const Variable loss = ag::cross_entropy(ctx, (*net)(ctx, Variable(pixels)), labels);
          ag::backward(ctx, loss);
          losses[k].push_back(cb_values(ctx, loss.data())[0]);
        }
        for (const auto& [name, p] : net->named_parameters())
          grads[k].push_back(cb_values(ctx, p.grad()));
        for (const auto& [name, t] : net->named_buffers())
          if (t.dtype() == sk::DType::f32) buffers[k].push_back(cb_values(ctx, t));
      }
      // (equal bit for bit on this build; bounded as batch-norm's sums of products are)
      CHECK(ag::testing::scaled_error(losses[1], losses[0]) < 1e-6);
      CHECK(stage_shapes[1] == stage_shapes[0]);
      CHECK(std::all_of(stage_shapes[1].begin(), stage_shapes[1].end(),
                        [](double d) { return d == 4; }));
      if (blocked_build()) CHECK(inner_blocked);
      // (at width 8 oneDNN may write the 7 x 7 convolution's output in another layout)
      if (blocked_build() && !small_stem && width == 16) CHECK(pool_blocked);
      REQUIRE(grads[0].size() == grads[1].size());
      for (std::size_t i = 0; i < grads[0].size(); ++i) {
        CAPTURE(i);
        CHECK(ag::testing::scaled_error(grads[1][i], grads[0][i]) < 1e-5);
      }
      REQUIRE(buffers[1].size() == buffers[0].size());
      for (std::size_t i = 0; i < buffers[0].size(); ++i)
        CHECK(ag::testing::scaled_error(buffers[1][i], buffers[0][i]) < 1e-6);
    }
  }
}

TEST_CASE("channel blocks: what is refused, and where blocks are read") {
  sk::Context ctx({.seed = 6});
  sk::nn::ResNetOptions both;
  both.channels_last = both.channel_blocks = true;
  CHECK_THROWS_WITH(sk::nn::resnet18(ctx, both), doctest::Contains("choose one"));
  // A 5-D input is a convolution's error unless channel blocks are asked for.
  const Variable x(sk::to_channel_blocks(ctx, cb_random(ctx, {2, 16, 5, 5}), 8));
  const Variable w(cb_random(ctx, {8, 16, 3, 3}));
  CHECK_THROWS_WITH(ag::conv2d(ctx, x, w), doctest::Contains("is not [N, C, H, W]"));
  ag::Conv2dOptions o = ag::Conv2dOptions::make(1, 1);
  o.channel_blocks = true;
  const Variable y = ag::conv2d(ctx, x, w, Variable(), o);
  CHECK((sk::has_channel_block_form(y.data()) ? sk::channel_unblocked_shape(y.shape())
                                              : y.shape()) == sk::Shape{2, 8, 5, 5});
  // Without the option a batch-norm reads a 5-D input as [N, C, D, H, W]: two channels here,
  // not the sixteen of the blocks.
  const sk::Tensor sixteen = cb_random(ctx, {16}, 0.5, 1);
  CHECK_THROWS_WITH(
      ag::batch_norm(ctx, x, Variable(sixteen), Variable(sixteen), sk::Tensor(), sk::Tensor()),
      doctest::Contains("has 2 channels"));
  // So is a max-pool's; with it, the pool keeps the blocks.
  CHECK_THROWS_WITH(ag::max_pool2d(ctx, x, 3, 2, 1), doctest::Contains("is not [N, C, H, W]"));
  CHECK(ag::max_pool2d(ctx, x, 3, 2, 1, true).shape() == sk::Shape{2, 2, 3, 3, 8});
  ag::BatchNormOptions blocks;
  blocks.channel_blocks = true;
  CHECK(ag::batch_norm(ctx, x, Variable(sixteen), Variable(sixteen), sk::Tensor(), sk::Tensor(),
                       blocks)
            .shape() == x.shape());
}
