// SPDX-License-Identifier: Apache-2.0
// Test helper: a directory and a FIFO in a fresh temporary folder, and a check that a loader
// refuses each with triattn::format_error naming the path, without opening it. A loader that
// opens the FIFO would block forever; a watchdog thread then opens the write end (which frees
// it) and the check fails instead of hanging.
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

/// Calls load(path) and checks that it throws triattn::format_error whose message names `path`
/// and says why (`why`: "directory" or "FIFO"), and that it never opened a FIFO at `path`.
template <class Load>
void check_refused(Load&& load, const std::string& path, const char* why) {
  INFO("path " << path);
  std::atomic<bool> done{false};
  std::atomic<bool> unblocked{false};
  std::thread watchdog([&] {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(3);
    while (!done && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (done) return;
    // Still running after 3 s: the loader is blocked opening the FIFO. A writer frees it.
    const int fd = ::open(path.c_str(), O_WRONLY | O_NONBLOCK);
    if (fd >= 0) {
      unblocked = true;
      ::close(fd);
    }
  });
  std::string message;
  bool typed = false;
  try {
    load(path);
  } catch (const triattn::format_error& e) {
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

}  // namespace triattn::test
