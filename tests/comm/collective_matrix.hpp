// The collective test matrix shared by the local (CPU and GPU), MPI and NCCL tests: every
// collective and form x one dtype x a few counts, on whatever memory the rank's Context has,
// against a reference computed here from inputs every rank can regenerate for every other rank.
//
// Two references: the fixed rank-order reduction written out independently of the library
// (bit-exact check, for the local backend), and the exact sum in double with a rounding bound
// (for MPI and NCCL, whose reduction order is their own).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <string>
#include <type_traits>
#include <vector>

#include "shardkit/comm/communicator.hpp"
#include "shardkit/core/tensor_ops.hpp"

namespace shardkit::comm::testing {

namespace sk = shardkit;

// Deterministic inputs, never zero: magnitudes in [0.25, 2), random sign.
inline double input_value(int rank, std::size_t i, std::uint64_t salt) {
  std::uint64_t z = salt * 0x9E3779B97F4A7C15ull +
                    static_cast<std::uint64_t>(rank) * 0xBF58476D1CE4E5B9ull +
                    i * 0x94D049BB133111EBull + 0x2545F4914F6CDD1Dull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  const double unit = static_cast<double>(z >> 11) * 0x1p-53;  // [0, 1)
  const double magnitude = 0.25 + 1.75 * unit;
  return (z & 1) ? -magnitude : magnitude;
}

template <class T>
double to_double(T v) {
  if constexpr (std::is_same_v<T, Half> || std::is_same_v<T, BFloat16>)
    return static_cast<double>(v.to_float());
  else
    return static_cast<double>(v);
}

template <class T>
std::vector<T> inputs(int rank, std::size_t count, std::uint64_t salt) {
  std::vector<T> out(count);
  for (std::size_t i = 0; i < count; ++i) {
    const double value = input_value(rank, i, salt);
    if constexpr (std::is_same_v<T, std::uint8_t>)  // bytes: every pattern, 0 rarely
      out[i] = static_cast<std::uint8_t>(static_cast<int>(value * 1000.0) & 0xff);
    else
      out[i] = convert_value<T>(value);
  }
  return out;
}

// The documented local rule, written out again: accumulate in rank order (f32 for f16/bf16),
// divide once for avg, round once.
template <class T>
T fixed_order(const std::vector<std::vector<T>>& in, std::size_t i, ReduceOp op) {
  using Acc = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const int n = static_cast<int>(in.size());
  Acc acc = static_cast<Acc>(to_double(in[0][i]));
  for (int r = 1; r < n; ++r) {
    const Acc x = static_cast<Acc>(to_double(in[static_cast<std::size_t>(r)][i]));
    acc = op == ReduceOp::max ? std::max(acc, x) : acc + x;
  }
  if (op == ReduceOp::avg) acc = acc / static_cast<Acc>(n);
  return convert_value<T>(static_cast<double>(acc));
}

template <class T>
double exact(const std::vector<std::vector<T>>& in, std::size_t i, ReduceOp op, double* sum_abs) {
  double acc = op == ReduceOp::max ? -INFINITY : 0.0;
  *sum_abs = 0;
  for (const auto& rank_values : in) {
    const double x = to_double(rank_values[i]);
    acc = op == ReduceOp::max ? std::max(acc, x) : acc + x;
    *sum_abs += std::fabs(x);
  }
  if (op == ReduceOp::avg) {
    acc /= static_cast<double>(in.size());
    *sum_abs /= static_cast<double>(in.size());
  }
  return acc;
}

template <class T>
double output_epsilon() {
  if constexpr (std::is_same_v<T, double>) return 0x1p-53;
  if constexpr (std::is_same_v<T, float>) return 0x1p-24;
  if constexpr (std::is_same_v<T, Half>) return 0x1p-11;
  return 0x1p-8;  // bf16
}

struct MatrixConfig {
  bool exact_order = true;              // local: bit-equal to the fixed-order reference
  bool reduced_precision_wire = false;  // NCCL: f16/bf16 sums round at every step
  std::vector<std::size_t> counts{1, 5, 1027};
};

// Runs the matrix on `comm` with the rank's context `ctx`; returns the failures seen here.
template <class T>
std::vector<std::string> run_collective_matrix(Context& ctx, Communicator& comm,
                                               const MatrixConfig& config = {}) {
  const int n = comm.size();
  const int me = comm.rank();
  const auto un = static_cast<std::size_t>(n);
  const DType dtype = dtype_of<T>;
  std::vector<std::string> failures;
  std::uint64_t salt = 1000;

  auto all_inputs = [&](std::size_t count) {
    std::vector<std::vector<T>> in;
    for (int r = 0; r < n; ++r) in.push_back(inputs<T>(r, count, salt));
    return in;
  };
  auto tensor_of = [&](const std::vector<T>& values) {
    return sk::from_vector(ctx, values, {static_cast<std::int64_t>(values.size())});
  };
  auto read = [&](const Tensor& t) { return sk::to_vector<T>(ctx, t); };
  auto fail_at = [&](const std::string& what, std::size_t i, double got, double want) {
    if (failures.size() >= 20) return;
    char values[96];
    std::snprintf(values, sizeof values, " got %.17g expected %.17g", got, want);
    failures.push_back(shardkit::detail::concat("n=", n, " rank ", me, " ", dtype_name(dtype), " ",
                                                what, ": element ", i, values));
  };
  // A reduced element: bit-exact or within the rounding bound.
  auto check_reduced = [&](const std::string& what, const std::vector<std::vector<T>>& in,
                           std::size_t in_offset, const std::vector<T>& got, std::size_t got_offset,
                           std::size_t count, ReduceOp op) {
    for (std::size_t i = 0; i < count; ++i) {
      const T value = got[got_offset + i];
      const T want = fixed_order(in, in_offset + i, op);
      if (config.exact_order || op == ReduceOp::max) {
        if (std::memcmp(&value, &want, sizeof(T)) != 0)
          return fail_at(what, i, to_double(value), to_double(want));
        continue;
      }
      double sum_abs = 0;
      const double truth = exact(in, in_offset + i, op, &sum_abs);
      const double steps = config.reduced_precision_wire ? static_cast<double>(n) : 1.0;
      const double bound = (static_cast<double>(n) + 1) * 0x1p-23 * sum_abs +
                           2 * steps * output_epsilon<T>() * std::max(sum_abs, std::fabs(truth));
      if (std::fabs(to_double(value) - truth) > bound)
        return fail_at(what, i, to_double(value), truth);
    }
  };
  auto check_copied = [&](const std::string& what, const std::vector<T>& want,
                          std::size_t want_offset, const std::vector<T>& got,
                          std::size_t got_offset, std::size_t count) {
    for (std::size_t i = 0; i < count; ++i)
      if (std::memcmp(&got[got_offset + i], &want[want_offset + i], sizeof(T)) != 0)
        return fail_at(what, i, to_double(got[got_offset + i]), to_double(want[want_offset + i]));
  };

  // Bytes (u8) are moved, never reduced: a reduction of them is refused before any traffic.
  constexpr bool kReducible = is_comm_dtype(dtype_of<T>);
  if constexpr (!kReducible) {
    Tensor bytes = tensor_of(std::vector<T>(4));
    try {
      comm.all_reduce(bytes).wait();
      failures.push_back(
          shardkit::detail::concat("n=", n, " rank ", me, " all_reduce of u8 was not refused"));
    } catch (const InvalidArgument& e) {
      if (std::string(e.what()).find("reductions combine f32, f64, f16 or bf16") ==
          std::string::npos)
        failures.push_back(shardkit::detail::concat(
            "n=", n, " rank ", me, " all_reduce of u8: unexpected message: ", e.what()));
    }
  }

  for (std::size_t count : config.counts) {
    const std::string at = shardkit::detail::concat("count ", count, " ");
    // all_reduce, out of place, every op
    if constexpr (kReducible)
      for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
        ++salt;
        const auto in = all_inputs(count);
        Tensor send = tensor_of(in[static_cast<std::size_t>(me)]);
        Tensor recv = tensor_of(std::vector<T>(count));
        comm.all_reduce(send, recv, op).wait();
        check_reduced(at + "all_reduce(" + std::string(reduce_op_name(op)) + ")", in, 0, read(recv),
                      0, count, op);
        check_copied(at + "all_reduce send untouched", in[static_cast<std::size_t>(me)], 0,
                     read(send), 0, count);
      }
    if constexpr (kReducible) {  // all_reduce in place
      ++salt;
      const auto in = all_inputs(count);
      Tensor data = tensor_of(in[static_cast<std::size_t>(me)]);
      comm.all_reduce(data, ReduceOp::sum).wait();
      check_reduced(at + "all_reduce(sum, in place)", in, 0, read(data), 0, count, ReduceOp::sum);
    }
    // reduce to the last rank (sum) and to rank 0 (avg, in place at the root)
    if constexpr (kReducible)
      for (int variant = 0; variant < 2; ++variant) {
        ++salt;
        const int root = variant == 0 ? n - 1 : 0;
        const ReduceOp op = variant == 0 ? ReduceOp::sum : ReduceOp::avg;
        const auto in = all_inputs(count);
        Tensor send = tensor_of(in[static_cast<std::size_t>(me)]);
        Tensor recv = tensor_of(std::vector<T>(count));
        const bool in_place = variant == 1;
        const Buffer out = me == root ? (in_place ? Buffer(send) : Buffer(recv)) : Buffer();
        comm.reduce(send, out, root, op).wait();
        if (me == root)
          check_reduced(
              at + "reduce(" + std::string(reduce_op_name(op)) + (in_place ? ", in place)" : ")"),
              in, 0, read(in_place ? send : recv), 0, count, op);
      }
    {  // broadcast from the middle rank
      ++salt;
      const int root = n / 2;
      const auto in = all_inputs(count);
      Tensor data = tensor_of(in[static_cast<std::size_t>(me)]);
      comm.broadcast(data, root).wait();
      check_copied(at + "broadcast", in[static_cast<std::size_t>(root)], 0, read(data), 0, count);
    }
    // all_gather, out of place and in place
    for (int in_place = 0; in_place < 2; ++in_place) {
      ++salt;
      const auto in = all_inputs(count);
      std::vector<T> initial(count * un);
      if (in_place)
        std::copy(
            in[static_cast<std::size_t>(me)].begin(), in[static_cast<std::size_t>(me)].end(),
            initial.begin() + static_cast<std::ptrdiff_t>(count * static_cast<std::size_t>(me)));
      Tensor recv = tensor_of(initial);
      Tensor send = tensor_of(in[static_cast<std::size_t>(me)]);
      const Buffer source =
          in_place ? Buffer(recv).slice(count * static_cast<std::size_t>(me), count) : Buffer(send);
      comm.all_gather(source, recv).wait();
      const auto got = read(recv);
      for (int r = 0; r < n; ++r)
        check_copied(at + (in_place ? "all_gather(in place) segment " : "all_gather segment ") +
                         std::to_string(r),
                     in[static_cast<std::size_t>(r)], 0, got, count * static_cast<std::size_t>(r),
                     count);
    }
    // reduce_scatter: out of place (sum, max) and in place (avg)
    if constexpr (kReducible)
      for (int variant = 0; variant < 3; ++variant) {
        ++salt;
        const ReduceOp op = variant == 0   ? ReduceOp::sum
                            : variant == 1 ? ReduceOp::max
                                           : ReduceOp::avg;
        const bool in_place = variant == 2;
        const auto in = all_inputs(count * un);
        Tensor send = tensor_of(in[static_cast<std::size_t>(me)]);
        Tensor recv = tensor_of(std::vector<T>(count));
        const std::size_t own = count * static_cast<std::size_t>(me);
        const Buffer out = in_place ? Buffer(send).slice(own, count) : Buffer(recv);
        comm.reduce_scatter(send, out, op).wait();
        check_reduced(at + "reduce_scatter(" + std::string(reduce_op_name(op)) +
                          (in_place ? ", in place)" : ")"),
                      in, own, read(in_place ? send : recv), in_place ? own : 0, count, op);
      }
    // Uneven per-owner segments (one owner empty when n > 2): all_gather_v, all_to_all_v,
    // reduce_scatter_v.
    std::vector<std::size_t> counts(un);
    for (std::size_t r = 0; r < un; ++r) counts[r] = count / 2 + (r * r * 7 + 3) % (count + 2);
    if (n > 2) counts[1] = 0;
    const std::size_t total = std::accumulate(counts.begin(), counts.end(), std::size_t{0});
    std::vector<std::size_t> offsets(un, 0);
    for (std::size_t r = 1; r < un; ++r) offsets[r] = offsets[r - 1] + counts[r - 1];
    {
      ++salt;
      const auto in = all_inputs(total);  // rank r's values at its own segment are what it owns
      std::vector<T> mine(total);
      const auto r_me = static_cast<std::size_t>(me);
      for (std::size_t i = 0; i < counts[r_me]; ++i)
        mine[offsets[r_me] + i] = in[r_me][offsets[r_me] + i];
      Tensor data = tensor_of(mine);
      comm.all_gather_v(data, counts).wait();
      const auto got = read(data);
      for (std::size_t r = 0; r < un; ++r)
        check_copied(at + "all_gather_v segment " + std::to_string(r), in[r], offsets[r], got,
                     offsets[r], counts[r]);
    }
    {  // all_to_all_v: rank q's segment for this rank lands at q x counts[rank], bit for bit
      ++salt;
      const auto in = all_inputs(total);
      const auto r_me = static_cast<std::size_t>(me);
      Tensor send = tensor_of(in[r_me]);
      Tensor recv = tensor_of(std::vector<T>(std::max<std::size_t>(counts[r_me] * un, 1)));
      comm.all_to_all_v(send, recv, counts).wait();
      const auto got = read(recv);
      for (std::size_t q = 0; q < un; ++q)
        check_copied(at + "all_to_all_v from rank " + std::to_string(q), in[q], offsets[r_me], got,
                     q * counts[r_me], counts[r_me]);
      check_copied(at + "all_to_all_v send untouched", in[r_me], 0, read(send), 0, total);
    }
    if constexpr (kReducible)
      for (int in_place = 0; in_place < 2; ++in_place) {
        ++salt;
        const ReduceOp op = in_place ? ReduceOp::avg : ReduceOp::sum;
        const auto in = all_inputs(total);
        const auto r_me = static_cast<std::size_t>(me);
        Tensor send = tensor_of(in[r_me]);
        Tensor recv = tensor_of(std::vector<T>(std::max<std::size_t>(counts[r_me], 1)));
        const Buffer out =
            in_place ? Buffer(send).slice(offsets[r_me], counts[r_me]) : Buffer(recv);
        comm.reduce_scatter_v(send, out, counts, op).wait();
        check_reduced(at + (in_place ? "reduce_scatter_v(avg, in place)" : "reduce_scatter_v(sum)"),
                      in, offsets[r_me], read(in_place ? send : recv), in_place ? offsets[r_me] : 0,
                      counts[r_me], op);
      }
  }
  return failures;
}

// Every dtype: the four that reduce, and bytes (moved only).
inline std::vector<std::string> run_all_dtypes(Context& ctx, Communicator& comm,
                                               const MatrixConfig& config = {}) {
  std::vector<std::string> failures;
  auto add = [&](std::vector<std::string> more) {
    failures.insert(failures.end(), more.begin(), more.end());
  };
  add(run_collective_matrix<float>(ctx, comm, config));
  add(run_collective_matrix<double>(ctx, comm, config));
  add(run_collective_matrix<Half>(ctx, comm, config));
  add(run_collective_matrix<BFloat16>(ctx, comm, config));
  add(run_collective_matrix<std::uint8_t>(ctx, comm, config));
  return failures;
}

}  // namespace shardkit::comm::testing
