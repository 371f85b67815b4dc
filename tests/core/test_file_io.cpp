// SPDX-License-Identifier: Apache-2.0
// ctest: TIMEOUT 120
// Whole-file I/O (include/triattn/core/file_io.hpp) and the statistics writers built on it:
// reads refuse a FIFO, a directory or a device by type without blocking and refuse a file over
// the caller's cap naming it and the cap; writes refuse a non-regular target without opening
// it, and a write that fails part-way leaves neither a partial file nor a temporary behind.
// The FIFO checks have a watchdog (tests/common/non_regular_files.hpp) and the ctest TIMEOUT
// above, so a regression fails instead of hanging.
#include <doctest/doctest.h>

#include <sys/resource.h>

#include <algorithm>
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/file_io.hpp>
#include <triattn/core/stats.hpp>
#include <triattn/core/stats/random.hpp>

#include "common/non_regular_files.hpp"

namespace fs = std::filesystem;

namespace {

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void put(const fs::path& p, const std::string& text) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out << text;
}

/// The names in `dir`, sorted.
std::vector<std::string> listing(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

/// Statistics large enough (24 KiB of floats) to pass a small RLIMIT_FSIZE.
triattn::QueryStats some_stats() {
  std::mt19937 rng(7);
  return triattn::random_query_stats(rng, 4, 8, 128);
}

/// Runs f() with the process's file size limit at `limit` bytes (a write past it fails with
/// EFBIG; SIGXFSZ, which would kill the process, is ignored meanwhile), then restores both.
template <class F>
void with_file_size_limit(rlim_t limit, F&& f) {
  rlimit old{};
  REQUIRE(::getrlimit(RLIMIT_FSIZE, &old) == 0);
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit small = old;
  small.rlim_cur = limit;
  REQUIRE(::setrlimit(RLIMIT_FSIZE, &small) == 0);
  try {
    f();
  } catch (...) {
    ::setrlimit(RLIMIT_FSIZE, &old);
    std::signal(SIGXFSZ, old_handler);
    throw;
  }
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
}

}  // namespace

TEST_SUITE("core") {

TEST_CASE("file_io: reads refuse a FIFO or a directory or /dev/zero by type without blocking") {
  const triattn::test::NonRegularPaths p;
  const auto read = [](const std::string& f) { (void)triattn::read_regular_file<std::string>(f, 1 << 20, "--input"); };
  triattn::test::check_refused(read, p.fifo, "--input " + p.fifo + ": is a FIFO (named pipe), not a regular file");
  triattn::test::check_refused(read, p.dir, "is a directory, not a regular file");
  triattn::test::check_refused(read, "/dev/zero", "--input /dev/zero: is a character device, not a regular file");
}

TEST_CASE("file_io: a file over the cap is refused naming the file and the cap before it is read") {
  const triattn::test::NonRegularPaths p;
  const fs::path big = p.root / "big.txt";
  put(big, "");
  fs::resize_file(big, (std::uint64_t{3} << 20) + 1);  // sparse: no disk space used
  try {
    (void)triattn::read_regular_file<std::vector<std::byte>>(big.string(), std::uint64_t{3} << 20, "--prompt-file");
    FAIL("no error for a file over the cap");
  } catch (const triattn::format_error& e) {
    CHECK(std::string(e.what()) == "--prompt-file " + big.string() +
                                       ": the file has 3145729 bytes (3 MiB), over the limit of 3145728 bytes (3 MiB) "
                                       "for this kind of file");
  }
  put(big, "exactly at the cap");
  CHECK(triattn::read_regular_file<std::string>(big.string(), 18) == "exactly at the cap");
  CHECK_THROWS_AS((void)triattn::read_regular_file<std::string>(big.string(), 17), triattn::format_error);
}

TEST_CASE("file_io: the statistics writers refuse a FIFO or a directory target without opening it") {
  const triattn::test::NonRegularPaths p;
  const triattn::QueryStats s = some_stats();
  for (const auto& [path, why] : {std::pair{p.fifo, "FIFO"}, std::pair{p.dir, "directory"}}) {
    triattn::test::check_write_refused([&](const std::string& f) { triattn::save_safetensors_stats(f, s); }, path, why);
    triattn::test::check_write_refused([&](const std::string& f) { triattn::save_pt_stats(f, s); }, path, why);
    triattn::test::check_write_refused(
        [&](const std::string& f) { triattn::write_file_atomically(f, std::vector<std::uint8_t>(10, 1)); }, path, why);
    triattn::test::check_write_refused([&](const std::string& f) { triattn::check_write_target(f, "--calibrate"); },
                                       path, why);
  }
  CHECK_THROWS_WITH_AS(triattn::save_safetensors_stats((p.root / "no_such_dir" / "s.safetensors").string(), s),
                       doctest::Contains("no_such_dir does not exist"), triattn::error);
}

TEST_CASE("file_io: a write that fails part-way leaves the target as it was and no temporary file") {
  const triattn::test::NonRegularPaths p;
  const triattn::QueryStats s = some_stats();
  REQUIRE(triattn::serialize_safetensors_stats(s).size() > 8192);
  const fs::path existing = p.root / "old.safetensors";
  const fs::path fresh = p.root / "new.pt";
  put(existing, "previous contents");
  const std::vector<std::string> before = listing(p.root);
  const std::string existing_error = existing.string() + ": write error";
  const std::string fresh_error = fresh.string() + ": write error";
  with_file_size_limit(4096, [&] {
    CHECK_THROWS_WITH_AS(triattn::save_safetensors_stats(existing.string(), s), doctest::Contains(existing_error.c_str()),
                         triattn::error);
    CHECK_THROWS_WITH_AS(triattn::save_pt_stats(fresh.string(), s), doctest::Contains(fresh_error.c_str()),
                         triattn::error);
  });
  CHECK(slurp(existing) == "previous contents");
  CHECK_FALSE(fs::exists(fresh));
  CHECK(listing(p.root) == before);  // no temporary left behind
  // Without the limit both writes succeed, replace the old file and load back.
  triattn::save_safetensors_stats(existing.string(), s);
  triattn::save_pt_stats(fresh.string(), s);
  CHECK(triattn::load_safetensors_stats(existing.string()).q_abs_mean == s.q_abs_mean);
  CHECK(triattn::load_pt_stats(fresh.string()).q_abs_mean == s.q_abs_mean);
  std::vector<std::string> after = before;
  after.push_back("new.pt");
  std::sort(after.begin(), after.end());
  CHECK(listing(p.root) == after);
}

TEST_CASE("file_io: writing through a symbolic link replaces the file it points to and keeps the link") {
  const triattn::test::NonRegularPaths p;
  const fs::path real = p.root / "real.bin";
  const fs::path link = p.root / "link.bin";
  put(real, "old");
  fs::create_symlink(real, link);
  triattn::write_file_atomically(link.string(), std::vector<std::uint8_t>{'n', 'e', 'w'});
  CHECK(fs::is_symlink(link));
  CHECK(slurp(real) == "new");
}

}  // TEST_SUITE("core")
