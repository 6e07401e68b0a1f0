// Weighted k-nearest-neighbour accuracy, as VISSL's nearest-neighbour benchmark (after
// InstDisc) computes it: features L2-normalised, cosine similarity of each test feature to the
// memory bank of training features, the k most similar vote for their labels with weight
// exp(similarity / sigma), the class with the largest summed weight is the prediction.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "shardkit/core/thread_pool.hpp"

namespace swav {

inline void l2_normalize_rows(std::vector<float>& features, std::int64_t dim) {
  const std::int64_t rows = static_cast<std::int64_t>(features.size()) / dim;
  for (std::int64_t r = 0; r < rows; ++r) {
    float* f = features.data() + r * dim;
    double s = 0;
    for (std::int64_t d = 0; d < dim; ++d) s += double(f[d]) * f[d];
    const double inv = 1.0 / std::max(std::sqrt(s), 1e-12);
    for (std::int64_t d = 0; d < dim; ++d) f[d] = static_cast<float>(f[d] * inv);
  }
}

// The k most similar bank rows to each of a run of queries, best first. "Best" is one total
// order -- the higher similarity, and of equal similarities the lower bank index -- so that the
// lists of a bank's shards merge (knn_merge) into exactly the whole bank's list, and the vote
// sums its weights in one order wherever the lists were made.
struct Neighbours {
  std::int64_t k = 0;               // entries per query
  std::vector<float> similarity;    // queries x k; past a bank (shard) of fewer than k rows:
  std::vector<std::int64_t> index;  // -inf and -1
};

// The k nearest rows of `bank` (a whole bank, or a shard whose first row is the bank's row
// `bank_first`: the indices are the whole bank's) to each of the `rows` queries at `queries`,
// blocks of queries spread over `pool`'s threads (knn.cpp: compiled by the host compiler in
// every build; the products run on oneDNN's sgemm where the build has it, else on Eigen). Each
// product runs on one thread, over chunks of the bank on one grid counted from the whole bank's
// first row, in blocks of queries from the first: the lists do not depend on the threads, nor on
// how the bank is split into shards (knn.cpp says what a split of the queries may change).
Neighbours knn_nearest(const std::vector<float>& bank, std::int64_t bank_first,
                       const float* queries, std::int64_t rows, std::int64_t dim, int k,
                       shardkit::ThreadPool& pool);

// The k best of `parts` lists per query: lists[(p * rows + q) * k_in ...] holds part p's list
// for query q (as an all-to-all of every shard's lists delivers them), -1 indices ignored.
Neighbours knn_merge(const std::vector<float>& similarity, const std::vector<std::int64_t>& index,
                     std::int64_t parts, std::int64_t rows, std::int64_t k_in, int k);

// The class the weighted vote of query `row`'s list predicts (the first largest on a tie).
int knn_vote(const Neighbours& nearest, std::int64_t row,
             const std::vector<std::int32_t>& bank_labels, double sigma, int classes);

// How many of the queries whose lists are `nearest`'s rows the lists' votes classify as their
// labels say: row r is query first + r, its label query_labels[first + r].
std::int64_t knn_votes_correct(const Neighbours& nearest,
                               const std::vector<std::int32_t>& bank_labels,
                               const std::vector<std::int32_t>& query_labels, std::int64_t first,
                               double sigma, int classes);

// How many of queries [first, last) the whole bank classifies correctly (knn_nearest and
// knn_vote). `queries` holds the queries from `queries_first` on (a rank's share alone:
// queries_first == first); `query_labels` every query's. The count is the same on any number of
// threads; a split of the queries may move a similarity's last bit (knn.cpp).
std::int64_t knn_correct(const std::vector<float>& bank,
                         const std::vector<std::int32_t>& bank_labels,
                         const std::vector<float>& queries,
                         const std::vector<std::int32_t>& query_labels, std::int64_t dim,
                         std::int64_t first, std::int64_t last, int k, double sigma,
                         shardkit::ThreadPool& pool, int classes = 10,
                         std::int64_t queries_first = 0);

}  // namespace swav
