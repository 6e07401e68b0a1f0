// Weighted kNN (knn.hpp): the similarities are matrix products of tiles, each a task of the
// rank's pool on one thread.
//
// The floor is the products: 2 * queries * bank * dim flops (for the long CPU config's res3,
// 2 x 10 000 x 60 000 x 1152 = 1.4 TFLOP; the vote's top-k is one pass over the similarities).
// A task takes 128 queries against the bank in chunks of 4080 rows: the bank is packed for the
// product once per 128 queries (blocks of 64 against the whole bank spent a fifth of the
// evaluation re-packing it), and a chunk's 2 MB of similarities stays in cache for the vote.
// Each task's product runs on its own thread (oneDNN's sgemm with one OpenMP thread, or Eigen
// built without its own threading), so the bits of a similarity do not depend on how many
// threads the pool has. They may depend on the query's place in its block (oneDNN's kernels
// differ there in the last bits): the blocks start at the run's first query, so a split of the
// queries between ranks (the raw-pixel figure) can move a similarity's last bit -- the vote has
// not been seen to change with it (check_swav.py compares 1, 2 and 3 ranks) -- while the
// network's sharded bank asks every shard all the queries in the same blocks, and there the
// merged lists are the whole bank's bit for bit.
#define EIGEN_DONT_PARALLELIZE
#include "knn.hpp"

#include <Eigen/Dense>

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "shardkit/core/config.hpp"
#if SK_WITH_DNNL
#include <omp.h>

#include "shardkit/core/dnnl_check.hpp"
#endif

namespace swav {
namespace {

constexpr std::int64_t kQueryBlock = 128;  // queries per task

// out[rows x cols] (rows `out_stride` apart) = queries[rows x dim] * bank[cols x dim]^T,
// row-major, on the calling thread.
void product(const float* queries, std::int64_t rows, const float* bank, std::int64_t cols,
             std::int64_t dim, float* out, std::int64_t out_stride) {
#if SK_WITH_DNNL
  // oneDNN picks the widest vector unit at run time (Eigen's is fixed when compiling). One
  // OpenMP thread for this product, then the calling thread's setting back (a pool of one
  // thread runs its tasks on the rank's own thread).
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const dnnl_status_t status =
      dnnl_sgemm('N', 'T', rows, cols, dim, 1.0f, queries, dim, bank, dim, 0.0f, out, out_stride);
  omp_set_num_threads(threads);
  shardkit::detail::dnnl_check(status, "dnnl_sgemm (the kNN similarities)", __FILE__, __LINE__);
#else
  using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  const Eigen::Map<const Matrix> q(queries, rows, dim);
  const Eigen::Map<const Matrix> b(bank, cols, dim);
  Eigen::Map<Matrix, 0, Eigen::OuterStride<> >(out, rows, cols, Eigen::OuterStride<>(out_stride))
      .noalias() = q * b.transpose();
#endif
}

// out[rows x cols] = queries[rows x dim] * bank[cols x dim]^T, row-major, on the calling thread,
// in products of whole panels of kPanel bank rows (the last rows as the end of a panel that
// overlaps the one before, or, fewer than a panel, followed by zero rows).
// GEMM kernels compute the last few rows of a panel by other code than the rest (Eigen sums a
// 1-packet tail's products in two interleaved halves), so a similarity computed as one of a
// product's last rows can differ in its last bits from the same one computed inside a bigger
// product. In whole panels every similarity takes the same path wherever its row lies in a
// chunk, and a bank's shards give the whole bank's bits (test_swav checks this on each build).
constexpr std::int64_t kPanel = 48;               // 3 packets of AVX-512 floats, 6 of AVX2's
constexpr std::int64_t kBankChunk = 85 * kPanel;  // bank rows per product (4080)

void similarities(const float* queries, std::int64_t rows, const float* bank, std::int64_t cols,
                  std::int64_t dim, float* out) {
  const std::int64_t whole = cols / kPanel * kPanel;
  if (whole > 0) product(queries, rows, bank, whole, dim, out, cols);
  if (whole == cols) return;
  const std::int64_t tail = cols - whole;
  std::vector<float> scores(static_cast<std::size_t>(rows * kPanel));
  if (cols >= kPanel) {
    // The last rows as the end of a whole panel read in place (its first rows, computed again,
    // are dropped): no copy of the bank's rows, which can be wide (raw pixels: 600 kB a row).
    product(queries, rows, bank + (cols - kPanel) * dim, kPanel, dim, scores.data(), kPanel);
    for (std::int64_t r = 0; r < rows; ++r)
      std::copy_n(scores.data() + r * kPanel + (kPanel - tail), tail, out + r * cols + whole);
    return;
  }
  std::vector<float> panel(static_cast<std::size_t>(kPanel * dim), 0.0f);  // (fewer rows than
  std::copy(bank, bank + cols * dim, panel.begin());                       // a panel: padded)
  product(queries, rows, panel.data(), kPanel, dim, scores.data(), kPanel);
  for (std::int64_t r = 0; r < rows; ++r)
    std::copy_n(scores.data() + r * kPanel, tail, out + r * cols + whole);
}

// The k best (similarity, bank index) pairs offered so far, a heap whose front is the worst
// kept, in the lists' order (knn.hpp: the higher similarity, then the lower index).
class TopK {
 public:
  explicit TopK(std::int64_t k) : items_(static_cast<std::size_t>(k)) {}

  void offer(float s, std::int64_t j) {
    if (std::isnan(s)) s = -std::numeric_limits<float>::infinity();  // (one order for the heap)
    if (size_ < items_.size()) {
      items_[size_++] = {s, j};
      std::push_heap(items_.begin(), items_.begin() + static_cast<std::ptrdiff_t>(size_), better);
    } else if (!items_.empty() && better({s, j}, items_.front())) {
      std::pop_heap(items_.begin(), items_.end(), better);
      items_.back() = {s, j};
      std::push_heap(items_.begin(), items_.end(), better);
    }
  }
  // Whether a similarity offered after every kept one's index cannot be kept: the list is full
  // and it is not above the worst kept (the vote's hot loop, one comparison a similarity).
  bool rejects_later(float s) const {
    return size_ == items_.size() && !(s > items_.front().first);
  }
  // The kept pairs best first into k slots (the rest left as they are: -inf and -1).
  void write(float* similarity, std::int64_t* index) {
    const auto end = items_.begin() + static_cast<std::ptrdiff_t>(size_);
    std::sort_heap(items_.begin(), end, better);
    for (std::size_t i = 0; i < size_; ++i) {
      similarity[i] = items_[i].first;
      index[i] = items_[i].second;
    }
  }

 private:
  using Item = std::pair<float, std::int64_t>;
  static bool better(const Item& a, const Item& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  }
  std::vector<Item> items_;
  std::size_t size_ = 0;
};

Neighbours empty_lists(std::int64_t rows, int k) {
  Neighbours out;
  out.k = k;
  out.similarity.assign(static_cast<std::size_t>(rows * k),
                        -std::numeric_limits<float>::infinity());
  out.index.assign(static_cast<std::size_t>(rows * k), -1);
  return out;
}

}  // namespace

Neighbours knn_nearest(const std::vector<float>& bank, std::int64_t bank_first,
                       const float* queries, std::int64_t rows, std::int64_t dim, int k,
                       shardkit::ThreadPool& pool) {
  const std::int64_t n = static_cast<std::int64_t>(bank.size()) / dim;
  const std::int64_t kept = std::min<std::int64_t>(k, n);
  Neighbours out = empty_lists(rows, k);
  const std::int64_t blocks = (rows + kQueryBlock - 1) / kQueryBlock;
  pool.parallel_for(blocks, [&](std::int64_t block) {
    const std::int64_t q0 = block * kQueryBlock;
    const std::int64_t block_rows = std::min(kQueryBlock, rows - q0);
    std::vector<TopK> top(static_cast<std::size_t>(block_rows), TopK(kept));
    std::vector<float> sim(static_cast<std::size_t>(block_rows * std::min(kBankChunk, n)));
    // Chunks [g, end) of the whole bank's grid, as far as this bank (shard) reaches.
    for (std::int64_t g = bank_first; g < bank_first + n;) {
      const std::int64_t end = std::min((g / kBankChunk + 1) * kBankChunk, bank_first + n);
      const std::int64_t cols = end - g;
      similarities(queries + q0 * dim, block_rows, bank.data() + (g - bank_first) * dim, cols, dim,
                   sim.data());
      for (std::int64_t r = 0; r < block_rows; ++r) {
        const float* s = sim.data() + r * cols;
        auto& t = top[static_cast<std::size_t>(r)];
        for (std::int64_t j = 0; j < cols; ++j)
          if (!t.rejects_later(s[j])) t.offer(s[j], g + j);
      }
      g = end;
    }
    for (std::int64_t r = 0; r < block_rows; ++r)
      top[static_cast<std::size_t>(r)].write(out.similarity.data() + (q0 + r) * k,
                                             out.index.data() + (q0 + r) * k);
  });
  return out;
}

Neighbours knn_merge(const std::vector<float>& similarity, const std::vector<std::int64_t>& index,
                     std::int64_t parts, std::int64_t rows, std::int64_t k_in, int k) {
  Neighbours out = empty_lists(rows, k);
  for (std::int64_t q = 0; q < rows; ++q) {
    TopK top(k);
    for (std::int64_t p = 0; p < parts; ++p)
      for (std::int64_t j = 0; j < k_in; ++j) {
        const auto at = static_cast<std::size_t>((p * rows + q) * k_in + j);
        if (index[at] >= 0) top.offer(similarity[at], index[at]);
      }
    top.write(out.similarity.data() + q * k, out.index.data() + q * k);
  }
  return out;
}

int knn_vote(const Neighbours& nearest, std::int64_t row,
             const std::vector<std::int32_t>& bank_labels, double sigma, int classes) {
  std::vector<double> votes(static_cast<std::size_t>(classes), 0.0);
  for (std::int64_t i = row * nearest.k; i < (row + 1) * nearest.k; ++i) {
    const std::int64_t j = nearest.index[static_cast<std::size_t>(i)];
    if (j < 0) break;
    votes[static_cast<std::size_t>(bank_labels[static_cast<std::size_t>(j)])] +=
        std::exp(double(nearest.similarity[static_cast<std::size_t>(i)]) / sigma);
  }
  return static_cast<int>(std::max_element(votes.begin(), votes.end()) - votes.begin());
}

std::int64_t knn_correct(const std::vector<float>& bank,
                         const std::vector<std::int32_t>& bank_labels,
                         const std::vector<float>& queries,
                         const std::vector<std::int32_t>& query_labels, std::int64_t dim,
                         std::int64_t first, std::int64_t last, int k, double sigma,
                         shardkit::ThreadPool& pool, int classes, std::int64_t queries_first) {
  if (last <= first) return 0;
  const Neighbours nearest = knn_nearest(bank, 0, queries.data() + (first - queries_first) * dim,
                                         last - first, dim, k, pool);
  return knn_votes_correct(nearest, bank_labels, query_labels, first, sigma, classes);
}

std::int64_t knn_votes_correct(const Neighbours& nearest,
                               const std::vector<std::int32_t>& bank_labels,
                               const std::vector<std::int32_t>& query_labels, std::int64_t first,
                               double sigma, int classes) {
  const auto rows =
      static_cast<std::int64_t>(nearest.index.size()) / std::max<std::int64_t>(nearest.k, 1);
  std::int64_t correct = 0;
  for (std::int64_t r = 0; r < rows; ++r)
    correct += knn_vote(nearest, r, bank_labels, sigma, classes) ==
               query_labels[static_cast<std::size_t>(first + r)];
  return correct;
}

}  // namespace swav
