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

// How many of queries [first, last) the bank classifies correctly, blocks of queries spread
// over `pool`'s threads (knn.cpp: compiled by the host compiler in every build; the products
// run on oneDNN's sgemm where the build has it, else on Eigen). Each query's vote is its own
// and each product runs on one thread, so the count is the same on any number of threads and
// any split of the queries. `queries` holds the queries from `queries_first` on (a rank's share
// alone: queries_first == first); `query_labels` every query's.
std::int64_t knn_correct(const std::vector<float>& bank,
                         const std::vector<std::int32_t>& bank_labels,
                         const std::vector<float>& queries,
                         const std::vector<std::int32_t>& query_labels, std::int64_t dim,
                         std::int64_t first, std::int64_t last, int k, double sigma,
                         shardkit::ThreadPool& pool, int classes = 10,
                         std::int64_t queries_first = 0);

}  // namespace swav
