// Weighted kNN (knn.hpp) on Eigen's matrix product.
//
// The products run inside tasks of the rank's pool, one per block of queries; Eigen's own
// OpenMP threading (in builds with OpenMP) would split each product differently depending on
// whether it runs inside a task, and so could change the last bits of a similarity.
#define EIGEN_DONT_PARALLELIZE
#include "knn.hpp"

#include <Eigen/Dense>

#include <algorithm>
#include <cmath>
#include <utility>

namespace swav {

// How many of queries [first, last) the bank classifies correctly.
std::int64_t knn_correct(const std::vector<float>& bank,
                         const std::vector<std::uint8_t>& bank_labels,
                         const std::vector<float>& queries,
                         const std::vector<std::uint8_t>& query_labels, std::int64_t dim,
                         std::int64_t first, std::int64_t last, int k, double sigma,
                         shardkit::ThreadPool& pool, int classes) {
  using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const std::int64_t n = static_cast<std::int64_t>(bank_labels.size());
  const Eigen::Map<const Matrix> b(bank.data(), n, dim);
  const std::int64_t kk = std::min<std::int64_t>(k, n);
  // Blocks of 64 queries: one 64 x n product each (15 MB of similarities for a 60 000-image
  // bank), a task of the pool each.
  constexpr std::int64_t kChunk = 64;
  const std::int64_t blocks = last > first ? (last - first + kChunk - 1) / kChunk : 0;
  std::vector<std::int64_t> correct(static_cast<std::size_t>(blocks), 0);
  pool.parallel_for(blocks, [&](std::int64_t block) {
    const std::int64_t q0 = first + block * kChunk;
    const std::int64_t rows = std::min(kChunk, last - q0);
    const Eigen::Map<const Matrix> q(queries.data() + q0 * dim, rows, dim);
    const Matrix sim = q * b.transpose();
    std::vector<std::pair<float, std::int64_t>> top(static_cast<std::size_t>(kk));
    std::vector<double> votes(static_cast<std::size_t>(classes));
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* s = sim.data() + r * n;
      // The kk largest similarities (a min-heap of the best so far).
      auto worse = [](const auto& a, const auto& c) { return a.first > c.first; };
      std::size_t size = 0;
      for (std::int64_t j = 0; j < n; ++j) {
        if (size < top.size()) {
          top[size++] = {s[j], j};
          std::push_heap(top.begin(), top.begin() + static_cast<std::ptrdiff_t>(size), worse);
        } else if (s[j] > top.front().first) {
          std::pop_heap(top.begin(), top.end(), worse);
          top.back() = {s[j], j};
          std::push_heap(top.begin(), top.end(), worse);
        }
      }
      std::fill(votes.begin(), votes.end(), 0.0);
      for (std::size_t i = 0; i < size; ++i)
        votes[bank_labels[static_cast<std::size_t>(top[i].second)]] +=
            std::exp(double(top[i].first) / sigma);
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
