// SPDX-License-Identifier: Apache-2.0
// Host-side collectives for tensor parallelism. Every rank of a tensor-parallel group calls the
// same collective in the same order; afterwards every rank holds the same elementwise result.
// The library needs only these three reductions: a max over per-token scores and candidate
// flags (union selection's agreement) and a sum over activations (the reference transformer).
//
// SingleRankCollective is the tp = 1 identity. ThreadTeamCollective is the CPU stand-in for
// NCCL: `size` ranks run in `size` threads of one process and meet at a barrier; the reduction
// is done in rank order so every rank (and every run) gets bit-identical results. The device
// counterpart is triattn::cuda::NcclCommunicator (include/triattn/cuda/tp/).
#pragma once

#include <algorithm>
#include <barrier>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/error.hpp>

namespace triattn::tp {

/// What a host collective provides. Each call is made by all ranks with spans of equal length.
template <class C>
concept HostCollective = requires(C& c, std::span<float> f, std::span<std::uint8_t> u) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
  c.all_reduce_sum(f);
  c.all_reduce_max(f);
  c.all_reduce_max(u);
};

/// tp = 1: every reduction is the identity.
class SingleRankCollective {
 public:
  [[nodiscard]] int rank() const noexcept { return 0; }
  [[nodiscard]] int size() const noexcept { return 1; }
  void all_reduce_sum(std::span<float>) noexcept {}
  void all_reduce_max(std::span<float>) noexcept {}
  void all_reduce_max(std::span<std::uint8_t>) noexcept {}
};

/// Shared state of a team of `size` ranks living in threads of one process. Create one, then
/// hand ThreadTeamCollective{team, r} to the thread of rank r.
class ThreadTeam {
 public:
  explicit ThreadTeam(int size) : size_(check_size(size)), slots_(static_cast<std::size_t>(size)), sync_(size) {}
  ThreadTeam(const ThreadTeam&) = delete;
  ThreadTeam& operator=(const ThreadTeam&) = delete;

  [[nodiscard]] int size() const noexcept { return size_; }

 private:
  friend class ThreadTeamCollective;
  static int check_size(int size) {
    if (size < 1) throw logic_error("ThreadTeam: size must be >= 1, got " + std::to_string(size));
    return size;
  }

  struct Slot {
    void* data = nullptr;
    std::size_t count = 0;
  };

  int size_;
  std::vector<Slot> slots_;  // [size] each rank's buffer during one collective
  std::barrier<> sync_;
};

/// One rank's handle on a ThreadTeam. All ranks must call the same sequence of collectives with
/// equal lengths; a length mismatch throws logic_error on every rank (after the team has met,
/// so no rank is left waiting).
class ThreadTeamCollective {
 public:
  ThreadTeamCollective(ThreadTeam& team, int rank) : team_(&team), rank_(rank) {
    if (rank < 0 || rank >= team.size())
      throw logic_error("ThreadTeamCollective: rank " + std::to_string(rank) + " is outside [0, " +
                        std::to_string(team.size()) + ")");
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int size() const noexcept { return team_->size(); }

  void all_reduce_sum(std::span<float> x) { reduce(x, [](float a, float b) { return a + b; }); }
  void all_reduce_max(std::span<float> x) { reduce(x, [](float a, float b) { return b > a ? b : a; }); }
  void all_reduce_max(std::span<std::uint8_t> x) {
    reduce(x, [](std::uint8_t a, std::uint8_t b) { return b > a ? b : a; });
  }

 private:
  // Publish, meet, reduce in rank order into a private copy, meet again (nobody may overwrite
  // its buffer while another rank still reads it), then write the result back.
  template <class T, class Op>
  void reduce(std::span<T> x, Op op) {
    ThreadTeam& t = *team_;
    t.slots_[static_cast<std::size_t>(rank_)] = {x.data(), x.size()};
    t.sync_.arrive_and_wait();
    bool equal_lengths = true;
    for (const ThreadTeam::Slot& s : t.slots_) equal_lengths = equal_lengths && s.count == x.size();
    std::vector<T> out;
    if (equal_lengths) {
      out.assign(static_cast<const T*>(t.slots_[0].data), static_cast<const T*>(t.slots_[0].data) + x.size());
      for (std::size_t r = 1; r < t.slots_.size(); ++r) {
        const T* src = static_cast<const T*>(t.slots_[r].data);
        for (std::size_t i = 0; i < x.size(); ++i) out[i] = op(out[i], src[i]);
      }
    }
    t.sync_.arrive_and_wait();
    if (!equal_lengths)
      throw logic_error("ThreadTeamCollective: rank " + std::to_string(rank_) + " reduced " +
                        std::to_string(x.size()) + " elements but another rank's length differs");
    std::copy(out.begin(), out.end(), x.begin());
  }

  ThreadTeam* team_;
  int rank_;
};

static_assert(HostCollective<SingleRankCollective>);
static_assert(HostCollective<ThreadTeamCollective>);

}  // namespace triattn::tp
