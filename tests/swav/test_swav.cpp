// The SwAV sample's algorithm against float64 references written here from the published
// algorithm: distributed Sinkhorn-Knopp (1 and 4 ranks, f32 and f64, hard assignment), the
// swapped-prediction loss and its gradients with respect to the embeddings and the prototypes,
// and the queue (VISSL's length rounding, start, ordering).
#include <doctest/doctest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <vector>

#include "command_line.hpp"
#include "datasets.hpp"
#include "knn.hpp"
#include "launched_checks.hpp"
#include "loader.hpp"
#include "multicrop.hpp"
#include "rank_setup.hpp"
#include "shardkit/comm/run_ranks.hpp"
#include "shardkit/data/stateful_sampler.hpp"
#include "sinkhorn.hpp"
#include "swav_config.hpp"
#include "swav_loss.hpp"

namespace sk = shardkit;
namespace ag = shardkit::autograd;

namespace {

std::vector<double> random_values(std::uint64_t seed, std::size_t n, double low, double high) {
  const sk::RandomSpec spec{sk::RandomKind::uniform, low, high, seed, 0};
  std::vector<double> out(n);
  for (std::size_t i = 0; i < n; ++i) out[i] = spec.value_at(i);
  return out;
}

// Rows of unit length (the embedding is L2-normalised).
std::vector<double> unit_rows(std::uint64_t seed, std::int64_t rows, std::int64_t dim) {
  auto v = random_values(seed, static_cast<std::size_t>(rows * dim), -1, 1);
  for (std::int64_t r = 0; r < rows; ++r) {
    double s = 0;
    for (std::int64_t d = 0; d < dim; ++d) s += v[r * dim + d] * v[r * dim + d];
    for (std::int64_t d = 0; d < dim; ++d) v[r * dim + d] /= std::sqrt(s);
  }
  return v;
}

// Sinkhorn-Knopp on the whole [n, k] score matrix: Q = exp(S / eps) / sum; `iters` times scale
// every prototype's column to total 1/k, then every sample's row to 1/n; rows normalised to 1.
std::vector<double> reference_sinkhorn(const std::vector<double>& scores, std::int64_t n,
                                       std::int64_t k, double eps, int iters) {
  std::vector<double> q(scores.size());
  double total = 0;
  for (std::size_t i = 0; i < q.size(); ++i) total += q[i] = std::exp(scores[i] / eps);
  for (auto& x : q) x /= total;
  for (int it = 0; it < iters; ++it) {
    for (std::int64_t j = 0; j < k; ++j) {
      double s = 0;
      for (std::int64_t b = 0; b < n; ++b) s += q[b * k + j];
      for (std::int64_t b = 0; b < n; ++b) q[b * k + j] *= (1.0 / k) / s;
    }
    for (std::int64_t b = 0; b < n; ++b) {
      double s = 0;
      for (std::int64_t j = 0; j < k; ++j) s += q[b * k + j];
      for (std::int64_t j = 0; j < k; ++j) q[b * k + j] *= (1.0 / n) / s;
    }
  }
  for (std::int64_t b = 0; b < n; ++b) {
    double s = 0;
    for (std::int64_t j = 0; j < k; ++j) s += q[b * k + j];
    for (std::int64_t j = 0; j < k; ++j) q[b * k + j] /= s;
  }
  return q;
}

std::vector<double> matmul_t(const std::vector<double>& a, const std::vector<double>& b,
                             std::int64_t rows, std::int64_t cols, std::int64_t inner) {
  std::vector<double> out(static_cast<std::size_t>(rows * cols));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      double s = 0;
      for (std::int64_t d = 0; d < inner; ++d) s += a[r * inner + d] * b[c * inner + d];
      out[r * cols + c] = s;
    }
  return out;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
  return worst;
}

// This rank's codes: its rows [at / k, at / k + b) of `scores`, on the device with the
// communicator's all-reduces, read back.
std::vector<float> sinkhorn_of(sk::Context& ctx, sk::comm::Communicator& comm,
                               const std::vector<double>& scores, std::int64_t at, std::int64_t b,
                               std::int64_t k, const swav::SinkhornOptions& options) {
  const std::vector<float> mine(scores.begin() + at, scores.begin() + at + b * k);
  const sk::Tensor codes = swav::distributed_sinkhorn(
      ctx, sk::from_vector(ctx, mine, {b, k}), b, comm.size(), options,
      [&](const sk::Tensor& t, sk::comm::ReduceOp op) { swav::all_reduce_on_stream(comm, t, op); });
  return sk::to_vector<float>(ctx, codes);
}

}  // namespace

TEST_CASE("distributed Sinkhorn-Knopp: every rank's codes are its rows of the global solution") {
  const std::int64_t b = 6, k = 10;
  for (int world : {1, 4}) {
    const auto scores = random_values(41, static_cast<std::size_t>(world * b * k), -1, 1);
    for (bool f64 : {false, true}) {
      CAPTURE(world);
      CAPTURE(f64);
      sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
        const std::int64_t at = comm.rank() * b * k;
        swav::SinkhornOptions options;
        options.use_double_precision = f64;
        const auto codes = sinkhorn_of(ctx, comm, scores, at, b, k, options);
        // The reference works on the f32 scores too.
        std::vector<double> f32_scores(scores.size());
        for (std::size_t i = 0; i < scores.size(); ++i)
          f32_scores[i] = static_cast<float>(scores[i]);
        const auto ref = reference_sinkhorn(f32_scores, world * b, k, 0.05, 3);
        const std::vector<double> my_ref(ref.begin() + at, ref.begin() + at + b * k);
        CHECK(max_abs_diff(codes, my_ref) < (f64 ? 1e-7 : 2e-6));
        for (std::int64_t r = 0; r < b; ++r) {
          double s = 0;
          for (std::int64_t j = 0; j < k; ++j) s += codes[r * k + j];
          CHECK(s == doctest::Approx(1.0).epsilon(1e-6));
        }
      });
    }
  }
  // Equipartition over all ranks' samples: run long enough, every prototype gets n/k of the
  // mass (3 iterations only approach it at epsilon 0.05).
  const int world = 4;
  const auto scores = random_values(47, static_cast<std::size_t>(world * b * k), -1, 1);
  std::vector<double> mass(k, 0.0);
  std::mutex lock;
  sk::comm::run_ranks(world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    const std::int64_t at = comm.rank() * b * k;
    swav::SinkhornOptions options;
    options.num_iters = 200;
    const auto codes = sinkhorn_of(ctx, comm, scores, at, b, k, options);
    std::lock_guard guard(lock);
    for (std::int64_t r = 0; r < b; ++r)
      for (std::int64_t j = 0; j < k; ++j) mass[j] += codes[r * k + j];
  });
  for (double m : mass) CHECK(m == doctest::Approx(double(world * b) / k).epsilon(0.01));
}

TEST_CASE("Sinkhorn-Knopp: hard assignment, VISSL's safeguards, and bad arguments") {
  const std::int64_t b = 5, k = 7;
  const auto scores = random_values(43, b * k, -1, 1);
  std::vector<float> f(scores.begin(), scores.end());
  sk::Context ctx;
  auto none = [](const sk::Tensor&, sk::comm::ReduceOp) {};
  auto run = [&](const std::vector<float>& values, std::int64_t rows, std::int64_t cols,
                 const swav::SinkhornOptions& options) {
    return sk::to_vector<float>(
        ctx, swav::distributed_sinkhorn(ctx, sk::from_vector(ctx, values, {rows, cols}), rows, 1,
                                        options, none));
  };
  swav::SinkhornOptions soft, hard;
  hard.hard_assignment = true;
  const auto s = run(f, b, k, soft);
  const auto h = run(f, b, k, hard);
  for (std::int64_t r = 0; r < b; ++r) {
    const auto best = std::max_element(s.begin() + r * k, s.begin() + (r + 1) * k) - s.begin();
    for (std::int64_t j = 0; j < k; ++j) CHECK(h[r * k + j] == (r * k + j == best ? 1.0f : 0.0f));
  }
  // A NaN score spreads to every code through the sums; hard codes then take each row's first
  // column, as torch.argmax does over NaNs (a NaN goes before any number), never no column.
  std::vector<float> with_nan(f);
  with_nan[9] = std::numeric_limits<float>::quiet_NaN();
  const auto n = run(with_nan, b, k, hard);
  for (std::int64_t r = 0; r < b; ++r)
    for (std::int64_t j = 0; j < k; ++j) CHECK(n[r * k + j] == (j == 0 ? 1.0f : 0.0f));
  // Scores far apart: exp underflows for most entries in f32 without VISSL's max shift; with it
  // the codes stay finite and sum to 1.
  std::vector<float> wide(f);
  for (auto& x : wide) x *= 40;
  const auto w = run(wide, b, k, soft);
  for (std::int64_t r = 0; r < b; ++r) {
    double sum = 0;
    for (std::int64_t j = 0; j < k; ++j) {
      CHECK(std::isfinite(w[r * k + j]));
      CHECK(w[r * k + j] >= 0.0f);
      sum += w[r * k + j];
    }
    CHECK(sum == doctest::Approx(1.0).epsilon(1e-5));  // (underflowed codes would sum to 0)
  }
  // A prototype no sample can reach (every score -inf in f32 after the scaling): VISSL's
  // guard adds 1e-12 everywhere and the column sums again; the codes stay finite and sum to 1.
  std::vector<float> empty_column(f);
  for (std::int64_t r = 0; r < b; ++r) empty_column[r * k + 2] = -1e38f;
  const auto e = run(empty_column, b, k, soft);
  for (std::int64_t r = 0; r < b; ++r) {
    double sum = 0;
    for (std::int64_t j = 0; j < k; ++j) {
      CHECK(std::isfinite(e[r * k + j]));
      sum += e[r * k + j];
    }
    CHECK(sum == doctest::Approx(1.0).epsilon(1e-5));
    CHECK(e[r * k + 2] > 0.0f);  // the guard's 1e-12, scaled up by the empty column's share
  }
  const sk::Tensor codes_in = sk::from_vector(ctx, f, {b, k});
  CHECK_THROWS_WITH(swav::distributed_sinkhorn(ctx, codes_in, b + 1, 1, soft, none),
                    doctest::Contains("6 code rows of scores [5, 7]"));
  CHECK_THROWS_WITH(
      swav::distributed_sinkhorn(ctx, sk::cast(ctx, codes_in, sk::DType::f64), b, 1, soft, none),
      doctest::Contains("cast them to f32"));
  swav::SinkhornOptions bad;
  bad.epsilon = 0;
  CHECK_THROWS_WITH(swav::distributed_sinkhorn(ctx, codes_in, b, 1, bad, none),
                    doctest::Contains("epsilon 0 must be positive"));
}

namespace {

// One rank's inputs: embeddings [V*B, D] (unit rows) and the shared prototypes [K, D].
struct LossCase {
  int world = 1, crops = 4;
  std::int64_t b = 5, d = 8, k = 12;
  std::vector<int> assign{0, 1};
  std::int64_t queue = 0;  // local queue length
};

struct LossResult {
  double loss;
  std::vector<float> grad_z, grad_c;
};

// Our loss on every rank; rank r's embeddings from seed 100 + r, prototypes from seed 99. With a
// queue, every rank's queue is filled from seed 200 + r before the call.
std::vector<LossResult> run_ours(const LossCase& c, bool f64 = false) {
  std::vector<LossResult> out(static_cast<std::size_t>(c.world));
  const auto protos = unit_rows(99, c.k, c.d);
  sk::comm::run_ranks(c.world, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    const auto z = unit_rows(100 + static_cast<std::uint64_t>(comm.rank()), c.crops * c.b, c.d);
    ag::Variable zv(
        sk::from_vector(ctx, std::vector<float>(z.begin(), z.end()), {c.crops * c.b, c.d}), true);
    ag::Variable cv(
        sk::from_vector(ctx, std::vector<float>(protos.begin(), protos.end()), {c.k, c.d}), true);
    swav::SwavLossConfig config;
    config.num_crops = c.crops;
    config.crops_for_assign = c.assign;
    config.use_double_precision = f64;
    config.local_queue_length = c.queue;
    swav::SwavLoss loss_fn(ctx, config, c.d, c.k, comm.rank(), 5);
    if (c.queue) {
      const auto q = unit_rows(200 + static_cast<std::uint64_t>(comm.rank()),
                               static_cast<std::int64_t>(c.assign.size()) * c.queue, c.d);
      sk::copy(
          ctx, loss_fn.queue(),
          sk::from_vector(ctx, std::vector<float>(q.begin(), q.end()), loss_fn.queue().shape()));
    }
    auto scores = ag::linear(ctx, zv, cv);
    auto loss = loss_fn(ctx, comm, zv, scores, swav::prototype_scorer(ctx, cv));
    ag::backward(ctx, loss);
    auto& r = out[static_cast<std::size_t>(comm.rank())];
    r.loss = sk::to_vector<float>(ctx, loss.data())[0];
    r.grad_z = sk::to_vector<float>(ctx, zv.grad());
    r.grad_c = sk::to_vector<float>(ctx, cv.grad());
  });
  return out;
}

// The same in float64: loss_r = mean over assignment crops i of mean over crops p != c_i of
// mean over samples of -sum_j q_i[j] log softmax(s_p / tau)[j]; gradients by hand.
std::vector<LossResult> run_reference(const LossCase& c) {
  const double tau = 0.1;
  const auto protos = unit_rows(99, c.k, c.d);
  std::vector<std::vector<double>> z(c.world), s(c.world), qs(c.world);
  for (int r = 0; r < c.world; ++r) {
    z[r] = unit_rows(100 + static_cast<std::uint64_t>(r), c.crops * c.b, c.d);
    for (auto& x : z[r]) x = static_cast<float>(x);  // our inputs are f32
    s[r] = matmul_t(z[r], protos, c.crops * c.b, c.k, c.d);
    if (c.queue) {
      auto q = unit_rows(200 + static_cast<std::uint64_t>(r),
                         static_cast<std::int64_t>(c.assign.size()) * c.queue, c.d);
      for (auto& x : q) x = static_cast<float>(x);
      qs[r] = matmul_t(q, protos, static_cast<std::int64_t>(c.assign.size()) * c.queue, c.k, c.d);
    }
  }
  std::vector<LossResult> out(static_cast<std::size_t>(c.world));
  std::vector<std::vector<double>> grad_s(c.world, std::vector<double>(c.crops * c.b * c.k, 0.0));
  std::vector<double> losses(c.world, 0.0);
  const double per_term = 1.0 / (double(c.assign.size()) * (c.crops - 1) * c.b);
  for (std::size_t i = 0; i < c.assign.size(); ++i) {
    const int crop = c.assign[i];
    // The global Sinkhorn matrix: rank by rank, the batch's rows then the queue's.
    const std::int64_t per_rank = c.b + c.queue;
    std::vector<double> m;
    for (int r = 0; r < c.world; ++r) {
      m.insert(m.end(), s[r].begin() + crop * c.b * c.k, s[r].begin() + (crop + 1) * c.b * c.k);
      if (c.queue)
        m.insert(m.end(), qs[r].begin() + i * c.queue * c.k,
                 qs[r].begin() + (i + 1) * c.queue * c.k);
    }
    const auto codes = reference_sinkhorn(m, c.world * per_rank, c.k, 0.05, 3);
    for (int r = 0; r < c.world; ++r)
      for (int p = 0; p < c.crops; ++p) {
        if (p == crop) continue;
        for (std::int64_t n = 0; n < c.b; ++n) {
          const double* q = codes.data() + (r * per_rank + n) * c.k;
          const double* row = s[r].data() + (p * c.b + n) * c.k;
          double mx = -1e300;
          for (std::int64_t j = 0; j < c.k; ++j) mx = std::max(mx, row[j] / tau);
          double sum = 0;
          for (std::int64_t j = 0; j < c.k; ++j) sum += std::exp(row[j] / tau - mx);
          for (std::int64_t j = 0; j < c.k; ++j) {
            const double log_p = row[j] / tau - mx - std::log(sum);
            losses[r] -= per_term * q[j] * log_p;
            grad_s[r][(p * c.b + n) * c.k + j] += per_term * (std::exp(log_p) - q[j]) / tau;
          }
        }
      }
  }
  for (int r = 0; r < c.world; ++r) {
    auto& o = out[static_cast<std::size_t>(r)];
    o.loss = losses[r];
    for (std::int64_t row = 0; row < c.crops * c.b; ++row)
      for (std::int64_t dd = 0; dd < c.d; ++dd) {
        double g = 0;
        for (std::int64_t j = 0; j < c.k; ++j) g += grad_s[r][row * c.k + j] * protos[j * c.d + dd];
        o.grad_z.push_back(static_cast<float>(g));
      }
    for (std::int64_t j = 0; j < c.k; ++j)
      for (std::int64_t dd = 0; dd < c.d; ++dd) {
        double g = 0;
        for (std::int64_t row = 0; row < c.crops * c.b; ++row)
          g += grad_s[r][row * c.k + j] * z[r][row * c.d + dd];
        o.grad_c.push_back(static_cast<float>(g));
      }
  }
  return out;
}

void check_close(const std::vector<float>& a, const std::vector<float>& b, double tol) {
  REQUIRE(a.size() == b.size());
  double scale = 0, worst = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    scale = std::max(scale, double(std::abs(b[i])));
    worst = std::max(worst, double(std::abs(a[i] - b[i])));
  }
  CHECK(worst <= tol * scale);
}

}  // namespace

TEST_CASE("the SwAV loss and its gradients equal a float64 reference, 1 and 4 ranks, queue") {
  for (int world : {1, 4}) {
    for (std::int64_t queue : {std::int64_t{0}, std::int64_t{7}}) {
      for (auto assign : {std::vector<int>{0, 1}, std::vector<int>{2}}) {
        LossCase c;
        c.world = world;
        c.queue = queue;
        c.assign = assign;
        CAPTURE(world);
        CAPTURE(queue);
        CAPTURE(assign.size());
        const auto ours = run_ours(c);
        const auto ref = run_reference(c);
        for (int r = 0; r < world; ++r) {
          CHECK(ours[r].loss == doctest::Approx(ref[r].loss).epsilon(1e-6));
          check_close(ours[r].grad_z, ref[r].grad_z, 1e-5);
          check_close(ours[r].grad_c, ref[r].grad_c, 1e-5);
        }
        const auto ours64 = run_ours(c, true);
        for (int r = 0; r < world; ++r) {
          CHECK(ours64[r].loss == doctest::Approx(ref[r].loss).epsilon(1e-7));
          check_close(ours64[r].grad_c, ref[r].grad_c, 1e-6);
        }
      }
    }
  }
}

TEST_CASE("the queue: VISSL's length rounding, start iteration and newest-first order") {
  // 3840 rounded down to a multiple of the global batch 4 x 64 x 3 = 768: 3840 / 3 per rank.
  CHECK(swav::local_queue_length(3840, 64, 3) == 1280);
  CHECK(swav::local_queue_length(1000, 64, 4) == 192);  // 768 / 4
  CHECK(swav::local_queue_length(100, 64, 4) == 0);     // shorter than one global batch

  sk::Context ctx({.seed = 3});
  sk::comm::run_ranks(1, [&](sk::Context& rctx, sk::comm::Communicator& comm) {
    const std::int64_t b = 3, d = 4, k = 5, lq = 5;
    swav::SwavLossConfig config;
    config.num_crops = 3;
    config.local_queue_length = lq;
    config.queue_start_iter = 1;
    swav::SwavLoss loss_fn(rctx, config, d, k, 0, 9);
    auto queue_now = [&] { return sk::to_vector<float>(rctx, loss_fn.queue()); };
    const auto start = queue_now();
    REQUIRE(start.size() == 2 * lq * d);
    for (float x : start) CHECK(std::abs(x) <= 1.0 / std::sqrt(d / 3.0) + 1e-6);
    auto make = [&](std::uint64_t seed) {
      const auto z = unit_rows(seed, 3 * b, d);
      return ag::Variable(
          sk::from_vector(rctx, std::vector<float>(z.begin(), z.end()), {3 * b, d}));
    };
    const auto c = unit_rows(8, k, d);
    ag::Variable cv(sk::from_vector(rctx, std::vector<float>(c.begin(), c.end()), {k, d}));
    // Iteration 0 < start_iter: the queue is neither used nor filled.
    auto z0 = make(1);
    CHECK_FALSE(loss_fn.uses_queue());
    (void)loss_fn(rctx, comm, z0, ag::linear(rctx, z0, cv), swav::prototype_scorer(rctx, cv));
    CHECK(queue_now() == start);
    CHECK(loss_fn.uses_queue());
    auto z1 = make(2);
    (void)loss_fn(rctx, comm, z1, ag::linear(rctx, z1, cv), swav::prototype_scorer(rctx, cv));
    const auto e = sk::to_vector<float>(rctx, z1.data());
    const auto q = queue_now();
    for (int i = 0; i < 2; ++i) {  // crops_for_assign {0, 1}
      const float* head = q.data() + i * lq * d;
      for (std::int64_t x = 0; x < b * d; ++x) CHECK(head[x] == e[i * b * d + x]);
      // The old front moved back by the batch; the oldest rows fell out.
      for (std::int64_t x = 0; x < (lq - b) * d; ++x)
        CHECK(head[b * d + x] == start[i * lq * d + x]);
    }
  });
  (void)ctx;
}

TEST_CASE("the SwAV loss waits for nothing: no read, upload or wait in a step, 2 ranks, queue") {
  // Counted on every device (sk::HostWaits): on a GPU each would stall the host behind the
  // device, and a captured step could not hold it. Sinkhorn, its all-reduces, the targets and
  // the queue stay on the context's device.
  sk::comm::run_ranks(2, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    const std::int64_t b = 4, d = 6, k = 9, lq = 8;
    swav::SwavLossConfig config;
    config.num_crops = 3;
    config.local_queue_length = lq;
    swav::SwavLoss loss_fn(ctx, config, d, k, comm.rank(), 4);
    const auto z = unit_rows(60 + static_cast<std::uint64_t>(comm.rank()), 3 * b, d);
    const auto c = unit_rows(61, k, d);
    ag::Variable zv(sk::from_vector(ctx, std::vector<float>(z.begin(), z.end()), {3 * b, d}), true);
    ag::Variable cv(sk::from_vector(ctx, std::vector<float>(c.begin(), c.end()), {k, d}), true);
    for (int step = 0; step < 2; ++step) {
      const sk::HostWaits before = ctx.host_waits();
      auto loss = loss_fn(ctx, comm, zv, ag::linear(ctx, zv, cv), swav::prototype_scorer(ctx, cv));
      ag::backward(ctx, loss);
      const sk::HostWaits made = ctx.host_waits() - before;
      CAPTURE(step);
      CHECK(made.reads == 0);
      CHECK(made.uploads == 0);
      CHECK(made.synchronizations == 0);
      CHECK(made.collective_waits == 0);
      CHECK(std::isfinite(sk::to_vector<float>(ctx, loss.data())[0]));
    }
  });
}

TEST_CASE("the SwAV loss refuses bad settings by name") {
  sk::Context ctx;
  swav::SwavLossConfig c;
  c.num_crops = 1;
  CHECK_THROWS_WITH(swav::SwavLoss(ctx, c, 4, 4, 0, 1), doctest::Contains("num_crops 1"));
  c.num_crops = 4;
  c.crops_for_assign = {0, 4};
  CHECK_THROWS_WITH(swav::SwavLoss(ctx, c, 4, 4, 0, 1),
                    doctest::Contains("crop 4, outside [0, 4)"));
  c.crops_for_assign = {0};
  c.temperature = 0;
  CHECK_THROWS_WITH(swav::SwavLoss(ctx, c, 4, 4, 0, 1), doctest::Contains("temperature 0"));
}

namespace {

sk::data::ImageDataset random_images(std::int64_t count, std::int64_t side) {
  sk::data::ImageDataset d;
  d.count = count;
  d.rows = d.cols = side;
  const auto v = random_values(77, static_cast<std::size_t>(count * side * side), 0, 256);
  for (double x : v) d.pixels.push_back(static_cast<std::uint8_t>(std::min(255.0, x)));
  d.labels.assign(static_cast<std::size_t>(count), 0);
  return d;
}

std::vector<swav::MultiCropBatch> all_batches(swav::MultiCropLoader& loader, std::int64_t epoch,
                                              std::vector<std::int64_t> indices, std::int64_t batch,
                                              std::int64_t first = 0) {
  loader.start_epoch(epoch, std::move(indices), batch, first);
  std::vector<swav::MultiCropBatch> out;
  while (auto b = loader.next()) out.push_back(std::move(*b));
  return out;
}

}  // namespace

TEST_CASE("multi-crop: a crop depends only on (seed, epoch, image, crop)") {
  const auto data = random_images(40, 28);
  swav::MultiCropConfig config;  // 2 x 24 + 4 x 12
  sk::data::StatefulDistributedSampler sampler(40, 1, 0, 6, 5);
  sampler.set_epoch(2);
  swav::MultiCropLoader one(data, config, 5, 1, 1), three(data, config, 5, 3, 4);
  const auto a = all_batches(one, 2, sampler.indices(), 6);
  const auto b = all_batches(three, 2, sampler.indices(), 6);
  REQUIRE(a.size() == 6);  // 40 / 6, the partial batch dropped
  REQUIRE(b.size() == a.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].number == std::int64_t(i));
    CHECK(a[i].images == b[i].images);
    REQUIRE(a[i].groups.size() == 2);
    CHECK(a[i].groups[0].size() == 2 * 6 * 24 * 24);
    CHECK(a[i].groups[1].size() == 4 * 6 * 12 * 12);
    CHECK(a[i].groups == b[i].groups);
  }
  // Resumed at batch 3 (the sampler's start_iter): the same crops as batches 3.. of the run.
  sampler.set_start_iter(3);
  const auto resumed = all_batches(one, 2, sampler.indices(), 6, 3);
  REQUIRE(resumed.size() == 3);
  for (std::size_t i = 0; i < resumed.size(); ++i) {
    CHECK(resumed[i].number == a[i + 3].number);
    CHECK(resumed[i].groups == a[i + 3].groups);
  }
  // Another epoch draws other crops of the same images.
  const auto other = all_batches(one, 3, sampler.indices(), 6, 3);
  CHECK(other[0].groups != resumed[0].groups);
}

TEST_CASE(
    "multi-crop of RGB images: grey ones repeated give the grey crop; jitter stays in range") {
  const auto grey = random_images(4, 20);
  sk::data::ImageDataset rgb = grey;
  rgb.channels = 3;
  rgb.pixels.clear();
  for (std::uint8_t v : grey.pixels) rgb.pixels.insert(rgb.pixels.end(), {v, v, v});
  swav::MultiCropConfig grey_config;  // 2 x 24 + 4 x 12, colour jitter and blur on
  grey_config.color_strength = 0;     // (a grey image's jitter draws differently from RGB's)
  auto rgb_config = grey_config;
  rgb_config.mean = {0.2860, 0.2860, 0.2860};
  rgb_config.std = {0.3530, 0.3530, 0.3530};
  const int area = 24 * 24;
  std::vector<float> g(area), c(3 * area);
  for (int crop = 0; crop < 2; ++crop) {
    swav::make_crop(grey_config, 9, 1, 3, crop, grey.image(3), g.data());
    swav::make_crop(rgb_config, 9, 1, 3, crop, rgb.image(3), c.data());
    for (int ch = 0; ch < 3; ++ch) CHECK(std::equal(g.begin(), g.end(), c.begin() + ch * area));
  }
  // Full colour distortion on random colour images: every value a normalised [0, 1] pixel.
  auto colour = random_images(6, 16);
  colour.channels = 3;
  colour.pixels = std::vector<std::uint8_t>(colour.pixels.begin(), colour.pixels.end());
  colour.pixels.resize(6 * 16 * 16 * 3);
  for (std::size_t i = 0; i < colour.pixels.size(); ++i)
    colour.pixels[i] = static_cast<std::uint8_t>((i * 131 + i / 7) % 256);
  auto jitter = rgb_config;
  jitter.color_strength = 1.0;
  jitter.color_p = 1.0;
  std::vector<float> j(3 * area);
  int greyed = 0;
  for (int image = 0; image < 6; ++image)
    for (int crop = 0; crop < 2; ++crop) {
      swav::make_crop(jitter, 3, 0, image, crop, colour.image(image), j.data());
      for (float v : j) {
        CHECK(v >= (0 - 0.2860) / 0.3530 - 1e-5);
        CHECK(v <= (1 - 0.2860) / 0.3530 + 1e-5);
      }
      greyed += std::equal(j.begin(), j.begin() + area, j.begin() + area) &&
                std::equal(j.begin(), j.begin() + area, j.begin() + 2 * area);
    }
  CHECK(greyed < 12);  // RandomGrayscale takes about one crop in five, not all, nor none
  CHECK(greyed > 0);   // (these seeds' draws: a grayscale that never fires fails here)
  // The loader's crops carry the channels: [crops x B, 3, side, side].
  swav::MultiCropLoader loader(colour, jitter, 5, 2, 2);
  sk::data::StatefulDistributedSampler sampler(6, 1, 0, 3, 5);
  const auto batches = all_batches(loader, 0, sampler.indices(), 3);
  REQUIRE(batches.size() == 2);
  CHECK(batches[0].groups[0].size() == 2 * 3 * 3 * 24 * 24);
  CHECK(batches[0].groups[1].size() == 4 * 3 * 3 * 12 * 12);
  // A Normalize of one entry on RGB images is refused, naming the fix.
  CHECK_THROWS_WITH(swav::make_crop(grey_config, 1, 0, 0, 0, colour.image(0), j.data()),
                    doctest::Contains("give one per channel"));
}

// A worker's failure ends its epoch (next() rethrows it); a caller that handles it and starts
// another epoch gets that epoch's batches, not the old error again.
TEST_CASE("the loader reports a worker's failure once, for its own epoch") {
  auto data = random_images(6, 16);
  data.channels = 3;  // RGB images under a one-entry Normalize: every crop refused
  data.pixels.resize(6 * 16 * 16 * 3, 7);
  swav::MultiCropLoader loader(data, swav::MultiCropConfig{}, 5, 2, 2);
  sk::data::StatefulDistributedSampler sampler(6, 1, 0, 3, 5);
  CHECK_THROWS_WITH(all_batches(loader, 0, sampler.indices(), 3),
                    doctest::Contains("give one per channel"));
  loader.start_epoch(0, {}, 3);  // (stops the failed epoch's workers, which read the images)
  data.channels = 1;             // the same loader, images it can crop
  const auto batches = all_batches(loader, 1, sampler.indices(), 3);
  REQUIRE(batches.size() == 2);
  CHECK(batches[1].number == 1);
}

TEST_CASE("multi-crop transforms: whole-image crop, flip, blur, boxes, bad settings") {
  const auto data = random_images(3, 28);
  swav::MultiCropConfig plain;
  plain.num_crops = {1};
  plain.size_crops = {28};
  plain.crop_scales = {{1.0, 1.0}};
  plain.flip_p = 0;
  plain.color_strength = 0;
  plain.blur_p = 0;
  std::vector<float> out(28 * 28), flipped(28 * 28);
  swav::make_crop(plain, 1, 0, 2, 0, data.image(2), out.data());
  // The whole image, normalised: (pixel / 255 - mean) / std.
  double worst = 0;
  for (int i = 0; i < 28 * 28; ++i)
    worst = std::max(
        worst, std::abs(out[i] - (data.image(2).pixels[i] / 255.0 - plain.mean[0]) / plain.std[0]));
  CHECK(worst < 1e-5);
  auto mirror = plain;
  mirror.flip_p = 1;
  swav::make_crop(mirror, 1, 0, 2, 0, data.image(2), flipped.data());
  for (int y = 0; y < 28; ++y)
    for (int x = 0; x < 28; ++x) CHECK(flipped[y * 28 + x] == out[y * 28 + 27 - x]);
  // Blur keeps a constant image constant and smooths a random one.
  std::vector<float> flat(16 * 16, 0.3f);
  swav::gaussian_blur(flat.data(), 16, 1.5);
  for (float v : flat) CHECK(v == doctest::Approx(0.3f).epsilon(1e-5));
  auto blurred = out;
  swav::gaussian_blur(blurred.data(), 28, 1.0);
  auto variance = [](const std::vector<float>& v) {
    double m = 0, s = 0;
    for (float x : v) m += x;
    m /= double(v.size());
    for (float x : v) s += (x - m) * (x - m);
    return s / double(v.size());
  };
  CHECK(variance(blurred) < 0.5 * variance(out));
  // Boxes lie inside the image with areas in the scale range (or are the centred fallback).
  for (int i = 0; i < 200; ++i) {
    swav::CropRandom rng(3, 0, i, 1);
    const auto box = swav::random_resized_box(rng, 28, 28, {0.05, 0.14});
    CHECK(box.top >= 0);
    CHECK(box.left >= 0);
    CHECK(box.top + box.height <= 28);
    CHECK(box.left + box.width <= 28);
    const double area = double(box.height * box.width) / (28.0 * 28.0);
    CHECK(area <= 0.14 + 0.05);  // rounding of the sides
    CHECK(area >= 0.04);         // (0.05 of the image, its sides rounded: 5 x 7 at the least)
  }
  swav::MultiCropConfig bad;
  bad.size_crops = {24};
  CHECK_THROWS_WITH(bad.validate(), doctest::Contains("one entry per crop size"));
  bad = {};
  bad.crop_scales[1] = {0.3, 0.1};
  CHECK_THROWS_WITH(bad.validate(), doctest::Contains("crop_scales[1] = [0.3, 0.1]"));
}

namespace {

swav::ConfigTree tree_of(const std::vector<std::string>& overrides, const std::string& yaml = "") {
  swav::ConfigTree tree(swav::kDefaultsYaml);
  if (!yaml.empty()) {
    const auto path = std::filesystem::temp_directory_path() /
                      ("shardkit_swav_config_" + std::to_string(::getpid()) + ".yaml");
    std::ofstream(path) << yaml;
    tree.merge_file(path.string());
    std::filesystem::remove(path);
  }
  for (const auto& o : overrides) tree.apply_override(o);
  return tree;
}

swav::SwavConfig config_of(const std::vector<std::string>& overrides, const std::string& yaml = "",
                           int world = 2) {
  return swav::read_swav_config(tree_of(overrides, yaml), world);
}

// A folder of its own under the temporary directory, removed when the test leaves it (a failed
// REQUIRE or an exception included).
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& prefix) {
    std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "XXXXXX")).string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    path = pattern;
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
};

// The working directory moved to `path` while this lives.
struct WorkingDirectory {
  std::filesystem::path previous = std::filesystem::current_path();
  explicit WorkingDirectory(const std::filesystem::path& path) {
    std::filesystem::current_path(path);
  }
  WorkingDirectory(const WorkingDirectory&) = delete;
  WorkingDirectory& operator=(const WorkingDirectory&) = delete;
  ~WorkingDirectory() {
    std::error_code ec;
    std::filesystem::current_path(previous, ec);
  }
};

// The message of the ConfigError that reading `tree` throws ("" when none).
std::string config_problems(const swav::ConfigTree& tree) {
  try {
    swav::read_swav_config(tree, 2);
  } catch (const swav::ConfigError& e) {
    return e.what();
  }
  return "";
}

// `report` counts `count` problems and says each of `parts`.
void check_problems(const std::string& report, int count, const std::vector<std::string>& parts) {
  INFO(report);
  CHECK(report.find("the config has " + std::to_string(count) + " problems") == 0);
  for (const auto& part : parts) CHECK_MESSAGE(report.find(part) != std::string::npos, part);
}

}  // namespace

TEST_CASE("config: data sources -- fashion_mnist, disk_folder, synthetic -- and RGB Normalize") {
  const auto d = config_of({});
  CHECK(d.train_data.kind == "fashion_mnist");
  CHECK(d.test_data.path == "/usr/share/datasets/fashion-mnist");
  const auto folder = config_of(
      {"config.DATA.TRAIN.DATA_SOURCES=[disk_folder]", "config.DATA.TRAIN.DATA_PATHS=[/data/train]",
       "config.DATA.TEST.DATA_SOURCES=[disk_folder]", "config.DATA.TEST.DATA_PATHS=[/data/test]",
       "config.DATA.TRAIN.DATA_LIMIT=500", "config.DATA.TRAIN.DATA_LIMIT_SAMPLING.SEED=3",
       "config.DATA.TRAIN.TRANSFORMS=[{name: ImgPilToMultiCrop, total_num_crops: 2, "
       "size_crops: [32], num_crops: [2], crop_scales: [[0.14, 1]]}, {name: Normalize, "
       "mean: [0.485, 0.456, 0.406], std: [0.229, 0.224, 0.225]}]"});
  CHECK(folder.train_data.kind == "disk_folder");
  CHECK(folder.train_data.path == "/data/train");
  CHECK(folder.train_data.limit == 500);
  CHECK(folder.train_data.sampling_seed == 3);
  CHECK(folder.crops.mean.size() == 3);
  CHECK(folder.crops.std[2] == doctest::Approx(0.225));
  // A list without Normalize normalises nothing (VISSL's values in [0, 1]); it used to keep
  // Fashion-MNIST's statistics, and refuse RGB images for a Normalize nobody wrote.
  const auto unnormalised =
      config_of({"config.DATA.TRAIN.TRANSFORMS=[{name: ImgPilToMultiCrop, total_num_crops: 2, "
                 "size_crops: [32], num_crops: [2], crop_scales: [[0.14, 1]]}, {name: ToTensor}]"});
  CHECK(unnormalised.crops.mean.empty());
  std::vector<float> planes{0.0f, 0.25f, 1.0f};
  unnormalised.crops.normalize(planes.data(), 1, 3);
  CHECK(planes == std::vector<float>{0.0f, 0.25f, 1.0f});
  const auto synthetic =
      config_of({"config.DATA.TEST.DATA_SOURCES=[synthetic]", "config.DATA.TEST.DATA_PATHS=[]",
                 "config.DATA.TEST.DATA_LIMIT=64", "config.DATA.TEST.DEFAULT_GRAY_IMG_SIZE=16",
                 "config.DATA.TRAIN.RANDOM_SYNTHETIC_LABELS=5"});
  CHECK(synthetic.test_data.kind == "synthetic");
  CHECK(synthetic.test_data.synthetic_side == 16);
  CHECK(synthetic.test_data.synthetic_classes == 5);
  // Refusals, all in one report.
  const std::string problems = config_problems(tree_of(
      {"config.DATA.TRAIN.DATA_SOURCES=[synthetic]", "config.DATA.TEST.DATA_SOURCES=[disk_folder]",
       "config.DATA.TEST.DATA_PATHS=[/a, /b]",
       "config.DATA.TRAIN.TRANSFORMS=[{name: ImgPilToMultiCrop, total_num_crops: 2, "
       "size_crops: [32], num_crops: [2], crop_scales: [[0.14, 1]]}, {name: Normalize, "
       "mean: [0.5, 0.5], std: [0.2, 0.2]}]"}));
  check_problems(problems, 3,
                 {"config.DATA.TRAIN.DATA_LIMIT = -1: the synthetic source makes DATA_LIMIT images",
                  "config.DATA.TEST.DATA_PATHS = [/a, /b]: give one folder holding a subfolder of "
                  "images per class",
                  "give one mean and one std per channel"});
}

TEST_CASE("config: given keys; DATA.TEST left out; the machine's and the data's problems join") {
  // What a file or an override gave, by key or by section (the old trunk schema's keys under
  // their new place).
  const auto given = tree_of({"config.DATA.TEST.DATA_LIMIT=5"},
                             "config:\n  MODEL:\n    TRUNK:\n      TRUNK_PARAMS:\n"
                             "        RESNETS:\n          DEPTH: 18\n");
  CHECK(given.given("DATA.TEST.DATA_LIMIT"));
  CHECK(given.given("DATA.TEST"));
  CHECK(given.given("DATA"));
  CHECK(given.given("MODEL.TRUNK.RESNETS.DEPTH"));
  CHECK(given.given("MODEL.TRUNK"));
  CHECK_FALSE(given.given("DATA.TEST.DATA_SOURCES"));
  CHECK_FALSE(given.given("DATA.TES"));
  CHECK_FALSE(given.given("DATA.TRAIN"));
  CHECK_FALSE(given.given("MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER"));
  // A key beside config: at a file's top (an indentation slip) was dropped without a word.
  CHECK(config_problems(tree_of({},
                                "config:\n  OPTIMIZER:\n    num_epochs: 2\n"
                                "DATA:\n  TRAIN:\n    BATCHSIZE_PER_REPLICA: 8\n"))
            .find("the key DATA stands beside config: at the top, where it is not read") !=
        std::string::npos);
  // An empty value for a text key is the empty text, as Hydra reads `key=` (it was "null": the
  // metrics went to ./null); and the kNN's features are L2-normalised always (False refused).
  CHECK(config_of({"config.METRICS.JSONL="}).metrics_path ==
        config_of({}).checkpoint_dir + "/metrics.jsonl");
  CHECK(config_problems(tree_of({"config.NEAREST_NEIGHBOR.L2_NORM_FEATS=False"}))
            .find("always compares L2-normalised features") != std::string::npos);

  // Training on other images than the default's while DATA.TEST stays Fashion-MNIST: the kNN
  // would query one dataset against another's memory bank.
  const std::string left_out = config_problems(
      tree_of({"config.DATA.TRAIN.DATA_SOURCES=[synthetic]", "config.DATA.TRAIN.DATA_LIMIT=64"}));
  CHECK(left_out.find("config.DATA.TEST is left at its default (fashion_mnist) while DATA.TRAIN "
                      "reads [synthetic]") == 0);
  CHECK(left_out.find("set config.DATA.TEST.DATA_SOURCES=[synthetic] and "
                      "config.DATA.TEST.DATA_LIMIT") != std::string::npos);
  CHECK(config_problems(tree_of({"config.DATA.TRAIN.DATA_SOURCES=[disk_folder]",
                                 "config.DATA.TRAIN.DATA_PATHS=[/data/train]"}))
            .find("config.DATA.TEST.DATA_PATHS=[a folder of held-out images") != std::string::npos);
  // An image folder's path is the user's to give (VISSL's configs name a dataset instead).
  CHECK(config_problems(tree_of({"config.DATA.TRAIN.DATA_SOURCES=[disk_folder]",
                                 "config.DATA.TEST.DATA_SOURCES=[disk_folder]",
                                 "config.DATA.TEST.DATA_PATHS=[/data/test]"}))
            .find("config.DATA.TRAIN.DATA_PATHS = (not given: the default is Fashion-MNIST's "
                  "folder): give the folder") == 0);
  CHECK(
      config_problems(
          tree_of({"config.DATA.TRAIN.DATA_SOURCES=[synthetic]", "config.DATA.TRAIN.DATA_LIMIT=64",
                   "config.DATA.TEST.DATA_SOURCES=[synthetic]", "config.DATA.TEST.DATA_LIMIT=16"}))
          .empty());
  // The same kind given in other folders needs no DATA.TEST.
  CHECK(config_problems(tree_of({"config.DATA.TRAIN.DATA_SOURCES=[fashion_mnist]",
                                 "config.DATA.TRAIN.DATA_PATHS=[/elsewhere]"}))
            .empty());

  // A machine without CUDA, whose probe of the data refuses one folder by its path and knows
  // the channels of the sources that fix them.
  std::vector<std::string> probed;
  bool cuda_build = false, gpu = false;
  const auto machine = [&] {
    return swav::Machine{
        .cuda_build = cuda_build,
        .gpu = gpu,
        .probe_data = [&](const swav::DataSource& source, const std::string& key) -> std::int64_t {
          probed.push_back(key + " " + source.kind);
          if (source.path == "/missing")
            throw sk::IoError("config." + key +
                              ".DATA_PATHS = [/missing]: image folder "
                              "'/missing' is not a folder");
          return source.kind == "fashion_mnist" ? 1 : source.kind == "synthetic" ? 3 : 0;
        }};
  };
  const auto read_on = [&](const std::vector<std::string>& overrides) {
    const swav::Machine m = machine();
    try {
      swav::read_swav_config(tree_of(overrides), 2, &m);
    } catch (const swav::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  // The device, a misspelt key and both splits' folders: one report.
  check_problems(
      read_on({"config.MACHINE.DEVICE=gpu", "config.OPTIMIZER.num_epoch=2",
               "config.DATA.TRAIN.DATA_SOURCES=[disk_folder]",
               "config.DATA.TRAIN.DATA_PATHS=[/missing]",
               "config.DATA.TEST.DATA_SOURCES=[disk_folder]",
               "config.DATA.TEST.DATA_PATHS=[/missing]"}),
      4,
      {"1. unknown config key config.OPTIMIZER.num_epoch",
       "2. config.MACHINE.DEVICE = gpu: this trainer was built without CUDA",
       "3. config.DATA.TRAIN.DATA_PATHS = [/missing]: image folder '/missing' is not a folder",
       "4. config.DATA.TEST.DATA_PATHS = [/missing]"});
  CHECK(probed == std::vector<std::string>{"DATA.TRAIN disk_folder", "DATA.TEST disk_folder"});
  cuda_build = true;
  CHECK(read_on({"config.MACHINE.DEVICE=gpu"}).find("this machine has no CUDA GPU") !=
        std::string::npos);
  CHECK(read_on({"config.MACHINE.DEVICE=auto"}).empty());
  gpu = true;
  CHECK(read_on({"config.MACHINE.DEVICE=gpu"}).empty());
  // A refused source is not probed; the other split still is -- but not the default test split
  // left beside other training images (its files and channels are beside the point then).
  probed.clear();
  (void)read_on({"config.DATA.TRAIN.DATA_SOURCES=[disk_filelist]",
                 "config.DATA.TEST.DATA_SOURCES=[synthetic]", "config.DATA.TEST.DATA_LIMIT=8"});
  CHECK(probed == std::vector<std::string>{"DATA.TEST synthetic"});
  probed.clear();
  check_problems(read_on({"config.DATA.TRAIN.DATA_SOURCES=[synthetic]",
                          "config.DATA.TRAIN.DATA_LIMIT=64", "config.OPTIMIZER.num_epochs=0"}),
                 3,
                 {"config.DATA.TEST is left at its default", "Normalize has 1 mean/std entries",
                  "config.OPTIMIZER.num_epochs"});
  CHECK(probed == std::vector<std::string>{"DATA.TRAIN synthetic"});
  // A DATA_SOURCES of the wrong shape or type is said once, and its split is not probed (the
  // default's data would stand in): no word of Fashion-MNIST's files or of DATA.TEST.
  probed.clear();
  for (const std::string value : {"[[a]]", "disk_folder"}) {
    const std::string once = read_on({"config.DATA.TRAIN.DATA_SOURCES=" + value});
    CHECK(once.find("DATA.TRAIN.DATA_SOURCES") != std::string::npos);
    CHECK(once.find("the config has") == std::string::npos);
  }
  CHECK(probed == std::vector<std::string>{"DATA.TEST fashion_mnist", "DATA.TEST fashion_mnist"});
  probed.clear();
  const std::string test_once =
      read_on({"config.DATA.TRAIN.DATA_SOURCES=[synthetic]", "config.DATA.TRAIN.DATA_LIMIT=64",
               "config.DATA.TEST.DATA_SOURCES=disk_folder"});
  CHECK(test_once.find("config.DATA.TEST.DATA_SOURCES = disk_folder is a string") !=
        std::string::npos);
  CHECK(test_once.find("left at its default") == std::string::npos);
  CHECK(probed == std::vector<std::string>{"DATA.TRAIN synthetic"});
  // RANDOM_SYNTHETIC_LABELS, which both splits read, is said once.
  CHECK(read_on({"config.DATA.TRAIN.RANDOM_SYNTHETIC_LABELS=70000"})
            .find("config.DATA.TRAIN.RANDOM_SYNTHETIC_LABELS = 70000") == 0);
  // The device's check stands apart from the other machine settings.
  check_problems(read_on({"config.MACHINE.DEVICE=tpu", "config.LOG_FREQUENCY=0",
                          "config.MACHINE.CUDA_GRAPH=maybe"}),
                 3,
                 {"config.LOG_FREQUENCY = 0", "config.MACHINE.DEVICE = tpu",
                  "config.MACHINE.CUDA_GRAPH = maybe"});
  // Channels the sources fix are checked with the config: synthetic RGB training images against
  // Fashion-MNIST's grey test images and a one-channel Normalize.
  check_problems(
      read_on({"config.OPTIMIZER.num_epochs=0", "config.DATA.TRAIN.DATA_SOURCES=[synthetic]",
               "config.DATA.TRAIN.DATA_LIMIT=64", "config.DATA.TEST.DATA_SOURCES=[fashion_mnist]"}),
      3,
      {"DATA.TRAIN's images have 3 channels and DATA.TEST's 1",
       "DATA.TRAIN.TRANSFORMS' Normalize has 1 mean/std entries but the images have "
       "3 channels",
       "config.OPTIMIZER.num_epochs = 0"});
  // An image folder's channels are known once its images are decoded: nothing said yet.
  CHECK(read_on({"config.DATA.TRAIN.DATA_SOURCES=[disk_folder]",
                 "config.DATA.TRAIN.DATA_PATHS=[/data/train]",
                 "config.DATA.TEST.DATA_SOURCES=[disk_folder]",
                 "config.DATA.TEST.DATA_PATHS=[/data/test]"})
            .empty());
}

TEST_CASE("config: TEST_MODEL False trains without the kNN; DATA.TEST unread, a kNN key refused") {
  CHECK(config_of({}).test_model);
  CHECK_FALSE(config_of({"config.TEST_MODEL=False"}).test_model);
  // VISSL's pretraining configs: other training images, TEST_MODEL False and no test split --
  // nothing to edit about DATA.TEST; with TEST_MODEL True (the default) the left-out split is a
  // problem whose fix names both ways.
  const std::vector<std::string> synthetic = {"config.DATA.TRAIN.DATA_SOURCES=[synthetic]",
                                              "config.DATA.TRAIN.DATA_LIMIT=64"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), synthetic.begin(), synthetic.end());
    return tree_of(more);
  };
  CHECK(config_problems(with({"config.TEST_MODEL=False"})).empty());
  CHECK(config_problems(with({})).find("or config.TEST_MODEL=False to train without the kNN "
                                       "evaluation") != std::string::npos);
  // DATA.TEST's keys are not read, so not refused: a source and transforms this trainer lacks.
  const std::vector<std::string> odd_test = {"config.DATA.TEST.DATA_SOURCES=[disk_filelist]",
                                             "config.DATA.TEST.TRANSFORMS=[{name: RandAugment}]"};
  std::vector<std::string> untested = odd_test;
  untested.push_back("config.TEST_MODEL=False");
  CHECK(config_problems(with(untested)).empty());
  check_problems(config_problems(with(odd_test)), 2,
                 {"config.DATA.TEST.DATA_SOURCES = [disk_filelist]", "RandAugment"});
  // Nor probed on the machine.
  std::vector<std::string> probed;
  const swav::Machine machine{
      .probe_data = [&](const swav::DataSource& source, const std::string& key) -> std::int64_t {
        probed.push_back(key + " " + source.kind);
        return source.kind == "synthetic" ? 3 : 1;
      }};
  const std::vector<std::string> rgb_test = {
      "config.DATA.TRAIN.TRANSFORMS=[{name: ImgPilToMultiCrop, total_num_crops: 2, size_crops: "
      "[8], num_crops: [2], crop_scales: [[0.5, 1]]}, {name: ToTensor}, {name: Normalize, mean: "
      "[0.5, 0.5, 0.5], std: [0.2, 0.2, 0.2]}]",
      "config.DATA.TEST.DATA_SOURCES=[synthetic]", "config.DATA.TEST.DATA_LIMIT=8"};
  (void)swav::read_swav_config(with(rgb_test), 2, &machine);
  CHECK(probed == std::vector<std::string>{"DATA.TRAIN synthetic", "DATA.TEST synthetic"});
  probed.clear();
  std::vector<std::string> rgb_untested = rgb_test;
  rgb_untested.push_back("config.TEST_MODEL=False");
  (void)swav::read_swav_config(with(rgb_untested), 2, &machine);
  CHECK(probed == std::vector<std::string>{"DATA.TRAIN synthetic"});
  // What asks for a kNN evaluation is refused beside TEST_MODEL False, all in one report; a
  // TEST_MODEL that is no boolean too.
  check_problems(
      config_problems(tree_of({"config.TEST_MODEL=False", "config.NEAREST_NEIGHBOR.FREQUENCY=2",
                               "config.NEAREST_NEIGHBOR.EXPORT_EMBEDDINGS=/tmp/e"})),
      2,
      {"config.NEAREST_NEIGHBOR.FREQUENCY = 2: asks for kNN evaluations on DATA.TEST, "
       "which config.TEST_MODEL = False turns off; set TEST_MODEL True (with "
       "DATA.TEST's images) or FREQUENCY 0",
       "config.NEAREST_NEIGHBOR.EXPORT_EMBEDDINGS = /tmp/e: asks for kNN evaluations"});
  // A TEST_MODEL that is no boolean is the one problem (its default does not bring DATA.TEST's
  // in); the kNN's own settings are not read without an evaluation.
  check_problems(config_problems(with({"config.TEST_MODEL=maybe", "config.OPTIMIZER.num_epochs=0",
                                       "config.DATA.TEST.BATCHSIZE_PER_REPLICA=0"})),
                 2,
                 {"config.TEST_MODEL = maybe is a string; it must be a boolean",
                  "config.OPTIMIZER.num_epochs = 0"});
  const std::string bad_pools =
      "config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP=[[res9, [Identity, []]]]";
  CHECK(config_problems(tree_of({"config.TEST_MODEL=False", bad_pools})).empty());
  CHECK(config_problems(tree_of({bad_pools})).find("LINEAR_EVAL_FEAT_POOL_OPS_MAP") !=
        std::string::npos);
  CHECK(config_problems(tree_of({"config.DATA.TEST.BATCHSIZE_PER_REPLICA=0"}))
            .find("config.DATA.TEST.BATCHSIZE_PER_REPLICA = 0: must be >= 1") != std::string::npos);
  CHECK(config_problems(
            tree_of({"config.TEST_MODEL=False", "config.DATA.TEST.BATCHSIZE_PER_REPLICA=0"}))
            .empty());
}

TEST_CASE("before the ranks start: the images per rank, the ranks' host memory") {
  // VISSL's SwAV configs ask for 8 nodes of 8 GPUs and 64 images a rank: as threads of one
  // process, 64 ResNet-50s (VISSL's default trunk) with their gradients and momentum take
  // about 29 GB before any activation (their own f32 parameters beside DDP's buffers while they
  // wrap), and 100 images give each rank one.
  const auto c =
      config_of({"config.DISTRIBUTED.NUM_NODES=8", "config.DISTRIBUTED.NUM_PROC_PER_NODE=8",
                 "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=64", "config.TEST_MODEL=False"},
                "", 64);
  swav::Datasets data;
  data.train = random_images(100, 8);
  const auto report_of = [&](const swav::SwavConfig& config, int world, int local, bool cpu,
                             bool launched, std::int64_t available) {
    try {
      swav::check_ranks_fit(config, data, world, local, cpu, launched, available);
    } catch (const swav::ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  constexpr std::int64_t k4GiB = std::int64_t{4} << 30;
  check_problems(report_of(c, 64, 64, true, false, k4GiB), 2,
                 {"config.DATA.TRAIN.BATCHSIZE_PER_REPLICA = 64 exceeds the 1 training images per "
                  "rank",
                  "config.DISTRIBUTED: 64 ranks as threads of this process would hold at least "
                  "29.04 GB of model states -- under ddp up to 453.8 MB a rank as they build "
                  "their modules or step, before activations -- and this machine has 4.29 GB "
                  "available; run at most 9 here (NUM_NODES=1, NUM_PROC_PER_NODE=9), shard the "
                  "states",
                  "or spread the ranks over several machines"});
  // Launched side by side (8 processes on this machine): their share of the world's plans, and
  // no NUM_PROC_PER_NODE to suggest.
  const std::string launched = report_of(c, 64, 8, true, true, std::int64_t{1} << 30);
  CHECK(launched.find("config.DISTRIBUTED: 8 ranks launched on this machine would hold at least "
                      "3.63 GB") != std::string::npos);
  CHECK(launched.find("start fewer processes on this machine") != std::string::npos);
  // Fewer ranks than images; a GPU run's states are not the host's; an unknown figure refuses
  // nothing.
  CHECK(report_of(c, 128, 1, true, false, -1)
            .find("config.DISTRIBUTED: 128 ranks, but 100 training images") == 0);
  const auto two =
      config_of({"config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=32", "config.TEST_MODEL=False"});
  CHECK(report_of(two, 2, 2, true, false, k4GiB).empty());
  CHECK(report_of(two, 2, 64, false, false, 1).empty());
  CHECK(report_of(two, 2, 2, true, false, std::int64_t{100} << 20)
            .find("; shard the states (OPTIMIZER.use_zero") != std::string::npos);
  // Under fsdp the states are sharded already: machines, each with its share, are the fix.
  const auto sharded_two =
      config_of({"config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=32", "config.TEST_MODEL=False",
                 "config.TRAINER.TASK_NAME=self_supervision_fsdp_task"});
  const std::string machines = report_of(sharded_two, 2, 2, true, false, std::int64_t{400} << 20);
  INFO(machines);
  CHECK(machines.find("the states are sharded already (fsdp) and a rank's share shrinks as the "
                      "world grows: at a world of 2 ranks a rank holds 0.31 GB of them, so run 2 "
                      "ranks on 2 machines of this memory, 1 a machine") != std::string::npos);
  // (a floor no world goes below: the root unit and the gathered units, whole on every rank)
  CHECK(report_of(sharded_two, 2, 2, true, false, std::int64_t{100} << 20)
            .find("the states are sharded already (fsdp), and even at a world of ") !=
        std::string::npos);
  CHECK(machines.find("shard the states (") == std::string::npos);
  // (Linux says what is available: /proc/meminfo, and the memory cgroups' files where they are)
  CHECK(swav::available_host_memory() >= 0);

  // Each rank's own plan, summed: under oss the optimizer state is sharded (the shards near
  // equal in size); CPU offload's "host" share counts.
  sk::Context ctx;
  const auto planned = [&](const swav::SwavConfig& config) {
    sk::DeferredParameters deferred(ctx);
    return std::make_shared<swav::SwavModel>(ctx, config);
  };
  const auto oss = config_of({"config.OPTIMIZER.use_zero=True", "config.TEST_MODEL=False"}, "", 8);
  const auto oss_need = swav::host_memory_need(*planned(oss), oss, data, 8, 8, true, false);
  CHECK(oss_need.local_states <= 8 * oss_need.states_per_rank_max);
  CHECK(oss_need.local_states > 7 * oss_need.states_per_rank_max);  // (its shards are near equal)
  const auto ddp = config_of({"config.TEST_MODEL=False"}, "", 8);
  CHECK(oss_need.local_states <
        swav::host_memory_need(*planned(ddp), ddp, data, 8, 8, true, false).local_states);
  const auto fsdp = config_of(
      {"config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True", "config.TEST_MODEL=False"}, "", 8);
  const auto offload =
      config_of({"config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
                 "config.MODEL.FSDP_CONFIG.move_params_to_cpu=True", "config.TEST_MODEL=False"},
                "", 8);
  const auto fsdp_need = swav::host_memory_need(*planned(fsdp), fsdp, data, 8, 8, true, false);
  const auto offload_need =
      swav::host_memory_need(*planned(offload), offload, data, 8, 8, true, false);
  CHECK(offload_need.local_states >= fsdp_need.local_states * 9 / 10);  // moved, not gone
  // Under fsdp a rank holds more in a smaller world: the ranks suggested are re-planned there.
  const std::int64_t available = fsdp_need.local_states / 2;
  const std::string sharded = report_of(fsdp, 8, 8, true, false, available);
  const auto at = sharded.find("run at most ");
  REQUIRE(at != std::string::npos);
  const int fit = std::stoi(sharded.substr(at + 12));
  const auto states_at = [&](int world) {
    return swav::cpu_rank_states(swav::rank_setup(*planned(fsdp), fsdp, world).memory, fsdp) *
           world;
  };
  CHECK(states_at(fit) <= available);
  CHECK(states_at(fit + 1) > available);

  // The raw-pixel kNN: the bank's pixels as floats once per process, each rank's share of the
  // test images'. Six grey 8 x 8 images in each split, 64 floats (256 bytes) an image; two ranks
  // as threads hold the bank once and three test images each: 12 x 256 = 3072 bytes. Within
  // 2500 bytes a bank of three images fits beside the six test images. (The network's features
  // here: a ResNet-18 of one base channel, res5avg's 8 floats an image, one neighbour.)
  const std::vector<std::string> narrow{
      "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=2",
      "config.MODEL.TRUNK.RESNETS.DEPTH=18",
      "config.MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER=0.015625",
      "config.NEAREST_NEIGHBOR.TOPK=1",
      R"(config.MODEL.HEAD.PARAMS=[["swav_head", {"dims": [8, 16, 4], "num_clusters": [3]}]])",
      "config.DATA.TEST.TRANSFORMS=[{name: ToTensor}]"};
  const auto tested = config_of(narrow);
  swav::Datasets small;
  small.train = random_images(6, 8);
  small.test = random_images(6, 8);
  small.bank_size = 6;
  CHECK(swav::check_ranks_fit(tested, small, 2, 2, false, false, 3072).knn_local == 3072);
  try {
    swav::check_ranks_fit(tested, small, 2, 2, false, false, 2500);
    FAIL("the raw-pixel kNN's floats were not checked");
  } catch (const swav::ConfigError& e) {
    CHECK(std::string(e.what()) ==
          "config.NEAREST_NEIGHBOR.MEMORY_BANK_LIMIT = -1: 2 ranks as threads of this process "
          "would hold, for the raw-pixel kNN, the memory bank's 6 images (one copy, shared) and "
          "their shares of the 6 test images, as 64 floats an image: 0.00 GB with the model "
          "states, and this machine has 0.00 GB available; set MEMORY_BANK_LIMIT to at most 3, "
          "or TEST_MODEL to False");
  }
  // Two processes launched side by side hold a bank each: 4608 bytes.
  try {
    swav::check_ranks_fit(tested, small, 2, 2, false, true, 4000);
    FAIL("the launched processes' banks were not checked");
  } catch (const swav::ConfigError& e) {
    CHECK(std::string(e.what()).find("2 ranks launched on this machine would hold, for the "
                                     "raw-pixel kNN, the memory bank's 6 images (a copy a "
                                     "process)") != std::string::npos);
    CHECK(std::string(e.what()).find("set MEMORY_BANK_LIMIT to at most 4,") != std::string::npos);
  }
  CHECK_NOTHROW(swav::check_ranks_fit(tested, small, 2, 2, false, true, 4608));
  small.bank_size = 3;
  CHECK_NOTHROW(swav::check_ranks_fit(tested, small, 2, 2, false, false, 2500));

  // The network's kNN: each rank its share of the bank's features and every test image's, with
  // the k neighbours of every query at 48 bytes an entry. A ResNet-18 of 64 base channels with
  // the small stem, at 8 pixels: res4 (layer3: 256 channels of 2 x 2) and res5avg (512), 1536
  // floats (6144 bytes) an image. Two threads, three bank images each, the six test images each,
  // 2 neighbours: 2 x (3 x 6144 + 6 x 6144 + 6 x 2 x 48) = 111744 bytes. Within 100000 a bank
  // of four fits (2 x (2 x 6144 + 36864 + 576) = 99456), one of five is three a rank.
  std::vector<std::string> features = narrow;
  for (const char* key :
       {"config.NEAREST_NEIGHBOR.TOPK=2", "config.MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER=1",
        R"(config.MODEL.HEAD.PARAMS=[["swav_head", {"dims": [512, 16, 4], "num_clusters": [3]}]])",
        "config.MODEL.TRUNK.RESNETS.SMALL_IMAGE_STEM=True",
        "config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP=[[res4, [Identity, "
        "[]]], [res5avg, [Identity, []]]]"})
    features.emplace_back(key);
  const auto network = config_of(features);
  small.bank_size = 6;
  const auto network_need = swav::check_ranks_fit(network, small, 2, 2, false, false, 111744);
  CHECK(network_need.network_bank_row == 6144);
  CHECK(network_need.network_test_row == 6144);
  CHECK(network_need.network_knn_local == 111744);
  CHECK(network_need.knn_local == 3072);  // (the raw pixels', held before)
  try {
    swav::check_ranks_fit(network, small, 2, 2, false, false, 100000);
    FAIL("the network kNN's features were not checked");
  } catch (const swav::ConfigError& e) {
    CHECK(std::string(e.what()) ==
          "config.NEAREST_NEIGHBOR.MEMORY_BANK_LIMIT = -1: 2 ranks as threads of this process "
          "would hold, for the network's kNN, each its share of the memory bank's 6 images and "
          "all the 6 test images, as 1536 and 1536 floats an image (the feature sets of "
          "MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP), with their lists of 2 "
          "neighbours: 0.00 GB with the model states, and this machine has 0.00 GB available; set "
          "MEMORY_BANK_LIMIT to at most 4, pool the features smaller, run fewer ranks here, or "
          "set TEST_MODEL to False");
  }
  // Exporting the features, rank 0 also holds what it writes, the whole bank's features and every
  // test image's (6 x 6144 + 6 x 6144), and the whole bank of the set it gathers (6 x 6144).
  std::vector<std::string> exported = features;
  exported.emplace_back("config.NEAREST_NEIGHBOR.EXPORT_EMBEDDINGS=/tmp/unused");
  CHECK(swav::check_ranks_fit(config_of(exported), small, 2, 2, false, false, 1 << 20)
            .network_knn_local == 111744 + 3 * 6 * 6144);
  // A layer that the evaluation's images leave too small for the pooling is refused before the
  // ranks start, as the evaluation would refuse it.
  features.back() =
      "config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP=[[res5, [AvgPool2d, "
      "[[6, 6], 1, 0]]]]";
  try {
    swav::check_ranks_fit(config_of(features), small, 2, 2, false, false, 1 << 30);
    FAIL("a pooling window larger than its layer went through");
  } catch (const swav::ConfigError& e) {
    CHECK(std::string(e.what()).find("feature pooling: res5 is 1x1, smaller than AvgPool2d's 6x6 "
                                     "window") != std::string::npos);
  }
}

TEST_CASE("processes launched side by side agree on how the checks ended: one stops all") {
  // Ranks 2 and 3 of 4 refuse, rank 1 fails otherwise: rank 1's exception is rethrown there,
  // every other rank names it; none goes on.
  std::mutex lock;
  std::vector<std::string> said(4);
  const auto run = [&](int failing, int refusing_from) {
    sk::comm::run_ranks(4, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
      std::string what;
      try {
        swav::agreed(ctx, comm, [&] {
          if (comm.rank() == failing)
            throw sk::IoError("rank " + std::to_string(failing) + " failed");
          if (comm.rank() >= refusing_from)
            throw swav::ConfigError("rank " + std::to_string(comm.rank()) + "'s own refusal");
          return 7;
        });
        what = "went on";
      } catch (const swav::StoppedElsewhere& e) {
        what = std::string("elsewhere: ") + e.what() + " / " + std::to_string(e.stopped_rank);
      } catch (const std::exception& e) {
        what = e.what();
      }
      std::lock_guard guard(lock);
      said[static_cast<std::size_t>(comm.rank())] = what;
    });
  };
  run(1, 2);
  const std::string failed =
      "elsewhere: rank 1 failed before training (its message is in the job's output); no rank "
      "started / 1";
  CHECK(said == std::vector<std::string>{failed, "rank 1 failed", failed, failed});
  run(-1, 2);
  const std::string refused =
      "elsewhere: rank 2 refused the config (its message is in the job's output); no rank "
      "started / 2";
  CHECK(said == std::vector<std::string>{refused, refused, "rank 2's own refusal", refused});
  // None stops: each rank's own result.
  std::vector<int> results(3);
  sk::comm::run_ranks(3, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    const int r = swav::agreed(ctx, comm, [&] { return comm.rank() * 10; });
    std::lock_guard guard(lock);
    results[static_cast<std::size_t>(comm.rank())] = r;
  });
  CHECK(results == std::vector<int>{0, 10, 20});
  // Rank 0's values given to every rank (the others pass zeros, or anything); or its failure.
  std::vector<std::vector<double>> shared(3);
  sk::comm::run_ranks(3, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    const std::vector<double> mine{1.5 + comm.rank(), -2.25, 1e9};
    auto got = swav::from_rank0(ctx, comm, mine, nullptr);
    std::lock_guard guard(lock);
    shared[static_cast<std::size_t>(comm.rank())] = got;
  });
  for (const auto& values : shared) CHECK(values == std::vector<double>{1.5, -2.25, 1e9});
  std::vector<std::string> outcome(3);
  sk::comm::run_ranks(3, [&](sk::Context& ctx, sk::comm::Communicator& comm) {
    std::string what = "shared";
    try {
      const auto failed = comm.rank() == 0 ? std::make_exception_ptr(swav::ConfigError("too big"))
                                           : std::exception_ptr();
      swav::from_rank0(ctx, comm, {1, 2, 3}, failed);
    } catch (const swav::StoppedElsewhere& e) {
      what = "elsewhere " + std::to_string(e.stopped_rank);
    } catch (const swav::ConfigError& e) {
      what = e.what();
    }
    std::lock_guard guard(lock);
    outcome[static_cast<std::size_t>(comm.rank())] = what;
  });
  CHECK(outcome == std::vector<std::string>{"too big", "elsewhere 0", "elsewhere 0"});
}

TEST_CASE("the raw-pixel kNN's memory bank is made once per process and goes with its last user") {
  swav::Datasets data;
  int made = 0;
  const auto make = [&] {
    ++made;
    return std::vector<float>(16, 1.0f);
  };
  auto first = data.raw_bank->get(make);
  swav::Datasets copy = data;  // (the ranks' view of the same data)
  auto second = copy.raw_bank->get(make);
  CHECK(made == 1);
  CHECK(first.get() == second.get());
  first.reset();
  CHECK(data.raw_bank->get(make).get() == second.get());
  second.reset();
  CHECK(made == 1);
  CHECK(data.raw_bank->values.expired());  // the last user let go: the floats are freed
  CHECK(data.raw_bank->get(make)->size() == 16);
  CHECK(made == 2);
}

TEST_CASE("before the ranks start: each CPU rank's step, measured, against the host memory") {
  // Two ranks of 32 images each; the step as measured: 10 MB + 2 MB an image (74 MB a rank).
  const auto c =
      config_of({"config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=32", "config.TEST_MODEL=False"});
  swav::Datasets data;
  data.train = random_images(100, 8);
  int measured = 0;
  const swav::StepMeasure measure = [&] {
    ++measured;
    return sk::parallel::ActivationProfile{.fixed_bytes = 10e6, .bytes_per_sample = 2e6};
  };
  const swav::HostMemoryNeed enough =
      swav::check_ranks_fit(c, data, 2, 2, true, false, std::int64_t{4} << 30, measure);
  CHECK(measured == 1);
  CHECK(enough.step_per_rank == 74'000'000);
  CHECK(enough.states_per_rank_max > 0);
  const std::int64_t states = enough.local_states;

  // The ranks may take nine tenths of what is available: room for the states and 100 MB, one
  // rank's step and not two. A batch of (100 MB / 2 - 10 MB) / 2 MB fits.
  const std::int64_t available = (states + 100'000'000) * 10 / 9 + 1;
  try {
    swav::check_ranks_fit(c, data, 2, 2, true, false, available, measure);
    FAIL("the ranks' steps were not checked");
  } catch (const swav::ConfigError& e) {
    const std::string text = e.what();
    CHECK(text.find("config.DATA.TRAIN.BATCHSIZE_PER_REPLICA = 32: 2 ranks as threads of this "
                    "process would hold about") == 0);
    CHECK(text.find("74.0 MB of activations and scratch at 32 images (measured here on a step of "
                    "a few: 10.0 MB + 2.0 MB an image)") != std::string::npos);
    CHECK(text.find("use a batch of at most 20, ") != std::string::npos);
    CHECK(text.find("run at most 1 here (NUM_NODES=1, NUM_PROC_PER_NODE=1), checkpoint the "
                    "activations (MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING), "
                    "or spread the ranks") != std::string::npos);
  }
  CHECK(measured == 2);
  // Under activation checkpointing that is not suggested again; launched processes are told to
  // start fewer.
  const auto checkpointed =
      config_of({"config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=32", "config.TEST_MODEL=False",
                 "config.MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING=True"});
  try {
    swav::check_ranks_fit(checkpointed, data, 2, 2, true, true, available, measure);
    FAIL("the ranks' steps were not checked");
  } catch (const swav::ConfigError& e) {
    const std::string text = e.what();
    CHECK(text.find("2 ranks launched on this machine") != std::string::npos);
    CHECK(text.find("start fewer processes on this machine, or spread") != std::string::npos);
    CHECK(text.find("USE_ACTIVATION_CHECKPOINTING") == std::string::npos);
  }
  // Not measured where it would tell nothing: a GPU's ranks, states that do not fit already,
  // a batch the images cannot give, an unknown figure.
  measured = 0;
  CHECK(swav::check_ranks_fit(c, data, 2, 2, false, false, available, measure).step_per_rank == 0);
  CHECK_THROWS_AS(swav::check_ranks_fit(c, data, 2, 2, true, false, states / 2, measure),
                  swav::ConfigError);
  const auto big =
      config_of({"config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=64", "config.TEST_MODEL=False"});
  CHECK_THROWS_AS(swav::check_ranks_fit(big, data, 2, 2, true, false, available, measure),
                  swav::ConfigError);
  CHECK(swav::check_ranks_fit(c, data, 2, 2, true, false, -1, measure).step_per_rank == 0);
  CHECK(measured == 0);
}

TEST_CASE("config: VISSL's frozen-parameter names, FSDP's wrapped form included") {
  const std::string plain = "'module.heads.0.prototypes0.weight'";
  const std::string wrapped =
      "'_fsdp_wrapped_module.heads.0._fsdp_wrapped_module._fpw_module.prototypes0."
      "_fsdp_wrapped_module.weight'";
  const auto frozen = [](const std::string& map) {
    return config_of({"config.OPTIMIZER.use_larc=True",
                      "config.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP=" + map})
        .frozen;
  };
  using Frozen = std::vector<std::pair<std::string, std::int64_t>>;
  const Frozen prototypes_313{{"heads.0.prototypes0.weight", 313}};
  // VISSL's own SwAV configs list both forms; the plain one's count holds, in either order.
  CHECK(frozen("[[" + plain + ", 313], [" + wrapped + ", 100]]") == prototypes_313);
  CHECK(frozen("[[" + wrapped + ", 100], [" + plain + ", 313]]") == prototypes_313);
  // The wrapped form alone names the parameter; a name given twice takes the later count.
  CHECK(frozen("[[" + wrapped + ", 100]]") == Frozen{{"heads.0.prototypes0.weight", 100}});
  CHECK(frozen("[[" + plain + ", 100], [" + plain + ", 313]]") == prototypes_313);
  CHECK(frozen("[['trunk.conv1.weight', 5], [" + plain + ", 313]]") ==
        Frozen{{"trunk.conv1.weight", 5}, {"heads.0.prototypes0.weight", 313}});
  // Of the forms, the one VISSL matches holds: module.NAME, then NAME, then the wrapped one.
  CHECK(frozen("[[" + plain + ", 313], ['heads.0.prototypes0.weight', 100]]") == prototypes_313);
  CHECK(frozen("[['heads.0.prototypes0.weight', 313], [" + wrapped + ", 100]]") == prototypes_313);

  // The names against the network's, all of them in one refusal, with the nearest when close.
  const std::vector<std::string> parameters{"trunk.conv1.weight", "heads.0.prototypes0.weight"};
  CHECK_NOTHROW(swav::check_frozen_names(parameters, prototypes_313));
  CHECK_THROWS_WITH_AS(
      swav::check_frozen_names(parameters, {{"heads.0.prototype0.weight", 3},
                                            {"heads.0.prototypes0.weight", 3},
                                            {"trunk.fc.bias", 3}}),
      doctest::Contains("names 'module.heads.0.prototype0.weight' (the nearest is "
                        "'module.heads.0.prototypes0.weight'), 'module.trunk.fc.bias', which "
                        "this network has no parameter of"),
      swav::ConfigError);
}

TEST_CASE("the data's problems: probed with the config, and all of them once loaded") {
  namespace fs = std::filesystem;
  const TempDir temp("shardkit_swav_datasets_");
  const fs::path& root = temp.path;
  // Two classes of three 8 x 8 images: RGB (PPM) or grey (PGM); one file that is no image.
  const auto folder = [&](const std::string& name, bool rgb) {
    for (int c = 0; c < 2; ++c) {
      const fs::path dir = root / name / ("class" + std::to_string(c));
      fs::create_directories(dir);
      for (int i = 0; i < 3; ++i) {
        std::ofstream out(dir / (std::to_string(i) + (rgb ? ".ppm" : ".pgm")), std::ios::binary);
        out << (rgb ? "P6" : "P5") << "\n8 8\n255\n";
        for (int b = 0; b < 64 * (rgb ? 3 : 1); ++b)
          out.put(static_cast<char>(37 * b + 11 * i + c));
      }
    }
    return (root / name).string();
  };
  const std::string rgb = folder("rgb", true), grey = folder("grey", false);
  const std::string corrupt = folder("corrupt", false);
  std::ofstream(root / "corrupt" / "class0" / "bad.png") << "not a PNG";
  fs::create_directories(root / "empty");
  const std::string empty = (root / "empty").string(), missing = (root / "missing").string();

  swav::DataSource source;
  source.kind = "synthetic";
  CHECK(swav::probe_split(source, "DATA.TRAIN") == 3);
  source.kind = "fashion_mnist";
  source.path = empty;  // no .gz files: the test split's file is named
  const std::string no_gz = "config.DATA.TEST.DATA_PATHS = [" + empty + "]: Fashion-MNIST file '" +
                            empty + "/t10k-images-idx3-ubyte.gz' is missing";
  CHECK_THROWS_WITH_AS(swav::probe_split(source, "DATA.TEST"), doctest::Contains(no_gz.c_str()),
                       swav::ConfigError);
  source.kind = "disk_folder";
  source.path = missing;
#if SHARDKIT_WITH_IMAGES
  const std::string no_folder =
      "config.DATA.TRAIN.DATA_PATHS = [" + missing + "]: image folder '" + missing + "'";
  CHECK_THROWS_WITH_AS(swav::probe_split(source, "DATA.TRAIN"),
                       doctest::Contains(no_folder.c_str()), swav::ConfigError);
  source.path = empty;
  CHECK_THROWS_AS(swav::probe_split(source, "DATA.TRAIN"), swav::ConfigError);
  source.path = rgb;
  CHECK(swav::probe_split(source, "DATA.TRAIN") == 0);  // known once decoded

  const auto folders = [&](const std::string& train, const std::string& test) {
    return config_of({"config.DATA.TRAIN.DATA_SOURCES=[disk_folder]",
                      "config.DATA.TRAIN.DATA_PATHS=[" + train + "]",
                      "config.DATA.TEST.DATA_SOURCES=[disk_folder]",
                      "config.DATA.TEST.DATA_PATHS=[" + test + "]"});
  };
  // RGB training images against grey test images and the default one-channel Normalize.
  auto mixed = folders(rgb, grey);
  try {
    (void)swav::load_datasets(mixed);
    FAIL("RGB against grey images was not refused");
  } catch (const swav::ConfigError& e) {
    check_problems(e.what(), 2,
                   {"DATA.TRAIN's images have 3 channels and DATA.TEST's 1",
                    "DATA.TRAIN.TRANSFORMS' Normalize has 1 mean/std entries but the images "
                    "have 3 channels"});
  }
  // A file that does not decode, and a test folder without images: both said.
  auto broken = folders(corrupt, empty);
  try {
    (void)swav::load_datasets(broken);
    FAIL("a corrupt image and an empty folder were not refused");
  } catch (const swav::ConfigError& e) {
    check_problems(e.what(), 2, {"bad.png", "image folder '" + empty + "'"});
  }
  // A test folder whose classes are not the training folder's: kNN compares labels, which are
  // the classes' places, so the test images of "class2" carried class1's label.
  const auto other_classes = [&] {
    for (const std::string name : {"class0", "class2"}) {
      fs::create_directories(root / "other" / name);
      fs::copy_file(root / "grey" / "class0" / "0.pgm", root / "other" / name / "0.pgm");
    }
    return (root / "other").string();
  }();
  auto shifted = folders(grey, other_classes);
  CHECK_THROWS_WITH_AS(swav::load_datasets(shifted),
                       doctest::Contains("the splits' classes differ: DATA.TRAIN has 2, DATA.TEST "
                                         "2, and their class 2 is 'class1' in DATA.TRAIN, "
                                         "'class2' in DATA.TEST"),
                       swav::ConfigError);
  auto good = folders(grey, grey);
  const auto data = swav::load_datasets(good);
  CHECK(data.train.count == 6);
  CHECK(good.in_channels == 1);
  // A folder beyond the memory its images may take: refused with the DATA_LIMIT that fits (six
  // RGB 8 x 8 images, 192 bytes each, twice that while packed: two fit in 1000 bytes).
  source.path = rgb;
  CHECK_THROWS_WITH_AS(swav::load_split(source, "DATA.TRAIN", 0, 1000),
                       doctest::Contains(("config.DATA.TRAIN.DATA_LIMIT = -1: image folder '" +
                                          rgb + "': its 6 images would take")
                                             .c_str()),
                       swav::ConfigError);
  CHECK_THROWS_WITH_AS(swav::load_split(source, "DATA.TRAIN", 0, 1000),
                       doctest::Contains("; set DATA_LIMIT to at most 2 (a random subset"),
                       swav::ConfigError);
  CHECK_THROWS_WITH_AS(swav::load_split(source, "DATA.TRAIN", 0, 100),
                       doctest::Contains("; use a machine with more memory"), swav::ConfigError);
  source.limit = 2;
  CHECK(swav::load_split(source, "DATA.TRAIN", 0, 1000).count == 2);
  // Under TEST_MODEL: False DATA.TEST is not read: a missing test folder is no problem.
  auto untested =
      config_of({"config.TEST_MODEL=False", "config.DATA.TRAIN.DATA_SOURCES=[disk_folder]",
                 "config.DATA.TRAIN.DATA_PATHS=[" + rgb + "]",
                 "config.DATA.TRAIN.TRANSFORMS=[{name: ImgPilToMultiCrop, "
                 "total_num_crops: 2, size_crops: [8], num_crops: [2], crop_scales: [[0.5, 1]]}, "
                 "{name: ToTensor}, {name: Normalize, mean: [0.5, 0.5, 0.5], "
                 "std: [0.2, 0.2, 0.2]}]",
                 "config.DATA.TEST.DATA_SOURCES=[disk_folder]",
                 "config.DATA.TEST.DATA_PATHS=[" + missing + "]"});
  const auto train_only = swav::load_datasets(untested);
  CHECK(train_only.train.count == 6);
  CHECK(untested.in_channels == 3);
  CHECK(train_only.test.count == 0);
  CHECK(train_only.description.find("; not tested (TEST_MODEL: False") != std::string::npos);
#else
  CHECK_THROWS_WITH_AS(swav::probe_split(source, "DATA.TRAIN"),
                       doctest::Contains("this build has no image decoders"), swav::ConfigError);
#endif
}

TEST_CASE("VISSL's command line: config names, +config/GROUP=NAME, +config.KEY, hydra.*") {
  namespace fs = std::filesystem;
  const TempDir temp("shardkit_swav_command_line_");
  const fs::path& root = temp.path;
  const auto write = [&](const fs::path& relative, const std::string& yaml) {
    fs::create_directories((root / relative).parent_path());
    std::ofstream(root / relative) << yaml;
  };
  // A VISSL checkout's layout (configs/config/...) and a folder of shipped configs; a decoy
  // group file in the working directory, which a group's lookup must not take.
  write("configs/config/pretrain/swav/main.yaml",
        "# @package _global_\nconfig:\n  MODEL:\n    TRUNK:\n      RESNETS:\n        DEPTH: 50\n"
        "  OPTIMIZER:\n    num_epochs: 7\n");
  write("configs/config/pretrain/swav/models/small.yaml",
        "# @package _global_\nconfig:\n  MODEL:\n    TRUNK:\n      RESNETS:\n        DEPTH: 18\n");
  write("pretrain/swav/models/small.yaml", "config:\n  LOG_FREQUENCY: 99\n");
  write("shipped/quick.yaml", "config:\n  LOG_FREQUENCY: 3\n");
  const std::vector<fs::path> roots{root, root / "configs/config", root / "shipped"};
  const std::string main = (root / "configs/config/pretrain/swav/main.yaml").string();
  const std::string small = (root / "configs/config/pretrain/swav/models/small.yaml").string();

  CHECK(swav::find_config("pretrain/swav/main", roots) == main);
  CHECK(swav::find_config("pretrain/swav/main.yaml", roots) == main);
  CHECK(swav::find_config("configs/config/pretrain/swav/main", roots) == main);
  CHECK(swav::find_config("quick", roots) == (root / "shipped/quick.yaml").string());
  CHECK(swav::find_config(main, roots) == main);
  const std::string looked = "config file 'pretrain/swav/nothing' not found (looked for " +
                             (root / "pretrain/swav/nothing").string() + "[.yaml], " +
                             (root / "configs/config/pretrain/swav/nothing").string();
  CHECK_THROWS_WITH_AS(swav::find_config("pretrain/swav/nothing", roots),
                       doctest::Contains(looked.c_str()), swav::ConfigError);
  const std::string absent = (root / "absent.yaml").string();
  const std::string looked_once = "(looked for " + absent + "[.yaml]); pass";
  CHECK_THROWS_WITH_AS(swav::find_config(absent, roots), doctest::Contains(looked_once.c_str()),
                       swav::ConfigError);

  // The group's file composes after the config, wherever it stands on the line; Hydra's + and
  // ++ forms are overrides; Hydra's own settings are listed.
  const auto line = swav::read_command_line(
      {"+config/pretrain/swav/models=small", "config=pretrain/swav/main",
       "config.OPTIMIZER.num_epochs=2", "+config.LOG_FREQUENCY=5", "++config.SEED_VALUE=4",
       "hydra.verbose=true", "+hydra.run.dir=/tmp/x", "hydra/job_logging=disabled"},
      roots);
  CHECK(line.problems.empty());
  CHECK(line.files == std::vector<std::string>{main, small});
  CHECK(line.overrides == std::vector<std::string>{"config.OPTIMIZER.num_epochs=2",
                                                   "config.LOG_FREQUENCY=5",
                                                   "config.SEED_VALUE=4"});
  CHECK(line.hydra ==
        std::vector<std::string>{"hydra.verbose", "hydra.run.dir", "hydra/job_logging"});
  // The line's problems, all of them, for the config's report.
  const auto bad =
      swav::read_command_line({"+config/pretrain/swav/models", "+config/=small",
                               "+config/pretrain/swav/models=", "+config/pretrain/swav/models=big",
                               "config=", "config=pretrain/swav/main"},
                              roots);
  REQUIRE(bad.problems.size() == 5);
  CHECK(bad.problems[0].find("is not a config group override") != std::string::npos);
  CHECK(bad.problems[1].find("'+config/=small' is not a config group override") !=
        std::string::npos);
  CHECK(bad.problems[2].find("is not a config group override") != std::string::npos);
  CHECK(bad.problems[3].find("'pretrain/swav/models/big' not found") != std::string::npos);
  CHECK(bad.problems[4] == "'config=' names no file; pass config=PATH to a YAML file");
  CHECK(bad.files == std::vector<std::string>{main});

  swav::ConfigTree tree(swav::kDefaultsYaml);
  for (const auto& file : line.files) tree.merge_file(file);
  for (const auto& o : line.overrides) tree.apply_override(o);
  for (const auto& setting : line.hydra) tree.ignore(setting);
  CHECK(tree.get<int>("MODEL.TRUNK.RESNETS.DEPTH") == 18);
  CHECK(tree.get<int>("OPTIMIZER.num_epochs") == 2);
  CHECK(tree.get<int>("LOG_FREQUENCY") == 5);
  CHECK(std::find(tree.ignored().begin(), tree.ignored().end(), "hydra.verbose") !=
        tree.ignored().end());
  // A line's problem and an override that is none join the config's report.
  swav::ConfigTree reported(swav::kDefaultsYaml);
  for (const auto& problem : bad.problems) reported.add_problem(problem);
  reported.apply_override("OPTIMIZER.num_epochs=2");
  check_problems(config_problems(reported), 6,
                 {"'config=' names no file",
                  "6. argument 'OPTIMIZER.num_epochs=2' is not an "
                  "override"});

  // The real roots, relative to the working directory (a VISSL checkout's).
  const WorkingDirectory in_root(root);
  const auto real = swav::config_roots(root / "shipped");
  CHECK(swav::find_config("pretrain/swav/main", real) == "configs/config/pretrain/swav/main.yaml");
  CHECK(swav::find_config("quick", real) == (root / "shipped/quick.yaml").string());
  CHECK(swav::read_command_line({"+config/pretrain/swav/models=small"}, real).files ==
        std::vector<std::string>{"configs/config/pretrain/swav/models/small.yaml"});
}

TEST_CASE("kNN evaluation images: DATA.TEST.TRANSFORMS' Resize, CenterCrop and Normalize") {
  const auto data = random_images(2, 28);
  const swav::MultiCropConfig crops;  // large crops of 24 pixels
  // The default (an empty list): the whole image at the large crops' side, normalised like them.
  const auto plain = config_of({});
  CHECK_FALSE(plain.eval_images.configured);
  CHECK(plain.eval_images.side(28, 28, 24) == 24);
  std::vector<float> a(24 * 24), b(24 * 24);
  swav::eval_image(crops, plain.eval_images, data.image(1), 24, a.data());
  swav::whole_image(crops, data.image(1), 24, b.data());
  CHECK(a == b);
  // Resize 28 + CenterCrop 28 of a 28-pixel image: its pixels as stored, normalised.
  const auto native = config_of({"config.DATA.TEST.TRANSFORMS=[{name: Resize, size: 28}, "
                                 "{name: CenterCrop, size: 28}, {name: ToTensor}, "
                                 "{name: Normalize, mean: [0.5], std: [0.25]}]"})
                          .eval_images;
  CHECK(native.configured);
  CHECK(native.side(28, 28, 24) == 28);
  std::vector<float> whole(28 * 28);
  swav::eval_image(crops, native, data.image(1), 28, whole.data());
  double worst = 0;
  for (int i = 0; i < 28 * 28; ++i)
    worst = std::max(worst, std::abs(whole[i] - (data.image(1).pixels[i] / 255.0 - 0.5) / 0.25));
  CHECK(worst < 1e-5);
  // Resize 32 then CenterCrop 28 keep the middle 24.5 stored pixels: the centred 25-pixel box,
  // resampled once to 28.
  const auto zoom = config_of({"config.DATA.TEST.TRANSFORMS=[{name: Resize, size: 32}, "
                               "{name: CenterCrop, size: 28}]"})
                        .eval_images;
  const swav::CropBox box = zoom.box(28, 28);
  CHECK(box.height == 25);
  CHECK(box.width == 25);
  CHECK(box.top == 2);
  CHECK(box.left == 2);
  std::vector<float> zoomed(28 * 28), expected(28 * 28);
  swav::eval_image(crops, zoom, data.image(0), 28, zoomed.data());  // no Normalize: [0, 1]
  swav::resize_box(data.image(0), box, 28, expected.data());
  CHECK(zoomed == expected);
  // An oblong image: the shorter side to 10 (scale 1/2), then the middle 8 x 8 of that.
  swav::EvalTransform oblong;
  oblong.configured = true;
  oblong.resize = 10;
  oblong.crop = 8;
  const swav::CropBox o = oblong.box(20, 30);
  CHECK(o.height == 16);
  CHECK(o.width == 16);
  CHECK(o.top == 2);
  CHECK(o.left == 7);
  CHECK(oblong.side(20, 30, 24) == 8);
  // What cannot be done is refused by name, with the fix.
  oblong.crop = 0;
  CHECK_THROWS_WITH(oblong.side(20, 30, 24), doctest::Contains("add {name: CenterCrop"));
  oblong.crop = 12;
  CHECK_THROWS_WITH(oblong.box(20, 30),
                    doctest::Contains("CenterCrop 12 is larger than the shorter side of the "
                                      "resized image (10 of a 20 x 30 image)"));
  CHECK_THROWS_WITH(config_of({"config.DATA.TEST.TRANSFORMS=[{name: RandomResizedCrop, size: 8}]"}),
                    doctest::Contains("not an evaluation transform this trainer implements; use "
                                      "Resize, CenterCrop, ToTensor, Normalize"));
  CHECK_THROWS_WITH(config_of({"config.DATA.TEST.TRANSFORMS=[{name: CenterCrop, size: 24}, "
                               "{name: Resize, size: 28}]"}),
                    doctest::Contains("list Resize first"));
  CHECK_THROWS_WITH(config_of({"config.DATA.TEST.TRANSFORMS=[{name: Resize, size: [28, 20]}]"}),
                    doctest::Contains("DATA.TEST.TRANSFORMS[0].size = [28, 20]: must be one whole "
                                      "number of pixels"));
  CHECK_THROWS_WITH(config_of({"config.DATA.TEST.TRANSFORMS=[{name: CenterCrop, size: 0}]"}),
                    doctest::Contains("must be >= 1"));
  CHECK_THROWS_WITH(config_of({"config.DATA.TEST.TRANSFORMS=[{name: Normalize, mean: [0.1, 0.2], "
                               "std: [0.3, 0.4]}]"}),
                    doctest::Contains("one mean and one std per channel"));
  CHECK_THROWS_WITH(config_of({"config.DATA.TEST.TRANSFORMS=[{name: CenterCrop, ratio: 2}]"}),
                    doctest::Contains("not a parameter of CenterCrop"));
}

TEST_CASE("config: VISSL keys, the seeds' snippets, overrides, and errors that name the fix") {
  using sk::parallel::Stage;
  const auto d = config_of({});
  CHECK(d.parallel.stage == Stage::ddp);
  // MACHINE.CUDA_GRAPH: auto by default; a YAML boolean in any spelling; anything else named.
  CHECK(d.cuda_graph == "auto");
  CHECK(config_of({"config.MACHINE.CUDA_GRAPH=True"}).cuda_graph == "true");
  CHECK(config_of({"config.MACHINE.CUDA_GRAPH=off"}).cuda_graph == "false");
  CHECK_THROWS_WITH(config_of({"config.MACHINE.CUDA_GRAPH=sometimes"}),
                    doctest::Contains("use true, false or auto"));
  CHECK(d.loss.num_crops == 6);
  // What a VISSL config leaves out means what it means in VISSL: a ResNet-50 of 64 base
  // channels with ImageNet's stem, plain SGD with VISSL's decay, none on batch-norm parameters.
  CHECK(d.optimizer.kind == sk::optim::OptimizerKind::sgd);
  CHECK(d.optimizer.sgd.weight_decay == doctest::Approx(1e-4));
  CHECK_FALSE(d.regularize_bn);
  CHECK(d.regularize_bias);
  CHECK(d.base_channels == 64);
  CHECK(d.depth == 50);
  CHECK_FALSE(d.small_image_stem);
  CHECK(d.head_in == 2048);
  CHECK(d.head_hidden == std::vector<std::int64_t>{2048});
  CHECK(d.embedding_dim == 128);
  CHECK(d.prototypes == 3000);
  // The ZeRO snippet (OPTIMIZER.name zero with a nested base optimizer), under `config:`.
  const auto zero = config_of({}, R"(config:
  OPTIMIZER:
    name: zero
    base_optimizer:
      name: sgd
      use_larc: False
      larc_config:
        clip: False
        trust_coefficient: 0.001
        eps: 0.00000001
      weight_decay: 0.000001
      momentum: 0.9
      nesterov: False
)");
  CHECK(zero.parallel.stage == Stage::oss);
  CHECK(zero.optimizer.kind == sk::optim::OptimizerKind::sgd);
  CHECK(zero.optimizer.sgd.weight_decay == doctest::Approx(1e-6));
  // AMP, LARC, the stateful sampler and activation checkpointing snippets.
  const auto amp = config_of({}, R"(
MODEL:
  AMP_PARAMS:
    USE_AMP: True
    AMP_ARGS: {"opt_level": "O1"}
  ACTIVATION_CHECKPOINTING:
    USE_ACTIVATION_CHECKPOINTING: True
    NUM_ACTIVATION_CHECKPOINTING_SPLITS: 8
DISTRIBUTED:
  MANUAL_GRADIENT_REDUCTION: True
DATA:
  TRAIN:
    USE_STATEFUL_DISTRIBUTED_SAMPLER: True
  TEST:
    USE_STATEFUL_DISTRIBUTED_SAMPLER: True
OPTIMIZER:
  name: "sgd"
  use_larc: True
  larc_config:
    clip: False
    eps: 1e-08
    trust_coefficient: 0.001
)");
  CHECK(amp.parallel.precision.param_dtype == sk::DType::f16);
  CHECK(amp.loss_scaling);
  CHECK(amp.checkpoint_splits == 8);
  CHECK(amp.optimizer.larc.trust_coefficient == doctest::Approx(0.001));
  // Stages from VISSL's switches, overrides in VISSL's form.
  CHECK(config_of({"config.OPTIMIZER.use_zero=True"}).parallel.stage == Stage::oss);
  CHECK(config_of({"config.MODEL.SHARDED_DDP_SETUP.USE_SDP=True"}).parallel.stage == Stage::sdp);
  CHECK(config_of({"config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True"}).parallel.stage == Stage::fsdp);
  CHECK(config_of({"config.OPTIMIZER.num_epochs=3"}).num_epochs == 3);
  CHECK(config_of({"config.LOSS.swav_loss.crops_for_assign=[0]"}).loss.crops_for_assign ==
        std::vector<int>{0});
  // Queue: VISSL's rounding to the global batch (2 ranks x 32).
  const auto q = config_of({"config.LOSS.swav_loss.queue.queue_length=300"});
  CHECK(q.queue_length == 256);
  CHECK(q.loss.local_queue_length == 128);
  // SyncBatchNorm groups by VISSL's GROUP_SIZE rule (world 4, 2 ranks per node).
  auto sync_group = [](const std::string& size) {
    return config_of({"config.MODEL.SYNC_BN_CONFIG.CONVERT_BN_TO_SYNC_BN=True",
                      "config.MODEL.SYNC_BN_CONFIG.GROUP_SIZE=" + size,
                      "config.DISTRIBUTED.NUM_PROC_PER_NODE=2"},
                     "", 4)
        .sync_bn_group;
  };
  CHECK(sync_group("-1") == 2);
  CHECK(sync_group("0") == 4);
  CHECK(sync_group("3") == 3);
  CHECK(config_of({}).sync_bn_group == 0);
  CHECK_THROWS_WITH(sync_group("-2"), doctest::Contains("GROUP_SIZE = -2"));
  // Checkpointing asked for with no segment, and the loss's settings: refused while the config
  // is read, by key, not at the first step (or, for 0 splits, never).
  CHECK_THROWS_WITH(
      config_of({"config.MODEL.ACTIVATION_CHECKPOINTING.USE_ACTIVATION_CHECKPOINTING=True",
                 "config.MODEL.ACTIVATION_CHECKPOINTING.NUM_ACTIVATION_CHECKPOINTING_SPLITS=0"}),
      doctest::Contains("NUM_ACTIVATION_CHECKPOINTING_SPLITS = 0: USE_ACTIVATION_CHECKPOINTING "
                        "is True"));
  CHECK(config_of({"config.MODEL.ACTIVATION_CHECKPOINTING.NUM_ACTIVATION_CHECKPOINTING_SPLITS=0"})
            .checkpoint_splits == 0);  // (checkpointing off: the count is not used)
  for (const auto& [key, message] : std::vector<std::pair<std::string, std::string>>{
           {"epsilon=0", "config.LOSS.swav_loss.epsilon = 0: a positive number"},
           {"epsilon=.nan", "config.LOSS.swav_loss.epsilon = nan: a positive number"},
           {"temperature=-0.1", "config.LOSS.swav_loss.temperature = -0.1: a positive number"},
           {"num_iters=0", "config.LOSS.swav_loss.num_iters = 0: at least 1"},
           {"crops_for_assign=[0,6]",
            "config.LOSS.swav_loss.crops_for_assign = 6: a crop index "
            "in [0, 6)"},
           {"crops_for_assign=[]", "config.LOSS.swav_loss.crops_for_assign = []"},
           {"temp_hard_assignment_iters=-1", "temp_hard_assignment_iters = -1: 0 or more"}}) {
    CAPTURE(key);
    CHECK_THROWS_WITH(config_of({"config.LOSS.swav_loss." + key}),
                      doctest::Contains(message.c_str()));
  }
  // VISSL's 0 workers (load in the main process): one loader thread here.
  CHECK(config_of({"config.DATA.NUM_DATALOADER_WORKERS=0"}).workers == 1);
  CHECK_THROWS_WITH(config_of({"config.DATA.NUM_DATALOADER_WORKERS=-1"}),
                    doctest::Contains("NUM_DATALOADER_WORKERS = -1: 0 or more"));
  // VISSL's regularize_bn / regularize_bias (parameter groups without weight decay), each
  // overridden against its default.
  const auto groups =
      config_of({"config.OPTIMIZER.regularize_bn=True", "config.OPTIMIZER.regularize_bias=False"});
  CHECK(groups.regularize_bn);
  CHECK_FALSE(groups.regularize_bias);
  // Errors name the key, the value and the fix.
  CHECK_THROWS_WITH(config_of({"config.OPTIMIZER.num_epoch=2"}),
                    doctest::Contains("unknown config key config.OPTIMIZER.num_epoch (= 2); the "
                                      "nearest valid key is config.OPTIMIZER.num_epochs"));
  CHECK_THROWS_WITH(config_of({"config.OPTIMIZER.num_epochs=two"}),
                    doctest::Contains("config.OPTIMIZER.num_epochs = two is a string; it must be "
                                      "an integer"));
  CHECK_THROWS_WITH(config_of({"config.OPTIMIZER.use_larc=1.5"}),
                    doctest::Contains("must be a boolean"));
  CHECK_THROWS_WITH(config_of({"OPTIMIZER.num_epochs=2"}), doctest::Contains("not an override"));
  // Free-form parts (the head's parameters, schedules, the frozen map) with values of the wrong
  // type: a ConfigError naming the key, never yaml-cpp's own exception (a fuzzer finding).
  CHECK_THROWS_WITH_AS(
      config_of({R"(config.MODEL.HEAD.PARAMS=[["swav_head", {"dims": [128, "x", 32]}]])"}),
      doctest::Contains("config.MODEL.HEAD.PARAMS[0][1].dims = [128, x, 32]: must be a list"),
      swav::ConfigError);
  // A map as a key (YAML's `? key` form): a ConfigError, not yaml-cpp's exception (a finding of
  // the ten-minute fuzzing run).
  CHECK_THROWS_WITH_AS(config_of({}, "config:\n ? DISTRIBUTED:\n    NUM_NODES: 2\n"),
                       doctest::Contains("is not a name; config keys are names"),
                       swav::ConfigError);
  CHECK_THROWS_WITH_AS(config_of({"config.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP=[[a, b]]"}),
                       doctest::Contains("config.MODEL.TEMP_FROZEN_PARAMS_ITER_MAP = b"),
                       swav::ConfigError);
  CHECK_THROWS_WITH(config_of({"config.MODEL.AMP_PARAMS.AMP_ARGS={\"opt_level\": \"O3\"}",
                               "config.MODEL.AMP_PARAMS.USE_AMP=True"}),
                    doctest::Contains("O3 keeps no f32 masters"));
  CHECK_THROWS_WITH(config_of({"config.MODEL.HEAD.PARAMS=[[\"swav_head\", {\"dims\": [64, 128, "
                               "64], \"use_bn\": True, \"num_clusters\": [100]}]]"}),
                    doctest::Contains("this trunk gives 2048 features"));
  CHECK_THROWS_WITH(config_of({"config.DATA.TRAIN.TRANSFORMS=[{name: RandomCrop}]"}),
                    doctest::Contains("not a transform this trainer implements"));
  CHECK_THROWS_WITH(config_of({"config.MODEL.SHARDED_DDP_SETUP.USE_SDP=True",
                               "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True"}),
                    doctest::Contains("not both"));
  // CPU offload through FairScale's FSDP keys.
  const auto grads = config_of({"config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
                                "config.MODEL.FSDP_CONFIG.move_grads_to_cpu=True"});
  CHECK(grads.parallel.offload.optimizer);
  CHECK_FALSE(grads.parallel.offload.params);
  const auto params = config_of({"config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
                                 "config.MODEL.FSDP_CONFIG.move_params_to_cpu=True"});
  CHECK(params.parallel.offload.optimizer);
  CHECK(params.parallel.offload.params);
  CHECK_FALSE(config_of({}).parallel.offload.enabled());
  CHECK_THROWS_WITH(config_of({"config.MODEL.FSDP_CONFIG.move_params_to_cpu=True"}),
                    doctest::Contains("config.MODEL.FSDP_CONFIG.move_params_to_cpu = True: CPU "
                                      "offload is an FSDP setting"));
  // qwZ's int8 gathers: an FSDP key of ours.
  const auto quantized = config_of({"config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
                                    "config.MODEL.FSDP_CONFIG.quantized_weights=True",
                                    "config.MODEL.FSDP_CONFIG.quantization_block=64"});
  CHECK(quantized.parallel.fsdp.quantized_weights);
  CHECK(quantized.parallel.fsdp.quantization_block == 64);
  CHECK_FALSE(config_of({}).parallel.fsdp.quantized_weights);
  CHECK_THROWS_WITH(config_of({"config.MODEL.FSDP_CONFIG.quantized_weights=True"}),
                    doctest::Contains("quantised collectives are an FSDP setting"));
  // qgZ's int8 gradient reductions, with error feedback.
  const auto int8_grads = config_of({"config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
                                     "config.MODEL.FSDP_CONFIG.quantized_grads=True",
                                     "config.MODEL.FSDP_CONFIG.grad_error_feedback=True"});
  CHECK(int8_grads.parallel.fsdp.quantized_grads);
  CHECK(int8_grads.parallel.fsdp.grad_error_feedback);
  CHECK_FALSE(int8_grads.parallel.fsdp.quantized_weights);
  CHECK_THROWS_WITH(config_of({"config.MODEL.FSDP_CONFIG.quantized_grads=True"}),
                    doctest::Contains("config.MODEL.FSDP_CONFIG.quantized_grads = True: "
                                      "quantised collectives are an FSDP setting"));
  CHECK_THROWS_WITH(config_of({"config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
                               "config.MODEL.FSDP_CONFIG.grad_error_feedback=True"}),
                    doctest::Contains("error feedback carries qgZ's rounding"));
  CHECK(config_of({"config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
                   "config.MODEL.FSDP_CONFIG.quantized_weights=True",
                   "config.MODEL.FSDP_CONFIG.quantized_weights_format=f8_e4m3"})
            .parallel.fsdp.quantized_weights_format == shardkit::ops::QuantFormat::f8_e4m3);
  CHECK_THROWS_WITH(
      config_of({"config.MODEL.FSDP_CONFIG.quantized_weights_format=int2"}),
      doctest::Contains("quantized_weights_format = int2: pass int8, f8_e4m3 or int4"));
  // FSDP2's float8 gather: E4M3 with a scale per tensor; refused for int8 codes.
  CHECK(config_of({"config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
                   "config.MODEL.FSDP_CONFIG.quantized_weights=True",
                   "config.MODEL.FSDP_CONFIG.quantized_weights_format=f8_e4m3",
                   "config.MODEL.FSDP_CONFIG.quantized_weights_scale=tensor"})
            .parallel.fsdp.quantized_weights_scale == shardkit::ops::QuantScale::tensor);
  CHECK_THROWS_WITH(config_of({"config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
                               "config.MODEL.FSDP_CONFIG.quantized_weights=True",
                               "config.MODEL.FSDP_CONFIG.quantized_weights_scale=tensor"}),
                    doctest::Contains("quantized_weights_scale = tensor: a scale per tensor is "
                                      "E4M3's"));
  CHECK_THROWS_WITH(config_of({"config.MODEL.FSDP_CONFIG.quantized_weights_scale=row"}),
                    doctest::Contains("quantized_weights_scale = row: pass block or tensor"));
  // qgZ at ZeRO++'s gradient width: int4 codes, two to a byte, so an even block.
  CHECK(config_of({"config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
                   "config.MODEL.FSDP_CONFIG.quantized_grads=True",
                   "config.MODEL.FSDP_CONFIG.quantized_grads_format=int4"})
            .parallel.fsdp.quantized_grads_format == shardkit::ops::QuantFormat::int4);
  CHECK_THROWS_WITH(config_of({"config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
                               "config.MODEL.FSDP_CONFIG.quantized_grads=True",
                               "config.MODEL.FSDP_CONFIG.quantized_grads_format=int4",
                               "config.MODEL.FSDP_CONFIG.quantization_block=255"}),
                    doctest::Contains("quantization_block to an even number (255 is odd)"));
  // hpZ: the backward's gathers inside a node.
  CHECK(config_of({"config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
                   "config.MODEL.FSDP_CONFIG.reshard_group_size=2"})
            .parallel.fsdp.reshard_group_size == 2);
  CHECK_THROWS_WITH(config_of({"config.MODEL.FSDP_CONFIG.reshard_group_size=2"}),
                    doctest::Contains("partial resharding is an FSDP setting"));
  CHECK_THROWS_WITH(config_of({"config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
                               "config.MODEL.FSDP_CONFIG.quantized_weights=True",
                               "config.MODEL.FSDP_CONFIG.quantization_block=0"}),
                    doctest::Contains("pass 1 to 16777216 values per scale"));
}

TEST_CASE(
    "config: a VISSL user's file -- its no-op keys ignored, both trunk schemas, every "
    "problem in one report") {
  // The keys every VISSL SwAV config carries (swav_8node_resnet.yaml's) that change nothing
  // here are accepted and listed (TEST_MODEL is read: it turns the kNN off); the old trunk
  // schema reads as today's.
  const std::string vissl = R"(config:
  VERBOSE: False
  TEST_ONLY: False
  TEST_MODEL: False
  MULTI_PROCESSING_METHOD: forkserver
  HOOKS:
    PERF_STATS:
      MONITOR_PERF_STATS: True
      ROLLING_BTIME_FREQ: 313
  DATA:
    TRAIN:
      DATASET_NAMES: [imagenet1k_folder]
      LABEL_TYPE: sample_index
      MMAP_MODE: True
      COPY_TO_LOCAL_DISK: False
      COPY_DESTINATION_DIR: /tmp/imagenet1k/
      USE_STATEFUL_DISTRIBUTED_SAMPLER: True
  TRAINER:
    TRAIN_STEP_NAME: standard_train_step
  METERS:
    name: ""
  MODEL:
    TRUNK:
      NAME: resnet
      TRUNK_PARAMS:
        RESNETS:
          DEPTH: 34
          GROUPS: 1
    HEAD:  # (VISSL's models/resnet34.yaml: a ResNet-34 gives 512 features)
      PARAMS: [["swav_head", {"dims": [512, 2048, 128], "use_bn": True, "num_clusters": [3000]}]]
  DISTRIBUTED:
    NCCL_DEBUG: True
)";
  const swav::ConfigTree tree = tree_of({}, vissl);
  CHECK(config_problems(tree).empty());
  CHECK(tree.get<int>("MODEL.TRUNK.RESNETS.DEPTH") == 34);
  const std::vector<std::string> expected = {"VERBOSE",
                                             "TEST_ONLY",
                                             "MULTI_PROCESSING_METHOD",
                                             "HOOKS.PERF_STATS.MONITOR_PERF_STATS",
                                             "HOOKS.PERF_STATS.ROLLING_BTIME_FREQ",
                                             "DATA.TRAIN.DATASET_NAMES",
                                             "DATA.TRAIN.LABEL_TYPE",
                                             "DATA.TRAIN.MMAP_MODE",
                                             "DATA.TRAIN.COPY_TO_LOCAL_DISK",
                                             "DATA.TRAIN.COPY_DESTINATION_DIR",
                                             "DATA.TRAIN.USE_STATEFUL_DISTRIBUTED_SAMPLER",
                                             "TRAINER.TRAIN_STEP_NAME",
                                             "METERS.name",
                                             "DISTRIBUTED.NCCL_DEBUG"};
  CHECK(tree.ignored() == expected);
  // Our sampler always resumes mid-epoch (VISSL's stateful one): asking for VISSL's other
  // sampler, which starts a resumed epoch over, is refused rather than quietly not followed.
  CHECK(config_problems(tree_of({"config.DATA.TRAIN.USE_STATEFUL_DISTRIBUTED_SAMPLER=False"}))
            .find("config.DATA.TRAIN.USE_STATEFUL_DISTRIBUTED_SAMPLER (= False): this trainer "
                  "has no such setting and can follow VISSL's config only where it is True") !=
        std::string::npos);
  CHECK(config_problems(tree_of({"config.DATA.TEST.USE_STATEFUL_DISTRIBUTED_SAMPLER=False"}))
            .empty());
  // Today's schema too.
  CHECK(tree_of({"config.MODEL.TRUNK.RESNETS.DEPTH=50"}).get<int>("MODEL.TRUNK.RESNETS.DEPTH") ==
        50);

  // Every problem of a file and its overrides, in one report: a misspelt key (close to a valid
  // one: suggested), a VISSL key this trainer lacks (VISSL's meaning), a key nobody has (the
  // valid keys beside it), a value of the wrong type, an ignorable key with a value that asks
  // for something this trainer does not do, a misspelt section.
  const std::string problems =
      config_problems(tree_of({"config.OPTIMIZER.use_larc=1.5", "config.TEST_ONLY=True"}, R"(config:
  VERBOSE: True
  OPTIMIZER:
    num_epoch: 2
  MODEL:
    TRUNK:
      RESNETS:
        LAYER4_STRIDE: 1
  DATA:
    TRAIN:
      FANCY_KEY: 3
  OPTIMISER:
    momentum: 0.8
)"));
  check_problems(
      problems, 6,
      {"1. unknown config key config.OPTIMIZER.num_epoch (= 2); the nearest valid key is "
       "config.OPTIMIZER.num_epochs",
       "2. config.MODEL.TRUNK.RESNETS.LAYER4_STRIDE (= 1): this trainer has no such setting and "
       "can follow VISSL's config only where it is 2 (VISSL's meaning: ",
       "3. unknown config key config.DATA.TRAIN.FANCY_KEY (= 3): neither this trainer nor VISSL "
       "has it; the keys under config.DATA.TRAIN are DATA_SOURCES, ",
       "4. unknown config key config.OPTIMISER (= {momentum: 0.8}); the nearest valid key is "
       "config.OPTIMIZER",
       "5. config.OPTIMIZER.use_larc = 1.5 is a number; it must be a boolean",
       "6. config.TEST_ONLY (= True): this trainer has no such setting"});
  // The reader's own problems join the merge's, each part of the config read on its own.
  const std::string both = config_problems(
      tree_of({"config.DATA.TRAIN.DATA_SOURCES=[disk_filelist]",
               "config.LOSS.swav_loss.temperatur=0.1", "config.OPTIMIZER.num_epochs=0"}));
  check_problems(both, 4,
                 {"1. unknown config key config.LOSS.swav_loss.temperatur (= 0.1); the nearest "
                  "valid key is config.LOSS.swav_loss.temperature",
                  "2. config.DATA.TRAIN.DATA_SOURCES = [disk_filelist]: give one source: "
                  "[fashion_mnist]",
                  "3. config.DATA.TEST is left at its default (fashion_mnist) while DATA.TRAIN "
                  "reads [disk_filelist]",
                  "4. config.OPTIMIZER.num_epochs = 0: must be >= 1"});
  // A misspelt key inside a section whose other VISSL keys are ignorable is still a misspelling;
  // a refused rank count and a crop-scale refusal join the report instead of ending it.
  CHECK(config_problems(tree_of({"config.DATA.TEST.BATCHSIZE_PER_REPLCIA=64"}))
            .find("the nearest valid key is config.DATA.TEST.BATCHSIZE_PER_REPLICA") !=
        std::string::npos);
  const std::string more = config_problems(tree_of(
      {"config.DISTRIBUTED.NUM_NODES=0",
       "config.DATA.TRAIN.TRANSFORMS=[{name: ImgPilToMultiCrop, "
       "total_num_crops: 2, size_crops: [16], num_crops: [2], crop_scales: [[0.9, 0.2]]}]"}));
  check_problems(more, 2,
                 {"crop_scales[0] = [0.9, 0.2]", "config.DISTRIBUTED.NUM_NODES = 0: must be >= 1"});
  // A key far from every valid one is not "nearest" to any: VISSL's meaning instead.
  CHECK(config_problems(tree_of({"config.MODEL.TRUNK.RESNETS.LAYER4_STRIDE=1"}))
            .find("VISSL's meaning: Stride of the last stage") != std::string::npos);
  CHECK(config_problems(tree_of({"config.MODEL.HEAD.PARAMS_MULTIPLIER=2.0"})).empty());
  CHECK(config_problems(tree_of({"config.LOG_FREQUENCE=5"}))
            .find("the nearest valid key is config.LOG_FREQUENCY") != std::string::npos);
  CHECK(config_problems(tree_of({"config.MODEL.TRUNK.RESNETS.NORM=LayerNorm"}))
            .find("VISSL's meaning: Norm layer") != std::string::npos);
}

TEST_CASE("kNN features: VISSL's LINEAR_EVAL_FEAT_POOL_OPS_MAP, and errors that name the fix") {
  using Op = swav::FeaturePool::Op;
  const std::vector<std::string> kResNetStages{"layer1", "layer2", "layer3", "layer4"};
  const std::string key = "config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP=";
  // Default: the trunk's output (res5avg, the avgpool child's output as it is).
  const auto d = config_of({});
  REQUIRE(d.knn_features.size() == 1);
  CHECK(d.knn_features[0].layer == "res5avg");
  CHECK(d.knn_features[0].module(kResNetStages) == "avgpool");
  CHECK(d.knn_features[0].op == Op::identity);
  CHECK(d.knn_features[0].features(128, 1, 1) == 128);
  // VISSL's ImageNet res5 setting, then the trunk output: both evaluated, the first headline.
  const auto two = config_of(
      {key + R"([["res5", ["AvgPool2d", [[6, 6], 1, 0]]], ["res5avg", ["Identity", []]]])"});
  REQUIRE(two.knn_features.size() == 2);
  CHECK(two.knn_features[0].module(kResNetStages) == "layer4");
  CHECK(two.knn_features[0].op == Op::avg_pool);
  CHECK(two.knn_features[0].features(2048, 7, 7) == 2048 * 4);  // 7x7 -> 2x2
  CHECK(two.knn_features[0].text() == "res5 AvgPool2d [6, 6] stride 1 padding 0");
  const auto adaptive = config_of({key + R"([["res3", ["AdaptiveAvgPool2d", [[2, 3]]]]])"});
  CHECK(adaptive.knn_features[0].module(kResNetStages) == "layer2");
  CHECK(adaptive.knn_features[0].features(32, 12, 12) == 32 * 6);
  // An empty map is the default.
  CHECK(config_of({key + "[]"}).knn_features[0].layer == "res5avg");
  // Errors name the key, the value and the fix.
  CHECK_THROWS_WITH_AS(config_of({key + R"([["res6", ["Identity", []]]])"}),
                       doctest::Contains("LINEAR_EVAL_FEAT_POOL_OPS_MAP[0][0] = res6: not a trunk "
                                         "feature this trainer extracts; use res2"),
                       swav::ConfigError);
  CHECK_THROWS_WITH_AS(config_of({key + R"([["res5", ["MaxPool2d", [[2, 2]]]]])"}),
                       doctest::Contains("[0][1][0] = MaxPool2d: use Identity, AvgPool2d or "
                                         "AdaptiveAvgPool2d"),
                       swav::ConfigError);
  CHECK_THROWS_WITH_AS(config_of({key + R"([["res5", ["AvgPool2d", [[2, 0], 1, 0]]]])"}),
                       doctest::Contains("give a kernel [kh, kw] of integers from 1 to 1024"),
                       swav::ConfigError);
  CHECK_THROWS_WITH_AS(config_of({key + R"([["res5", ["AvgPool2d", [[2, 2], 1, 2]]]])"}),
                       doctest::Contains("padding from 0 to half the kernel"), swav::ConfigError);
  CHECK_THROWS_WITH_AS(config_of({key + R"([["res5", ["AdaptiveAvgPool2d", [2, 2]]]])"}),
                       doctest::Contains("AdaptiveAvgPool2d"), swav::ConfigError);
  CHECK_THROWS_WITH_AS(
      config_of({key + R"([["res5", ["Identity", []]], ["res5", ["Identity", []]]])"}),
      doctest::Contains("given twice"), swav::ConfigError);
  CHECK_THROWS_WITH_AS(config_of({key + R"([["res5", ["Identity", 3]]])"}),
                       doctest::Contains("Identity takes []"), swav::ConfigError);
  CHECK_THROWS_WITH_AS(config_of({key + R"([["res5", ["AvgPool2d", [[2, 2], 4096, 0]]]])"}),
                       doctest::Contains("stride must be from 1 to 1024"), swav::ConfigError);
  CHECK_THROWS_WITH_AS(config_of({key + R"([["res5"]])"}),
                       doctest::Contains("each entry is [layer, [op, args]]"), swav::ConfigError);
  // A window larger than the (padded) output: an error naming the layer, when it is seen.
  const auto big = config_of({key + R"([["res5", ["AvgPool2d", [[4, 4], 1, 0]]]])"});
  CHECK_THROWS_WITH(big.knn_features[0].features(128, 3, 3),
                    doctest::Contains("res5 is 3x3, smaller than AvgPool2d's 4x4 window"));
  // The pooling itself equals torch.nn's (swav_torch.py, on the fixture); here a hand case:
  // AdaptiveAvgPool2d [[2, 2]] on a 3x3 plane averages the overlapping windows rows/cols
  // [0, 2) and [1, 3).
  // (`out` as long as the plane: GCC's bounds check cannot see that no identity copy runs.)
  std::vector<float> plane{1, 2, 3, 4, 5, 6, 7, 8, 9}, out(plane.size(), -1.0f);
  config_of({key + R"([["res5", ["AdaptiveAvgPool2d", [[2, 2]]]]])"})
      .knn_features[0]
      .apply(plane.data(), 1, 1, 3, 3, out.data());
  CHECK(out == std::vector<float>{3, 4, 6, 7, -1, -1, -1, -1, -1});
}

// The weighted kNN vote in float64 by brute force: the k most similar bank rows (ties to the
// lower index), each voting exp(similarity / sigma) for its label; the first largest class wins.
std::vector<int> reference_knn(const std::vector<double>& bank,
                               const std::vector<std::int32_t>& labels,
                               const std::vector<double>& queries, std::int64_t dim, int k,
                               double sigma) {
  const std::int64_t n = static_cast<std::int64_t>(labels.size());
  const std::int64_t count = static_cast<std::int64_t>(queries.size()) / dim;
  std::vector<int> predicted;
  for (std::int64_t q = 0; q < count; ++q) {
    std::vector<std::pair<double, std::int64_t>> sims;
    for (std::int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (std::int64_t d = 0; d < dim; ++d) s += queries[q * dim + d] * bank[j * dim + d];
      sims.push_back({-s, j});
    }
    std::sort(sims.begin(), sims.end());
    std::vector<double> votes(10, 0.0);
    for (int i = 0; i < std::min<std::int64_t>(k, n); ++i)
      votes[labels[static_cast<std::size_t>(sims[i].second)]] += std::exp(-sims[i].first / sigma);
    predicted.push_back(
        static_cast<int>(std::max_element(votes.begin(), votes.end()) - votes.begin()));
  }
  return predicted;
}

TEST_CASE(
    "kNN: the weighted vote equals a float64 brute force, on any split of the queries and pool") {
  // A bank of more rows than one product's chunk (4080) and more queries than one task's block
  // (128), neither a multiple of it; random unit rows and labels.
  const std::int64_t n = 9001, count = 300, dim = 37;
  const int k = 20;
  const double sigma = 0.07;
  const auto bank64 = unit_rows(71, n, dim), queries64 = unit_rows(72, count, dim);
  const std::vector<float> bank(bank64.begin(), bank64.end()),
      queries(queries64.begin(), queries64.end());
  std::vector<std::int32_t> bank_labels;
  for (const double v : random_values(73, static_cast<std::size_t>(n), 0, 10))
    bank_labels.push_back(static_cast<std::int32_t>(std::min(9.0, std::floor(v))));
  const auto expected = reference_knn(bank64, bank_labels, queries64, dim, k, sigma);
  // Every query labelled as the reference predicts, but every third one a class off: the count
  // is then exact only if each prediction is the reference's.
  std::vector<std::int32_t> query_labels;
  std::int64_t right = 0;
  for (std::int64_t q = 0; q < count; ++q) {
    const bool flip = q % 3 == 0;
    query_labels.push_back(
        static_cast<std::int32_t>((expected[static_cast<std::size_t>(q)] + flip) % 10));
    right += !flip;
  }
  sk::ThreadPool one(1), two(2);
  CHECK(swav::knn_correct(bank, bank_labels, queries, query_labels, dim, 0, count, k, sigma, one) ==
        right);
  CHECK(swav::knn_correct(bank, bank_labels, queries, query_labels, dim, 0, count, k, sigma, two) ==
        right);
  // Split as ranks split the test set: the parts add up.
  CHECK(swav::knn_correct(bank, bank_labels, queries, query_labels, dim, 0, 77, k, sigma, two) +
            swav::knn_correct(bank, bank_labels, queries, query_labels, dim, 77, count, k, sigma,
                              one) ==
        right);
  // A rank's share alone, held from its first query on: the same count.
  const std::vector<float> share(queries.begin() + 77 * dim, queries.end());
  CHECK(swav::knn_correct(bank, bank_labels, share, query_labels, dim, 77, count, k, sigma, two, 10,
                          77) ==
        swav::knn_correct(bank, bank_labels, queries, query_labels, dim, 77, count, k, sigma, one));
  // k larger than the bank: every row votes.
  const std::vector<float> small_bank(bank.begin(), bank.begin() + 5 * dim);
  const std::vector<std::int32_t> small_labels(bank_labels.begin(), bank_labels.begin() + 5);
  const auto small_expected =
      reference_knn(std::vector<double>(bank64.begin(), bank64.begin() + 5 * dim), small_labels,
                    queries64, dim, k, sigma);
  std::vector<std::int32_t> small_query_labels;
  for (const int c : small_expected) small_query_labels.push_back(static_cast<std::int32_t>(c));
  CHECK(swav::knn_correct(small_bank, small_labels, queries, small_query_labels, dim, 0, count, k,
                          sigma, two) == count);
}

TEST_CASE("kNN: a bank's shards' lists merge into the whole bank's, bit for bit, ties included") {
  // A bank of 9001 random unit rows (two products' chunks of 4080 and a part), a tenth of them
  // copies of earlier rows (equal similarities: the lists order them by index), 150 queries; at
  // a narrow width and at the long config's res3 width (GEMM libraries pick other kernels by
  // shape and width: shards' products of 7, 912 or 3001 rows against the whole bank's 4080).
  for (const std::int64_t dim : {29, 1152}) {
    CAPTURE(dim);
    const std::int64_t n = 9001, count = 150;
    const int k = 20;
    const auto bank64 = unit_rows(81, n, dim), queries64 = unit_rows(82, count, dim);
    std::vector<float> bank(bank64.begin(), bank64.end());
    const std::vector<float> queries(queries64.begin(), queries64.end());
    for (std::int64_t r = 10; r < n; r += 10)  // row r a copy of row r / 10
      std::copy_n(bank.begin() + r / 10 * dim, dim, bank.begin() + r * dim);
    sk::ThreadPool pool(2);
    const auto whole = swav::knn_nearest(bank, 0, queries.data(), count, dim, k, pool);
    // The whole bank's lists: the k best by similarity, then index, best first.
    std::int64_t ties = 0;
    for (std::int64_t q = 0; q < count; ++q)
      for (int i = 1; i < k; ++i) {
        const auto at = static_cast<std::size_t>(q * k + i);
        const float s0 = whole.similarity[at - 1], s1 = whole.similarity[at];
        CHECK((s0 > s1 || (s0 == s1 && whole.index[at - 1] < whole.index[at])));
        ties += s0 == s1;
      }
    CHECK(ties > 0);  // the copies do tie
    for (const auto& cuts :
         {std::vector<std::int64_t>{0, 4000, 9001}, std::vector<std::int64_t>{0, 7, 5000, 9001},
          std::vector<std::int64_t>{0, 3001, 3001, 6002, 9001}}) {
      const std::int64_t parts = static_cast<std::int64_t>(cuts.size()) - 1;
      std::vector<float> similarity;
      std::vector<std::int64_t> index;
      for (std::int64_t p = 0; p < parts; ++p) {
        const std::vector<float> shard(bank.begin() + cuts[p] * dim,
                                       bank.begin() + cuts[p + 1] * dim);
        const auto lists = swav::knn_nearest(shard, cuts[p], queries.data(), count, dim, k, pool);
        similarity.insert(similarity.end(), lists.similarity.begin(), lists.similarity.end());
        index.insert(index.end(), lists.index.begin(), lists.index.end());
      }
      const auto merged = swav::knn_merge(similarity, index, parts, count, k, k);
      CHECK(merged.index == whole.index);
      CHECK(std::memcmp(merged.similarity.data(), whole.similarity.data(),
                        whole.similarity.size() * sizeof(float)) == 0);
    }
  }
  const std::int64_t n = 9001, count = 150, dim = 29;
  const int k = 20;
  const auto bank64 = unit_rows(81, n, dim), queries64 = unit_rows(82, count, dim);
  const std::vector<float> bank(bank64.begin(), bank64.end());
  const std::vector<float> queries(queries64.begin(), queries64.end());
  sk::ThreadPool pool(2);
  // A shard of fewer rows than k pads its lists with -1; the merge skips them.
  const std::vector<float> three(bank.begin(), bank.begin() + 3 * dim);
  const auto short_lists = swav::knn_nearest(three, 0, queries.data(), count, dim, k, pool);
  CHECK(short_lists.index[3] == -1);
  CHECK(short_lists.index[2] >= 0);
  const auto merged = swav::knn_merge(short_lists.similarity, short_lists.index, 1, count, k, k);
  CHECK(merged.index == short_lists.index);
}

TEST_CASE("ResNeXt and the deeper ResNets: VISSL's GROUPS, WIDTH_PER_GROUP and DEPTH") {
  const auto x50 = config_of(
      {"config.MODEL.TRUNK.RESNETS.GROUPS=32", "config.MODEL.TRUNK.RESNETS.WIDTH_PER_GROUP=4"});
  CHECK(x50.groups == 32);
  CHECK(x50.width_per_group == 4);
  CHECK(swav::trunk_name(x50) == "ResNeXt-50 32x4d");
  CHECK(swav::trunk_name(config_of({})) == "ResNet-50");
  // The trunks are torchvision's resnext50_32x4d, resnet101 and resnext101_32x8d without their
  // fc (2048 x 1000 + 1000), their stems reading one channel (the default data is Fashion-MNIST's
  // grey images: 64 x 2 x 7 x 7 weights fewer); shapes only.
  sk::Context ctx;
  const sk::DeferredParameters shapes_only(ctx);
  const std::int64_t fc = 2048 * 1000 + 1000 + 64 * 2 * 7 * 7;
  CHECK(swav::SwavModel(ctx, x50).trunk->parameter_count() == 25'028'904 - fc);
  const auto r101 = config_of({"config.MODEL.TRUNK.RESNETS.DEPTH=101"});
  CHECK(swav::SwavModel(ctx, r101).trunk->parameter_count() == 44'549'160 - fc);
  const auto x101 =
      config_of({"config.MODEL.TRUNK.RESNETS.DEPTH=101", "config.MODEL.TRUNK.RESNETS.GROUPS=32",
                 "config.MODEL.TRUNK.RESNETS.WIDTH_PER_GROUP=8"});
  CHECK(swav::SwavModel(ctx, x101).trunk->parameter_count() == 88'791'336 - fc);
  CHECK(swav::trunk_name(x101) == "ResNeXt-101 32x8d");
  // Basic blocks have no groups; nonsense values are refused by name.
  CHECK_THROWS_WITH(
      config_of({"config.MODEL.TRUNK.RESNETS.DEPTH=18", "config.MODEL.TRUNK.RESNETS.GROUPS=32"}),
      doctest::Contains("ResNeXt's grouped blocks are bottlenecks"));
  CHECK_THROWS_WITH(config_of({"config.MODEL.TRUNK.RESNETS.GROUPS=0"}),
                    doctest::Contains("config.MODEL.TRUNK.RESNETS.GROUPS = 0"));
  CHECK_THROWS_WITH(config_of({"config.MODEL.TRUNK.RESNETS.DEPTH=200"}),
                    doctest::Contains("use 18, 34, 50, 101 or 152"));
  CHECK_THROWS_WITH(config_of({"config.MODEL.TRUNK.RESNETS.WIDTH_MULTIPLIER=0.25",
                               "config.MODEL.TRUNK.RESNETS.WIDTH_PER_GROUP=2"}),
                    doctest::Contains("use WIDTH_PER_GROUP >= 4"));
  // The kNN's settings too (k nearest, their vote's temperature).
  CHECK_THROWS_WITH(config_of({"config.NEAREST_NEIGHBOR.TOPK=0"}),
                    doctest::Contains("config.NEAREST_NEIGHBOR.TOPK = 0"));
  CHECK_THROWS_WITH(config_of({"config.NEAREST_NEIGHBOR.SIGMA=0"}),
                    doctest::Contains("config.NEAREST_NEIGHBOR.SIGMA = 0"));
  // A bank of no images voted class 0 for every query, then divided by its zero width; -7 was
  // taken as "all".
  for (const std::string limit : {"0", "-7"})
    CHECK_THROWS_WITH(config_of({"config.NEAREST_NEIGHBOR.MEMORY_BANK_LIMIT=" + limit}),
                      doctest::Contains(("config.NEAREST_NEIGHBOR.MEMORY_BANK_LIMIT = " + limit +
                                         ": give the number of training images")
                                            .c_str()));
}

TEST_CASE("RegNet trunks: VISSL's MODEL.TRUNK.REGNET by name, by its numbers, as an AnyNet") {
  const std::string regnet = "config.MODEL.TRUNK.NAME=regnet";
  const auto head = [](int features) {
    return "config.MODEL.HEAD.PARAMS=[[\"swav_head\", {\"dims\": [" + std::to_string(features) +
           ", 64, 32], \"use_bn\": False, \"num_clusters\": [30]}]]";
  };
  // VISSL's models/regnet400mf.yaml: a registered model by name.
  const auto named =
      config_of({regnet, "config.MODEL.TRUNK.REGNET.name=regnet_y_400mf", head(440)});
  CHECK(named.trunk == "regnet");
  CHECK(swav::trunk_name(named) == "RegNetY regnet_y_400mf (4 stages, 440 features)");
  CHECK(named.regnet.use_se);
  // regnet16Gf.yaml's numbers and swav_regnet_fsdp.yaml's AnyNet: the same stages.
  const auto numbers =
      config_of({regnet, "config.MODEL.TRUNK.REGNET.depth=18", "config.MODEL.TRUNK.REGNET.w_0=200",
                 "config.MODEL.TRUNK.REGNET.w_a=106.23", "config.MODEL.TRUNK.REGNET.w_m=2.48",
                 "config.MODEL.TRUNK.REGNET.group_width=112", head(3024)});
  const auto anynet = config_of({regnet, "config.MODEL.TRUNK.REGNET.name=anynet",
                                 "config.MODEL.TRUNK.REGNET.depths=[2, 4, 11, 1]",
                                 "config.MODEL.TRUNK.REGNET.widths=[224, 448, 1232, 3024]",
                                 "config.MODEL.TRUNK.REGNET.group_widths=[112, 112, 112, 112]",
                                 "config.MODEL.TRUNK.REGNET.bottleneck_multipliers=[1.0, 1.0, 1.0, "
                                 "1.0]",
                                 "config.MODEL.TRUNK.REGNET.strides=[2, 2, 2, 2]", head(3024)});
  REQUIRE(numbers.regnet_stages.size() == 4);
  REQUIRE(anynet.regnet_stages.size() == 4);
  for (std::size_t i = 0; i < 4; ++i) {
    CHECK(numbers.regnet_stages[i].width == anynet.regnet_stages[i].width);
    CHECK(numbers.regnet_stages[i].depth == anynet.regnet_stages[i].depth);
    CHECK(numbers.regnet_stages[i].group_width == anynet.regnet_stages[i].group_width);
  }
  CHECK(swav::trunk_name(anynet) == "AnyNet of RegNetY blocks (4 stages, 3024 features)");
  // The trunk: regnet_y_400mf's 3,903,144 parameters (torchvision's count less its fc), less
  // the stem's two channels that grey images do not have (32 x 2 x 3 x 3).
  sk::Context ctx;
  const sk::DeferredParameters shapes_only(ctx);
  CHECK(swav::SwavModel(ctx, named).trunk->parameter_count() == 3'903'144 - 32 * 2 * 9);
  // Its blocks are the FSDP units.
  const auto fsdp = config_of({regnet, "config.MODEL.TRUNK.REGNET.name=regnet_y_400mf", head(440),
                               "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True"});
  swav::SwavModel model(ctx, fsdp);
  const auto units = swav::rank_setup(model, fsdp, 2).parallel.fsdp.wrap.unit_paths;
  REQUIRE(units.size() == 16);
  CHECK(units[0] == "trunk.res2.block1-0");
  CHECK(units[15] == "trunk.res5.block4-5");
  // A feature of a stage the trunk does not have.
  swav::FeaturePool res5;
  res5.layer = "res5";
  CHECK(res5.module(model.trunk->stage_names()) == "res5");
  CHECK_THROWS_WITH(res5.module({"res2", "res3", "res4"}),
                    doctest::Contains("the trunk has 3 stages (res2 to res4)"));
  // VISSL's regnet_fsdp keys for activation checkpoints are accepted and listed as ignored.
  const auto tree =
      tree_of({regnet, "config.MODEL.TRUNK.REGNET.name=regnet_y_400mf", head(440),
               "config.MODEL.TRUNK.REGNET.stage_checkpoints=[[2], [4], [6, 11], []]"});
  CHECK(std::find(tree.ignored().begin(), tree.ignored().end(),
                  "MODEL.TRUNK.REGNET.stage_checkpoints") != tree.ignored().end());
  // Every problem at once, each naming its fix.
  check_problems(config_problems(tree_of({regnet, "config.MODEL.TRUNK.REGNET.name=regnet_z_500mf",
                                          "config.MODEL.TRUNK.REGNET.block_type=vanilla_block",
                                          "config.MODEL.TRUNK.REGNET.activation=silu",
                                          "config.OPTIMIZER.num_epochs=0"})),
                 3,
                 {"config.MODEL.TRUNK.REGNET.name = regnet_z_500mf: not a RegNet this trainer "
                  "knows; use one of ClassyVision's registered models (regnet_y_400mf",
                  "config.MODEL.TRUNK.REGNET.name = regnet_z_500mf: VISSL builds a registered "
                  "RegNet from its name alone and does not read block_type, activation",
                  "config.OPTIMIZER.num_epochs = 0"});
  check_problems(
      config_problems(
          tree_of({regnet, "config.MODEL.TRUNK.REGNET.depth=16", "config.MODEL.TRUNK.REGNET.w_0=48",
                   "config.MODEL.TRUNK.REGNET.w_a=27.89", "config.MODEL.TRUNK.REGNET.w_m=2.09",
                   "config.MODEL.TRUNK.REGNET.group_width=8",
                   "config.MODEL.TRUNK.REGNET.block_type=vanilla_block",
                   "config.MODEL.TRUNK.REGNET.activation=silu"})),
      2,
      {"config.MODEL.TRUNK.REGNET.block_type = vanilla_block: this trainer builds "
       "res_bottleneck_block",
       "config.MODEL.TRUNK.REGNET.activation = silu: this trainer's RegNets use relu"});
  CHECK(config_problems(tree_of({regnet}))
            .find("name a registered RegNet (e.g. name: "
                  "regnet_y_400mf)") != std::string::npos);
  CHECK(config_problems(tree_of({regnet, "config.MODEL.TRUNK.REGNET.name=regnet_y_400mf",
                                 "config.MODEL.TRUNK.REGNET.depth=18",
                                 "config.MODEL.TRUNK.REGNET.stem_width=64"}))
            .find("from its name alone and does not read depth, stem_width; remove them") !=
        std::string::npos);
  // A value of the wrong type is reported once, by the merge (not again as a missing RegNet).
  check_problems(
      config_problems(tree_of(
          {regnet, "config.MODEL.TRUNK.REGNET.depth=16.5", "config.MODEL.TRUNK.REGNET.w_0=48",
           "config.MODEL.TRUNK.REGNET.w_a=27.89", "config.MODEL.TRUNK.REGNET.w_m=2.09",
           "config.MODEL.TRUNK.REGNET.group_width=8", head(440), "config.OPTIMIZER.num_epochs=0"})),
      2, {"config.MODEL.TRUNK.REGNET.depth = 16.5 is a number; it must be an integer"});
  // VISSL's FSDP names for the same network and head (its AUTO_SETUP_FSDP renames them), under
  // its FSDP task.
  const auto fsdp_names = config_of(
      {"config.TRAINER.TASK_NAME=self_supervision_fsdp_task", "config.MODEL.TRUNK.NAME=regnet_fsdp",
       "config.MODEL.TRUNK.REGNET.depth=16", "config.MODEL.TRUNK.REGNET.w_0=48.0",
       "config.MODEL.TRUNK.REGNET.w_a=27.89", "config.MODEL.TRUNK.REGNET.w_m=2.09",
       "config.MODEL.TRUNK.REGNET.group_width=8",
       "config.MODEL.HEAD.PARAMS=[[\"swav_head_fsdp\", {\"dims\": [440, 64, 32], \"use_bn\": "
       "False, \"num_clusters\": [30]}]]"});
  CHECK(fsdp_names.trunk == "regnet");
  CHECK(fsdp_names.regnet_stages.back().width == 440);
  // (VISSL's regnet_fsdp asserts an AnyNet or RegNet's numbers; this trainer builds a
  // registered model under either name)
  CHECK(config_of({"config.MODEL.TRUNK.NAME=regnet_fsdp",
                   "config.MODEL.TRUNK.REGNET.name=regnet_y_400mf", head(440)},
                  "", 1)
            .regnet_stages.size() == 4);
  // Each problem once: a value the merge refused is not reported again, the section as a
  // whole included, and the form's own problems stand beside it.
  check_problems(config_problems(tree_of({regnet, "config.MODEL.TRUNK.REGNET.name=regnet_y_400mf",
                                          "config.MODEL.TRUNK.REGNET.depth=16.5", head(440),
                                          "config.OPTIMIZER.num_epochs=0"})),
                 2, {"config.MODEL.TRUNK.REGNET.depth = 16.5 is a number"});
  check_problems(
      config_problems(tree_of({"config.MODEL.TRUNK.NAME=regnet", "config.MODEL.TRUNK.REGNET=foo",
                               head(440), "config.OPTIMIZER.num_epochs=0"})),
      2, {"config.MODEL.TRUNK.REGNET = foo is a string; it must be a map"});
  check_problems(config_problems(tree_of({regnet, "config.MODEL.TRUNK.REGNET.name=anynet",
                                          "config.MODEL.TRUNK.REGNET.depths=3",
                                          "config.MODEL.TRUNK.REGNET.depth=16"})),
                 2,
                 {"config.MODEL.TRUNK.REGNET.depths = 3 is an integer; it must be a list",
                  "an AnyNet takes per-stage lists (depths, widths, group_widths, "
                  "bottleneck_multipliers, strides); remove depth"});
  // A squeeze that rounds to no channel: refused with the config, not at the build.
  CHECK(
      config_problems(
          tree_of({regnet, "config.MODEL.TRUNK.REGNET.depth=16", "config.MODEL.TRUNK.REGNET.w_0=48",
                   "config.MODEL.TRUNK.REGNET.w_a=27.89", "config.MODEL.TRUNK.REGNET.w_m=2.09",
                   "config.MODEL.TRUNK.REGNET.group_width=8",
                   "config.MODEL.TRUNK.REGNET.se_ratio=0.01", head(440)}))
          .find("a block of 32 input channels would squeeze to none") != std::string::npos);
  // A kNN feature of a stage the trunk lacks, and NHWC activations: refused with the config.
  CHECK(config_problems(
            tree_of({regnet, "config.MODEL.TRUNK.REGNET.name=anynet",
                     "config.MODEL.TRUNK.REGNET.depths=[1, 1]",
                     "config.MODEL.TRUNK.REGNET.widths=[8, 16]",
                     "config.MODEL.TRUNK.REGNET.group_widths=[8, 8]",
                     "config.MODEL.TRUNK.REGNET.bottleneck_multipliers=[1.0, 1.0]",
                     "config.MODEL.TRUNK.REGNET.strides=[2, 2]", head(16),
                     "config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP=[[\"res4\", "
                     "[\"Identity\", []]]]"}))
            .find("= res4: the trunk has 2 stages, res2 to res3") != std::string::npos);
  // VISSL's RegNet calls the pooled output avgpool: the same feature as res5avg.
  const std::string pools = "config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP=";
  const auto avgpool = config_of({regnet, "config.MODEL.TRUNK.REGNET.name=regnet_y_400mf",
                                  head(440), pools + R"([["avgpool", ["Identity", []]]])"});
  CHECK(avgpool.knn_features[0].module(model.trunk->stage_names()) == "avgpool");
  CHECK(config_problems(tree_of({pools + R"([["res5avg", ["Identity", []]], )"
                                         R"(["avgpool", ["Identity", []]]])"}))
            .find("given twice") != std::string::npos);
  CHECK(config_problems(tree_of({regnet, "config.MODEL.TRUNK.REGNET.name=regnet_y_400mf", head(440),
                                 "config.MODEL.TRUNK.RESNETS.CHANNELS_LAST=True"}))
            .find("channels-last activations are this trainer's ResNets'") != std::string::npos);
  // se_ratio 0 is ClassyVision's "no squeeze-and-excitation".
  CHECK_FALSE(
      config_of({regnet, "config.MODEL.TRUNK.REGNET.depth=16", "config.MODEL.TRUNK.REGNET.w_0=48",
                 "config.MODEL.TRUNK.REGNET.w_a=27.89", "config.MODEL.TRUNK.REGNET.w_m=2.09",
                 "config.MODEL.TRUNK.REGNET.group_width=8", "config.MODEL.TRUNK.REGNET.se_ratio=0",
                 head(440)})
          .regnet.use_se);
  CHECK(config_problems(tree_of({regnet, "config.MODEL.TRUNK.REGNET.name=anynet",
                                 "config.MODEL.TRUNK.REGNET.depths=[1, 2]",
                                 "config.MODEL.TRUNK.REGNET.widths=[8]"}))
            .find("one entry a stage in each of depths, widths") != std::string::npos);
  CHECK(config_problems(tree_of({regnet, "config.MODEL.TRUNK.REGNET.name=anynet",
                                 "config.MODEL.TRUNK.REGNET.depths=[1]",
                                 "config.MODEL.TRUNK.REGNET.widths=[28]",
                                 "config.MODEL.TRUNK.REGNET.group_widths=[8]",
                                 "config.MODEL.TRUNK.REGNET.bottleneck_multipliers=[1.0]",
                                 "config.MODEL.TRUNK.REGNET.strides=[2]"}))
            .find("group_widths = stage 1 (bottleneck 28, group width 8): the bottleneck's "
                  "channels must split") != std::string::npos);
  CHECK(config_problems(tree_of({regnet, "config.MODEL.TRUNK.REGNET.name=regnet_y_400mf"}))
            .find("this trunk gives 440 features") != std::string::npos);
  CHECK(config_problems(tree_of({"config.MODEL.TRUNK.NAME=vision_transformer"}))
            .find("this trainer builds resnet, regnet (or regnet_fsdp) and efficientnet trunks") !=
        std::string::npos);
}

TEST_CASE("EfficientNet trunks: VISSL's MODEL.TRUNK.EFFICIENT_NETS, its feature names") {
  const std::string efficientnet = "config.MODEL.TRUNK.NAME=efficientnet";
  const auto head = [](int features) {
    return "config.MODEL.HEAD.PARAMS=[[\"swav_head\", {\"dims\": [" + std::to_string(features) +
           ", 64, 32], \"use_bn\": True, \"num_clusters\": [30]}]]";
  };
  // VISSL's models/efficientnet_B2.yaml: its keys as they are (min_width null).
  const std::string k = "config.MODEL.TRUNK.EFFICIENT_NETS.";
  const auto b2 =
      config_of({efficientnet, k + "model_version=B2", k + "bn_momentum=0.01",
                 k + "bn_epsilon=0.001", k + "drop_connect_rate=0.2", k + "width_divisor=8",
                 k + "min_width=null", k + "use_se=True", head(1408)});
  CHECK(b2.trunk == "efficientnet");
  CHECK(swav::trunk_name(b2) == "EfficientNet-B2 (23 blocks, 1408 features)");
  CHECK(b2.efficientnet.params.dropout_rate == 0.3);
  CHECK(b2.efficientnet.min_width == 0);
  // The trunk: torchvision's efficientnet_b2 less its classifier (1408 x 1000 + 1000) and the
  // stem's two channels grey images do not have (32 x 2 x 3 x 3).
  sk::Context ctx;
  const sk::DeferredParameters shapes_only(ctx);
  swav::SwavModel model(ctx, b2);
  CHECK(model.trunk->parameter_count() == 9'109'994 - 1'409'000 - 32 * 2 * 9);
  // Its blocks are the FSDP units.
  const auto fsdp = config_of({efficientnet, k + "model_version=B0", head(1280),
                               "config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True"});
  swav::SwavModel b0(ctx, fsdp);
  const auto units = swav::rank_setup(b0, fsdp, 2).parallel.fsdp.wrap.unit_paths;
  REQUIRE(units.size() == 16);
  CHECK(units[15] == "trunk.block15");
  // VISSL's benchmark feature: conv_final through AvgPool2d; block<i> and avgpool also read.
  const std::string pools = "config.MODEL.FEATURE_EVAL_SETTINGS.LINEAR_EVAL_FEAT_POOL_OPS_MAP=";
  const auto conv_final = config_of(
      {efficientnet, k + "model_version=B0", head(1280),
       pools + R"([["conv_final", ["AvgPool2d", [[5, 5], 1, 0]]], ["block3", ["Identity", []]], )"
               R"(["avgpool", ["Identity", []]]])"});
  REQUIRE(conv_final.knn_features.size() == 3);
  CHECK(conv_final.knn_features[0].module(b0.trunk->stage_names()) == "conv_final");
  CHECK(conv_final.knn_features[1].module(b0.trunk->stage_names()) == "block3");
  CHECK(conv_final.knn_features[2].module(b0.trunk->stage_names()) == "avgpool");
  CHECK(b0.trunk->child_output_shape("block3", 224, 224) ==
        std::array<std::int64_t, 3>{40, 28, 28});
  // Every problem at once, each naming its fix.
  check_problems(
      config_problems(tree_of({efficientnet, k + "model_version=B9", k + "drop_connect_rate=1.5",
                               k + "width_divisor=0", k + "bn_epsilon=0", head(1280)})),
      4,
      {"config.MODEL.TRUNK.EFFICIENT_NETS.model_version = B9: name one of B0 ... B7",
       "config.MODEL.TRUNK.EFFICIENT_NETS.drop_connect_rate = 1.5",
       "config.MODEL.TRUNK.EFFICIENT_NETS.width_divisor = 0: must be >= 1",
       "config.MODEL.TRUNK.EFFICIENT_NETS.bn_epsilon = 0: must be > 0"});
  // A trunk that failed to read has its report; its feature names are not judged against
  // another trunk's.
  const std::string failed =
      config_problems(tree_of({efficientnet, k + "model_version=B9", head(1280),
                               pools + R"([["conv_final", ["Identity", []]]])"}));
  CHECK(failed.find("model_version = B9") != std::string::npos);
  CHECK(failed.find("conv_final") == std::string::npos);
  // ClassyVision's `min_width or width_divisor`: 0 is the divisor too.
  CHECK(config_of({efficientnet, k + "model_version=B0", k + "min_width=0", head(1280)})
            .efficientnet.min_width == 0);
  CHECK(config_problems(tree_of({efficientnet, head(1280)}))
            .find("model_version = \"\": name one of B0 ... B7") != std::string::npos);
  CHECK(config_problems(tree_of({efficientnet, k + "model_version=B0", head(2048)}))
            .find("this trunk gives 1280 features") != std::string::npos);
  // An EfficientNet has no res2 ... res5; the other trunks have no conv_final or blocks.
  CHECK(config_problems(tree_of({efficientnet, k + "model_version=B0", head(1280),
                                 pools + R"([["res4", ["Identity", []]]])"}))
            .find("an EfficientNet has no stages res2 ... res5; name conv1, block0 ... block15, "
                  "conv_final or avgpool") != std::string::npos);
  CHECK(config_problems(tree_of({efficientnet, k + "model_version=B0", head(1280),
                                 pools + R"([["block16", ["Identity", []]]])"}))
            .find("EfficientNet-B0 has conv1, block0 ... block15, conv_final or avgpool") !=
        std::string::npos);
  CHECK(config_problems(tree_of({pools + R"([["conv_final", ["Identity", []]]])"}))
            .find("a feature block of VISSL's EfficientNet; this resnet trunk's are res2") !=
        std::string::npos);
  for (const char* name : {"block1x", "block03", "block"}) {
    CAPTURE(name);
    CHECK(config_problems(tree_of({pools + "[[\"" + name + "\", [\"Identity\", []]]]"}))
              .find("not a trunk feature this trainer extracts") != std::string::npos);
  }
  // A block number past any integer: refused as past the last block, not a crash.
  CHECK(
      config_problems(tree_of({efficientnet, k + "model_version=B0", head(1280),
                               pools + R"([["block99999999999999999999999", ["Identity", []]]])"}))
          .find("EfficientNet-B0 has conv1, block0 ... block15, conv_final or avgpool") !=
      std::string::npos);
  // An unknown key under EFFICIENT_NETS is refused, not ignored.
  CHECK(config_problems(
            tree_of({efficientnet, k + "model_version=B0", head(1280), k + "drop_rate=0.1"}))
            .find("EFFICIENT_NETS.drop_rate") != std::string::npos);
}

// VISSL's FSDP task, its one-group optimizer, sgd_fsdp, flatten_parameters, the big-convolution
// wrap threshold and a projection head of any depth: SEER's RegNet-10B model config reads.
TEST_CASE("config: VISSL's FSDP task and SEER's keys -- one parameter group, sgd_fsdp, wraps") {
  using sk::parallel::Stage;
  // The task: self_supervision_fsdp_task is FSDP, as AUTO_SETUP_FSDP (which also makes the
  // optimizer one group); the SDP task needs the ZeRO optimizer; other names are refused.
  const auto task = config_of({"config.TRAINER.TASK_NAME=self_supervision_fsdp_task"});
  CHECK(task.parallel.stage == Stage::fsdp);
  CHECK_FALSE(task.single_param_group);
  CHECK(config_of({"config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True"}).single_param_group);
  CHECK(config_of({"config.TRAINER.TASK_NAME=self_supervision_sdp_task",
                   "config.OPTIMIZER.use_zero=True"})
            .parallel.stage == Stage::sdp);
  CHECK_THROWS_WITH_AS(config_of({"config.TRAINER.TASK_NAME=self_supervision_sdp_task"}),
                       doctest::Contains("config.TRAINER.TASK_NAME = self_supervision_sdp_task: "
                                         "ShardedDDP needs the ZeRO optimizer"),
                       swav::ConfigError);
  CHECK_THROWS_WITH(config_of({"config.TRAINER.TASK_NAME=classification_task"}),
                    doctest::Contains("use self_supervision_task, self_supervision_fsdp_task"));
  // FSDP-wrapped trunk or head under another task: VISSL's DDP task refuses them past one rank.
  const std::string fsdp_head =
      R"(config.MODEL.HEAD.PARAMS=[["swav_head_fsdp", {"dims": [2048, 64, 32], "num_clusters": [30]}]])";
  CHECK_THROWS_WITH(config_of({fsdp_head}),
                    doctest::Contains("config.MODEL.HEAD.PARAMS[0][0] = swav_head_fsdp: VISSL's "
                                      "swav_head_fsdp wraps itself in FSDP units"));
  CHECK(config_of({fsdp_head}, "", 1).parallel.stage == Stage::ddp);
  // (both named at once)
  check_problems(config_problems(tree_of({fsdp_head, "config.MODEL.TRUNK.NAME=regnet_fsdp",
                                          "config.MODEL.TRUNK.REGNET.name=regnet_y_400mf"})),
                 3,
                 {"config.MODEL.TRUNK.NAME = regnet_fsdp: VISSL's regnet_fsdp wraps itself",
                  "config.MODEL.HEAD.PARAMS[0][0] = swav_head_fsdp"});
  CHECK(config_of({fsdp_head, "config.TRAINER.TASK_NAME=self_supervision_fsdp_task"})
            .parallel.stage == Stage::fsdp);

  // One parameter group (construct_single_param_group_only): every parameter decayed, batch-norm
  // parameters and biases too, whatever regularize_bn and regularize_bias say.
  const auto groups = config_of({"config.OPTIMIZER.regularize_bias=False"});
  const auto single = config_of({"config.OPTIMIZER.regularize_bias=False",
                                 "config.OPTIMIZER.construct_single_param_group_only=True"});
  CHECK(single.parallel.stage == Stage::ddp);
  {
    sk::Context ctx;
    const sk::DeferredParameters shapes_only(ctx);
    swav::SwavModel grouped_model(ctx, groups), single_model(ctx, single);
    const auto excluded = swav::rank_setup(grouped_model, groups, 2).optimizer.no_weight_decay;
    CHECK(std::find(excluded.begin(), excluded.end(), "trunk.bn1.weight") != excluded.end());
    CHECK(std::find(excluded.begin(), excluded.end(), "heads.0.projection_head.0.bias") !=
          excluded.end());
    CHECK(swav::rank_setup(single_model, single, 2).optimizer.no_weight_decay.empty());
    // regularize_bn with regularize_bias False: batch-norm weights decayed, their biases not.
    const auto bn_decayed = config_of(
        {"config.OPTIMIZER.regularize_bn=True", "config.OPTIMIZER.regularize_bias=False"});
    swav::SwavModel bn_model(ctx, bn_decayed);
    const auto kept = swav::rank_setup(bn_model, bn_decayed, 2).optimizer.no_weight_decay;
    CHECK(std::find(kept.begin(), kept.end(), "trunk.bn1.weight") == kept.end());
    CHECK(std::find(kept.begin(), kept.end(), "trunk.bn1.bias") != kept.end());
    CHECK(std::find(kept.begin(), kept.end(), "heads.0.projection_head.1.bias") != kept.end());
  }

  // sgd_fsdp: SGD, its LARC's sums of squares all-reduced. Under fsdp with flatten_parameters
  // False, each whole parameter's norms: this trainer's LARC.
  const std::vector<std::string> fsdp_larc = {
      "config.TRAINER.TASK_NAME=self_supervision_fsdp_task", "config.OPTIMIZER.name=sgd_fsdp",
      "config.OPTIMIZER.use_larc=True", "config.MODEL.FSDP_CONFIG.flatten_parameters=False"};
  const auto sgd_fsdp = config_of(fsdp_larc);
  CHECK(sgd_fsdp.optimizer.kind == sk::optim::OptimizerKind::larc_sgd);
  CHECK(sgd_fsdp.optimizer.larc.eps == 1e-8f);
  CHECK(config_of({"config.OPTIMIZER.name=sgd_fsdp"}).optimizer.kind ==
        sk::optim::OptimizerKind::sgd);
  // Under ddp both of VISSL's norms are sqrt(world) too large (every rank's copy summed): only
  // eps weighs less, by sqrt(world), here as there.
  const std::vector<std::string> ddp_larc = {"config.OPTIMIZER.name=sgd_fsdp",
                                             "config.OPTIMIZER.use_larc=True"};
  CHECK(config_of(ddp_larc, "", 4).optimizer.larc.eps == doctest::Approx(0.5e-8));
  CHECK(config_of(ddp_larc, "", 1).optimizer.larc.eps == 1e-8f);
  // Under ZeRO the ranks' optimizers hold different parameters: VISSL's sums would mix them.
  CHECK_THROWS_WITH(
      config_of({"config.OPTIMIZER.name=sgd_fsdp", "config.OPTIMIZER.use_larc=True",
                 "config.OPTIMIZER.use_zero=True"}),
      doctest::Contains("config.OPTIMIZER.name = sgd_fsdp: VISSL's sgd_fsdp all-reduces the "
                        "norms of the parameters each rank's optimizer holds, which under ZeRO "
                        "(stage oss) differ"));
  // VISSL's FSDP task with LARC on flat units (one norm a unit) or apex's LARC (a shard's
  // norms) is refused with AUTO_SETUP_FSDP's settings as the fix; AUTO_SETUP_FSDP sets them.
  CHECK_THROWS_WITH(config_of({fsdp_larc[0], fsdp_larc[1], fsdp_larc[2]}),
                    doctest::Contains("config.MODEL.FSDP_CONFIG.flatten_parameters = True: under "
                                      "FSDP VISSL's LARC would take one norm per flat unit"));
  CHECK_THROWS_WITH(config_of({fsdp_larc[0], "config.OPTIMIZER.use_larc=True", fsdp_larc[3]}),
                    doctest::Contains("config.OPTIMIZER.name = sgd: under FSDP apex's LARC would "
                                      "take the norms of each rank's shard"));
  CHECK(
      config_of({"config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True", "config.OPTIMIZER.use_larc=True"})
          .optimizer.kind == sk::optim::OptimizerKind::larc_sgd);
  CHECK_THROWS_WITH(
      config_of({"config.OPTIMIZER.name=adam"}),
      doctest::Contains("implements sgd (with use_larc for LARC) and VISSL's sgd_fsdp"));
  // flatten_parameters either way; the collator's tensor packing ignored.
  CHECK_NOTHROW(config_of({"config.MODEL.FSDP_CONFIG.flatten_parameters=False"}));
  const auto collate =
      tree_of({"config.DATA.TRAIN.COLLATE_FUNCTION_PARAMS.create_multidimensional_tensor=True"});
  CHECK(std::find(collate.ignored().begin(), collate.ignored().end(),
                  "DATA.TRAIN.COLLATE_FUNCTION_PARAMS.create_multidimensional_tensor") !=
        collate.ignored().end());

  // AUTO_WRAP_THRESHOLD: under fsdp each convolution of a block with at least that many
  // parameters is a unit nested in the block's (ResNet-50: layer4's 3 x 3 convolutions, 2 359 296
  // each, and its first block's projection, 2 097 152); <= 0 is off.
  const auto wrap = config_of({"config.MODEL.FSDP_CONFIG.AUTO_SETUP_FSDP=True",
                               "config.MODEL.FSDP_CONFIG.AUTO_WRAP_THRESHOLD=2000000"});
  CHECK(config_of({"config.MODEL.FSDP_CONFIG.AUTO_WRAP_THRESHOLD=-1"}).fsdp_wrap_threshold == 0);
  {
    sk::Context ctx;
    const sk::DeferredParameters shapes_only(ctx);
    swav::SwavModel model(ctx, wrap);
    const auto paths = swav::rank_setup(model, wrap, 2).parallel.fsdp.wrap.unit_paths;
    CHECK(paths.size() == 16 + 4);  // (the 16 blocks and 4 convolutions)
    for (const char* nested : {"trunk.layer4.0.conv2", "trunk.layer4.0.downsample.0",
                               "trunk.layer4.1.conv2", "trunk.layer4.2.conv2"})
      CHECK_MESSAGE(std::find(paths.begin(), paths.end(), nested) != paths.end(), nested);
    CHECK(swav::fsdp_unit_paths(model, 0).size() == 16);
    // (layer4.0 with its convolution and projection: three units gathered at once)
    sk::parallel::PlannedRun planned;
    planned.parallel = swav::rank_setup(model, wrap, 2).parallel;
    planned.world_size = 2;
    CHECK(sk::parallel::module_planned_run(model, planned).unit_family == 3);
    // Smaller units, a smaller peak of gathered parameters: the plan holds a block, the unit
    // nested in it and the prefetched one, each at most a 3 x 3 convolution's size here.
    auto flat = wrap;
    flat.fsdp_wrap_threshold = 0;
    CHECK(swav::rank_setup(model, wrap, 2).memory.gathered <
          swav::rank_setup(model, flat, 2).memory.gathered);
  }

  // The projection head: any number of hidden widths (VISSL's dims), biases and the last
  // BatchNorm1d + ReLU as VISSL's use_bias and skip_last_bn say.
  const auto deep = config_of(
      {R"(config.MODEL.HEAD.PARAMS=[["swav_head", {"dims": [2048, 64, 48, 32], "use_bn": True, "use_bias": False, "skip_last_bn": False, "num_clusters": [30]}]])"});
  CHECK(deep.head_hidden == std::vector<std::int64_t>{64, 48});
  CHECK(deep.embedding_dim == 32);
  CHECK(
      config_of(
          {R"(config.MODEL.HEAD.PARAMS=[["swav_head", {"dims": [2048, 32], "num_clusters": [30]}]])"})
          .head_hidden.empty());
  CHECK_THROWS_WITH(
      config_of(
          {R"(config.MODEL.HEAD.PARAMS=[["swav_head", {"dims": [2048], "num_clusters": [30]}]])"}),
      doctest::Contains("give [trunk features, hidden widths (any number), embedding]"));
  {
    sk::Context ctx;
    const sk::DeferredParameters shapes_only(ctx);
    swav::SwavModel model(ctx, deep);
    std::vector<std::string> head;
    for (const auto& [name, p] : model.named_parameters())
      if (name.rfind("heads.", 0) == 0) head.push_back(name + " " + std::to_string(p.numel()));
    // Linear, BN, ReLU per width, the last BN and ReLU kept: VISSL's Sequential indices.
    CHECK(head ==
          std::vector<std::string>{
              "heads.0.projection_head.0.weight 131072", "heads.0.projection_head.1.weight 64",
              "heads.0.projection_head.1.bias 64", "heads.0.projection_head.3.weight 3072",
              "heads.0.projection_head.4.weight 48", "heads.0.projection_head.4.bias 48",
              "heads.0.projection_head.6.weight 1536", "heads.0.projection_head.7.weight 32",
              "heads.0.projection_head.7.bias 32", "heads.0.prototypes0.weight 960"});
  }

  // SEER's RegNet-10B model config (VISSL's pretrain/seer/models/regnet10B.yaml, its model,
  // optimizer and FSDP keys) reads as VISSL trains it.
  const auto seer = config_of({}, R"(config:
  TRAINER:
    TASK_NAME: self_supervision_fsdp_task
  DATA:
    TRAIN:
      COLLATE_FUNCTION_PARAMS:
        create_multidimensional_tensor: True
  MODEL:
    TRUNK:
      NAME: regnet_fsdp
      REGNET:
        block_type: res_bottleneck_block
        depth: 27
        group_width: 1010
        w_0: 1744
        w_a: 620.83
        w_m: 2.52
        stage_checkpoints: [[2], [7], [9, 17], []]
    HEAD:
      PARAMS: [
        ["swav_head_fsdp", {
          "dims": [28280, 8192, 8192, 256],
          "use_bn": False,
          "num_clusters": [16000]
        }],
      ]
    FSDP_CONFIG:
      AUTO_WRAP_THRESHOLD: 100000000
      flatten_parameters: False
      mixed_precision: True
      fp32_reduce_scatter: False
      compute_dtype: float16
    AMP_PARAMS:
      USE_AMP: True
      AMP_TYPE: "pytorch"
    ACTIVATION_CHECKPOINTING:
      USE_ACTIVATION_CHECKPOINTING: True
  LOSS:
    swav_loss:
      num_prototypes: [16000]
  OPTIMIZER:
    name: "sgd_fsdp"
    use_larc: True
    construct_single_param_group_only: True
    weight_decay: 0.00001
)",
                              16);
  CHECK(seer.parallel.stage == Stage::fsdp);
  CHECK(seer.single_param_group);
  CHECK(seer.optimizer.kind == sk::optim::OptimizerKind::larc_sgd);
  CHECK(seer.regnet_stages.back().width == 28280);
  CHECK(seer.head_hidden == std::vector<std::int64_t>{8192, 8192});
  CHECK(seer.fsdp_wrap_threshold == 100000000);
  CHECK(seer.parallel.precision.param_dtype == sk::DType::f16);
}

TEST_CASE("learning-rate schedules: VISSL's composite warm-up + cosine and auto-scaling") {
  // Defaults: linear 0.03 -> 0.3 over the first 10%, then cosine 0.3 -> 0.0003 (fixed: at the
  // global position).
  const auto d = config_of({});
  CHECK(d.lr.rate(0, 1000, 100) == doctest::Approx(0.03));
  CHECK(d.lr.rate(50, 1000, 100) == doctest::Approx(0.165));
  const double where = 0.5;
  CHECK(d.lr.rate(500, 1000, 100) ==
        doctest::Approx(0.0003 + 0.5 * (0.3 - 0.0003) * (1 + std::cos(3.14159265358979 * where))));
  CHECK(d.lr.rate(999, 1000, 100) == doctest::Approx(0.0003).epsilon(0.01));
  // Per epoch: constant within an epoch.
  const auto e = config_of({"config.OPTIMIZER.param_schedulers.lr.update_interval=epoch"});
  CHECK(e.lr.rate(150, 1000, 100) == e.lr.rate(100, 1000, 100));
  // Auto-scaling (VISSL's swav_8node example, scaled down): base 0.3 at 256; 2 ranks x 64 =
  // 128 -> 0.15; the warm-up would start at 0.3 x 128/256 = 0.15 >= its end on one node, so it
  // is dropped and the cosine covers the whole run from 0.15 to 0.15 x 0.001.
  const auto a = config_of({"config.OPTIMIZER.param_schedulers.lr.auto_lr_scaling.auto_scale=True",
                            "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=64"});
  REQUIRE(a.lr.parts.size() == 1);
  CHECK(a.lr.rate(0, 1000, 100) == doctest::Approx(0.15));
  CHECK(a.lr.rate(1000, 1000, 100) == doctest::Approx(0.00015));
  // On 4 nodes the warm-up stays: from the per-node scaled rate to the global one.
  const auto n = config_of({"config.OPTIMIZER.param_schedulers.lr.auto_lr_scaling.auto_scale=True",
                            "config.DISTRIBUTED.NUM_NODES=4"},
                           "", 8);
  REQUIRE(n.lr.parts.size() == 2);
  CHECK(n.lr.rate(0, 1000, 100) == doctest::Approx(0.3 * 64 / 256));
  CHECK(n.lr.parts[0].end_value == doctest::Approx(0.3 * 256 / 256));
  // VISSL's cosine_warm_restart, against VISSL's CosineWarmRestartScheduler itself (its file
  // run with numpy.arange and ClassyVision's base class stubbed) at 0, 0.2, 0.334, 0.5, 0.7,
  // 0.9 and 0.999: a full wave restarting at 0.334 with adaptive peaks (SwAV's
  // bs64_8node_cos_1restart_full_adaptive), a half wave restarting at 0.5, adaptive, and a half
  // wave every 0.3 whose peaks halve.
  const double points[] = {0.0, 0.2, 0.334, 0.5, 0.7, 0.9, 0.999};
  const struct {
    double start, end, interval;
    bool full, adaptive;
    double multiplier;
    double expected[7];
  } waves[] = {
      {4.8,
       0.0048,
       0.334,
       true,
       true,
       1.0,
       {3.5968486085619626, 1.2522527947633688, 0.0048, 0.594259507130235, 1.1681611667209206,
        0.25829144794430803, 0.005036891084353718}},
      {4.8,
       0.0048,
       0.5,
       false,
       true,
       1.0,
       {4.8, 3.1432991457133737, 1.1949130117580997, 2.4023999999999996, 1.574049572856687,
        0.2337504271433131, 0.004823663285662826}},
      {1.0,
       0.01,
       0.3,
       false,
       false,
       0.5,
       {1.0, 0.2574999999999999, 0.4846340874255134, 0.13249999999999995, 0.19000000000000006,
        0.125, 0.09676988140564632}},
  };
  for (const auto& w : waves) {
    swav::Schedule wave;
    wave.name = "cosine_warm_restart";
    wave.start_value = w.start;
    wave.end_value = w.end;
    wave.restart_interval_length = w.interval;
    wave.full_wave = w.full;
    wave.is_adaptive = w.adaptive;
    wave.lr_multiplier = w.multiplier;
    for (int i = 0; i < 7; ++i)
      CHECK_MESSAGE(wave.at(points[i]) == doctest::Approx(w.expected[i]).epsilon(1e-12),
                    "interval ", w.interval, " at ", points[i]);
  }
  // Read as VISSL's optimization file writes it, and auto-scaled as a cosine (VISSL: "cosine"
  // in the name): base 0.3 at 256 images, here 8 ranks x 32.
  const auto restart = config_of(
      {"config.OPTIMIZER.param_schedulers.lr.auto_lr_scaling.auto_scale=True",
       "config.DISTRIBUTED.NUM_NODES=4", "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=32",
       "config.OPTIMIZER.param_schedulers.lr.schedulers=[{name: linear, start_value: 0.6, "
       "end_value: 4.8}, {name: cosine_warm_restart, start_value: 4.8, end_value: 0.0048, "
       "restart_interval_length: 0.334, wave_type: full, is_adaptive: True}]",
       "config.OPTIMIZER.param_schedulers.lr.interval_scaling=[rescaled, rescaled]"},
      "", 8);
  REQUIRE(restart.lr.parts.size() == 2);
  CHECK(restart.lr.parts[1].start_value == doctest::Approx(0.3));
  CHECK(restart.lr.parts[1].end_value == doctest::Approx(0.0003));
  // (at 10% + 0.9 x 0.5 the part's own 0.5: the first wave's 0.594... scaled by 0.3 / 4.8)
  CHECK(restart.lr.at(0.1 + 0.9 * 0.5) == doctest::Approx(0.594259507130235 / 16).epsilon(1e-9));
  CHECK_THROWS_WITH(
      config_of({"config.OPTIMIZER.param_schedulers.lr.schedulers=[{name: cosine_warm_restart, "
                 "start_value: 1.0, end_value: 0.1}, {name: cosine, start_value: 1.0, "
                 "end_value: 0.1}]"}),
      doctest::Contains("cosine_warm_restart needs restart_interval_length"));
  CHECK_THROWS_WITH(
      config_of({"config.OPTIMIZER.param_schedulers.lr.schedulers=[{name: linear, start_value: "
                 "0.1, end_value: 1.0}, {name: cosine_warm_restart, start_value: 1.0, end_value: "
                 "0.1, restart_interval_length: 0.5, wave_type: triangle}]"}),
      doctest::Contains("wave_type = triangle: use half or full"));
  // A rate below 0 (a cosine ending at -0.01) or not a number (a cosine from 0 auto-scaled:
  // 0 / 0) is refused by key when the config is read -- it stopped the run at the step that
  // first reached it, with the optimizer's message and no key.
  CHECK_THROWS_WITH(
      config_of({"config.OPTIMIZER.param_schedulers.lr.schedulers=[{name: linear, start_value: "
                 "0.03, end_value: 0.3}, {name: cosine, start_value: 0.3, end_value: -0.01}]"}),
      doctest::Contains("config.OPTIMIZER.param_schedulers.lr.schedulers[1] = 0.300000 -> "
                        "-0.010000: learning rates must be finite and >= 0"));
  CHECK_THROWS_WITH(
      config_of({"config.OPTIMIZER.param_schedulers.lr.auto_lr_scaling.auto_scale=True",
                 "config.OPTIMIZER.param_schedulers.lr.schedulers=[{name: linear, start_value: "
                 "0.0, end_value: 0.3}, {name: cosine, start_value: 0.0, end_value: 0.0}]"}),
      doctest::Contains("give a start_value > 0"));
  // One node: the warm-up's start (the per-node scaled rate) is the scaled rate itself, so the
  // warm-up goes, as VISSL computes both: base x (batch / base batch). Formed in another order,
  // 0.1 x 96 / 384 came out one ulp above 0.1 x (96 / 384) and the warm-up stayed.
  const auto ulp =
      config_of({"config.OPTIMIZER.param_schedulers.lr.auto_lr_scaling.auto_scale=True",
                 "config.OPTIMIZER.param_schedulers.lr.auto_lr_scaling.base_value=0.1",
                 "config.OPTIMIZER.param_schedulers.lr.auto_lr_scaling."
                 "base_lr_batch_size=384",
                 "config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=48"});
  CHECK(ulp.lr.parts.size() == 1);
  // ClassyVision's tolerance for lengths that do not quite sum to 1 (1e-3), the last made up.
  const auto near = config_of({"config.OPTIMIZER.param_schedulers.lr.lengths=[0.1, 0.8995]"});
  CHECK(near.lr.lengths[1] == doctest::Approx(0.9).epsilon(1e-15));
  // A single scheduler takes what it leaves out from VISSL's defaults (start 0.1, end 0.0,
  // value 0.1), not from the composite's parts: a cosine ended at 0.0003, a constant ran at 0.3.
  const auto cosine = config_of({"config.OPTIMIZER.param_schedulers.lr.name=cosine",
                                 "config.OPTIMIZER.param_schedulers.lr.start_value=0.6"});
  REQUIRE(cosine.lr.parts.size() == 1);
  CHECK(cosine.lr.parts[0].start_value == doctest::Approx(0.6));
  CHECK(cosine.lr.parts[0].end_value == 0.0);
  const auto constant = config_of({"config.OPTIMIZER.param_schedulers.lr.name=constant"});
  REQUIRE(constant.lr.parts.size() == 1);
  CHECK(constant.lr.parts[0].value == doctest::Approx(0.1));
  // A value left out or misspelt is refused (ClassyVision asserts them), not taken as 0.
  CHECK_THROWS_WITH(
      config_of({"config.OPTIMIZER.param_schedulers.lr.schedulers=[{name: linear, start_value: "
                 "0.03, end_value: 0.3}, {name: cosine, end_value: 0.0003}]"}),
      doctest::Contains("a cosine scheduler needs start_value and end_value (ClassyVision's); "
                        "start_value is missing"));
  CHECK_THROWS_WITH(
      config_of({"config.OPTIMIZER.param_schedulers.lr.schedulers=[{name: linear, start_value: "
                 "0.03, end_value: 0.3}, {name: cosine, start_value: 0.3, end_valeu: 0.0003}]"}),
      doctest::Contains("end_value is missing"));
  // A part that is not a map is refused by its place, not by yaml-cpp's BadSubscript (found by
  // fuzz_swav_config).
  CHECK_THROWS_WITH_AS(
      config_of({"config.OPTIMIZER.param_schedulers.lr.schedulers=[0, [1]]"}),
      doctest::Contains("config.OPTIMIZER.param_schedulers.lr.schedulers[0] = 0: each scheduler "
                        "is a map"),
      swav::ConfigError);
}

TEST_CASE("every shipped config reads, alone and on top of the quick one") {
  using sk::parallel::Stage;
  const std::string dir = SWAV_CONFIGS;
  auto read = [&](const std::vector<std::string>& files) {
    swav::ConfigTree tree(swav::kDefaultsYaml);
    for (const auto& f : files) tree.merge_file(dir + "/" + f);
    return swav::read_swav_config(tree, 2);
  };
  int count = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    CAPTURE(name);
    CHECK_NOTHROW((void)read({name}));
    CHECK_NOTHROW((void)read({"quick_cpu.yaml", name}));
    ++count;
  }
  CHECK(count >= 5);
  CHECK(read({"quick_cpu.yaml", "zero1_oss.yaml"}).parallel.stage == Stage::oss);
  CHECK(read({"quick_cpu.yaml", "zero2_sdp.yaml"}).parallel.stage == Stage::sdp);
  const auto fsdp = read({"quick_cpu.yaml", "zero3_fsdp.yaml"});
  CHECK(fsdp.parallel.stage == Stage::fsdp);
  CHECK(fsdp.parallel.precision.param_dtype == sk::DType::bf16);
  CHECK(fsdp.checkpoint_splits == 8);
}
