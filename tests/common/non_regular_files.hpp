// SPDX-License-Identifier: Apache-2.0
// Test helper: a directory and a FIFO in a fresh temporary folder, and checks that a loader
// (check_refused) or a writer (check_write_refused) refuses each with a typed triattn error naming
// the path, without opening it. A loader that opens the FIFO would block forever; a watchdog
// thread then opens the other end (which frees it) and the check fails instead of hanging.
#pragma once

#include <doctest/doctest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <utility>

#include <triattn/core/error.hpp>

namespace triattn::test {

struct NonRegularPaths {
  std::filesystem::path root;
  std::string dir;
  std::string fifo;

  NonRegularPaths() {
    root = std::filesystem::temp_directory_path() /
           ("triattn_nonregular_" + std::to_string(::getpid()) + "_" + std::to_string(std::random_device{}()));
    std::filesystem::create_directories(root / "a_directory.bin");
    dir = (root / "a_directory.bin").string();
    fifo = (root / "a_fifo.bin").string();
    REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  }
  ~NonRegularPaths() {
    std::error_code ec;
    std::filesystem::remove_all(root, ec);
  }
  NonRegularPaths(const NonRegularPaths&) = delete;
  NonRegularPaths& operator=(const NonRegularPaths&) = delete;
};

/// Calls use(path) and checks that it throws `Exception` whose message names `path` and says why
/// (`why`: "directory" or "FIFO"), and that it never opened a FIFO at `path`. `writes`: use()
/// would open the path for writing (the watchdog then frees it as a reader, draining what it
/// writes), else for reading (the watchdog frees it as a writer).
template <class Exception, class Use>
void check_refused_as(Use&& use, const std::string& path, const std::string& why, bool writes) {
  INFO("path " << path);
  std::atomic<bool> done{false};
  std::atomic<bool> unblocked{false};
  std::thread watchdog([&] {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    while (!done && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (done) return;
    // Still running after 3 s: use() is blocked opening the FIFO. The other end frees it.
    const int fd = ::open(path.c_str(), (writes ? O_RDONLY : O_WRONLY) | O_NONBLOCK);
    if (fd < 0) return;
    unblocked = true;
    char sink[4096];
    while (writes && !done) {  // keep the read end open and drained until the writer is done
      if (::read(fd, sink, sizeof sink) <= 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ::close(fd);
  });
  std::string message;
  bool typed = false;
  try {
    use(path);
  } catch (const Exception& e) {
    typed = true;
    message = e.what();
  } catch (const std::exception& e) {
    message = std::string("untyped exception: ") + e.what();
  }
  done = true;
  watchdog.join();
  INFO("message: " << message);
  CHECK_FALSE(unblocked.load());
  CHECK(typed);
  CHECK(message.find(path) != std::string::npos);
  CHECK(message.find(why) != std::string::npos);
}

/// A loader: load(path) must throw triattn::format_error (see check_refused_as).
template <class Load>
void check_refused(Load&& load, const std::string& path, const std::string& why) {
  check_refused_as<triattn::format_error>(std::forward<Load>(load), path, why, false);
}

/// A writer: write(path) must throw triattn::error without opening the FIFO or directory.
template <class Write>
void check_write_refused(Write&& write, const std::string& path, const std::string& why) {
  check_refused_as<triattn::error>(std::forward<Write>(write), path, why, true);
}

}  // namespace triattn::test
