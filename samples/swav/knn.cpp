// Weighted kNN (knn.hpp): the similarities are matrix products of tiles, each a task of the
// rank's pool on one thread.
//
// The floor is the products: 2 * queries * bank * dim flops (for the long CPU config's res3,
// 2 x 10 000 x 60 000 x 1152 = 1.4 TFLOP; the vote's top-k is one pass over the similarities).
// A task takes 128 queries against the bank in chunks of 4096 rows: the bank is packed for the
// product once per 128 queries (blocks of 64 against the whole bank spent a fifth of the
// evaluation re-packing it), and a chunk's 2 MB of similarities stays in cache for the vote.
// Each task's product runs on its own thread (oneDNN's sgemm with one OpenMP thread, or Eigen
// built without its own threading), so the bits of a similarity do not depend on how many
// threads the pool has or on how the queries are split between tasks or ranks.
#define EIGEN_DONT_PARALLELIZE
#include "knn.hpp"

#include <Eigen/Dense>

#include <algorithm>
#include <cmath>
#include <utility>

#include "shardkit/core/config.hpp"
#if SK_WITH_DNNL
#include <omp.h>

#include "shardkit/core/dnnl_check.hpp"
#endif

namespace swav {
namespace {

constexpr std::int64_t kQueryBlock = 128;  // queries per task
constexpr std::int64_t kBankChunk = 4096;  // bank rows per product

// out[rows x cols] = queries[rows x dim] * bank[cols x dim]^T, row-major, on the calling thread.
void similarities(const float* queries, std::int64_t rows, const float* bank, std::int64_t cols,
                  std::int64_t dim, float* out) {
#if SK_WITH_DNNL
  // oneDNN picks the widest vector unit at run time (Eigen's is fixed when compiling). One
  // OpenMP thread for this product, then the calling thread's setting back (a pool of one
  // thread runs its tasks on the rank's own thread).
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const dnnl_status_t status =
      dnnl_sgemm('N', 'T', rows, cols, dim, 1.0f, queries, dim, bank, dim, 0.0f, out, cols);
  omp_set_num_threads(threads);
  shardkit::detail::dnnl_check(status, "dnnl_sgemm (the kNN similarities)", __FILE__, __LINE__);
#else
  using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const Eigen::Map<const Matrix> q(queries, rows, dim);
  const Eigen::Map<const Matrix> b(bank, cols, dim);
  Eigen::Map<Matrix>(out, rows, cols).noalias() = q * b.transpose();
#endif
}

// The k best (similarity, bank index) pairs seen so far, a min-heap; candidates come in
// increasing index order, and an equal similarity does not displace an earlier index.
struct TopK {
  std::vector<std::pair<float, std::int64_t>> items;
  std::size_t size = 0;

  static bool worse(const std::pair<float, std::int64_t>& a,
                    const std::pair<float, std::int64_t>& b) {
    return a.first > b.first;
  }
  void offer(float s, std::int64_t j) {
    if (size < items.size()) {
      items[size++] = {s, j};
      std::push_heap(items.begin(), items.begin() + static_cast<std::ptrdiff_t>(size), worse);
    } else if (s > items.front().first) {
      std::pop_heap(items.begin(), items.end(), worse);
      items.back() = {s, j};
      std::push_heap(items.begin(), items.end(), worse);
    }
  }
};

}  // namespace

std::int64_t knn_correct(const std::vector<float>& bank,
                         const std::vector<std::int32_t>& bank_labels,
                         const std::vector<float>& queries,
                         const std::vector<std::int32_t>& query_labels, std::int64_t dim,
                         std::int64_t first, std::int64_t last, int k, double sigma,
                         shardkit::ThreadPool& pool, int classes, std::int64_t queries_first) {
  const std::int64_t n = static_cast<std::int64_t>(bank_labels.size());
  const std::int64_t kk = std::min<std::int64_t>(k, n);
  const std::int64_t blocks = last > first ? (last - first + kQueryBlock - 1) / kQueryBlock : 0;
  std::vector<std::int64_t> correct(static_cast<std::size_t>(blocks), 0);
  pool.parallel_for(blocks, [&](std::int64_t block) {
    const std::int64_t q0 = first + block * kQueryBlock;
    const std::int64_t rows = std::min(kQueryBlock, last - q0);
    std::vector<TopK> top(static_cast<std::size_t>(rows));
    for (auto& t : top) t.items.resize(static_cast<std::size_t>(kk));
    std::vector<float> sim(static_cast<std::size_t>(rows * std::min(kBankChunk, n)));
    for (std::int64_t c0 = 0; c0 < n; c0 += kBankChunk) {
      const std::int64_t cols = std::min(kBankChunk, n - c0);
      similarities(queries.data() + (q0 - queries_first) * dim, rows, bank.data() + c0 * dim, cols,
                   dim, sim.data());
      for (std::int64_t r = 0; r < rows; ++r) {
        const float* s = sim.data() + r * cols;
        auto& t = top[static_cast<std::size_t>(r)];
        for (std::int64_t j = 0; j < cols; ++j) t.offer(s[j], c0 + j);
      }
    }
    std::vector<double> votes(static_cast<std::size_t>(classes));
    for (std::int64_t r = 0; r < rows; ++r) {
      const auto& t = top[static_cast<std::size_t>(r)];
      std::fill(votes.begin(), votes.end(), 0.0);
      for (std::size_t i = 0; i < t.size; ++i)
        votes[bank_labels[static_cast<std::size_t>(t.items[i].second)]] +=
            std::exp(double(t.items[i].first) / sigma);
      const auto predicted = std::max_element(votes.begin(), votes.end()) - votes.begin();
      if (predicted == query_labels[static_cast<std::size_t>(q0 + r)])
        ++correct[static_cast<std::size_t>(block)];
    }
  });
  std::int64_t total = 0;
  for (const auto c : correct) total += c;
  return total;
}

}  // namespace swav
