// SPDX-License-Identifier: Apache-2.0
// Whole-file input and output that no path can make hang, exhaust memory or leave half done.
// Reads: only a regular file is read (a directory, FIFO, socket or device is refused by type
// before it is opened), it is opened with O_NONBLOCK and checked again with fstat (a path
// swapped for a FIFO in between cannot block), and its size must be within the caller's cap.
// Writes: the bytes go to a fresh temporary file in the target's directory, are flushed to disk,
// then renamed over the target, so a failed write leaves the target as it was and no partial
// file; a target that exists and is not a regular file is refused without being opened.
// POSIX (open, fstat, rename); used by the statistics loaders and writers and by the tools.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <new>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <system_error>

#include <triattn/core/error.hpp>

namespace triattn {

namespace detail {

/// "<what> <path>" or "<path>": how every message names the file.
[[nodiscard]] inline std::string file_label(const std::string& path, std::string_view what) {
  return what.empty() ? path : std::string(what) + " " + path;
}

[[nodiscard]] inline std::string errno_message(int e) { return std::generic_category().message(e); }

/// "a directory", "a FIFO (named pipe)"... for a mode that is not a regular file.
[[nodiscard]] inline const char* non_regular_kind(mode_t mode) noexcept {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISCHR(mode)) return "a character device";
  return "not a regular file";
}

/// The one type check of every read: throws format_error "<name>: is a FIFO (named pipe), not a
/// regular file" (or a directory, a device...) unless `mode` is a regular file's.
inline void require_regular_mode(mode_t mode, const std::string& name) {
  if (!S_ISREG(mode)) throw format_error(name + ": is " + non_regular_kind(mode) + ", not a regular file");
}

/// Closes the descriptor it holds when it goes out of scope.
struct FdGuard {
  int fd = -1;
  FdGuard() = default;
  explicit FdGuard(int f) noexcept : fd(f) {}
  FdGuard(const FdGuard&) = delete;
  FdGuard& operator=(const FdGuard&) = delete;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
  /// Closes now; the close's errno (0 when it worked).
  int close_now() noexcept {
    const int r = ::close(fd);
    fd = -1;
    return r == 0 ? 0 : errno;
  }
};

/// "67108864 bytes (64 MiB)".
[[nodiscard]] inline std::string byte_count(std::uint64_t n) {
  std::string s = std::to_string(n) + " bytes";
  if (n >= (std::uint64_t{1} << 20)) s += " (" + std::to_string(n >> 20) + " MiB)";
  return s;
}

}  // namespace detail

/// Throws triattn::format_error naming `path` (prefixed by `what`, e.g. "llama2.c checkpoint")
/// unless it names an existing regular file (symlinks followed). Nothing is opened: a directory
/// reports a nonsense size and opening a FIFO blocks until a writer appears.
inline void require_regular_file(const std::string& path, std::string_view what = {}) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int e = errno;
    if (e == ENOENT) throw format_error(detail::file_label(path, what) + ": no such file");
    throw format_error(detail::file_label(path, what) + ": cannot examine the file (" + detail::errno_message(e) + ")");
  }
  detail::require_regular_mode(st.st_mode, detail::file_label(path, what));
}

/// The whole contents of the regular file `path` as `Bytes` (std::string, std::vector<char>,
/// std::vector<std::uint8_t> or std::vector<std::byte>): refused by type before opening (see
/// require_regular_file), opened non-blocking and checked again after opening, and refused when
/// larger than `max_bytes`. Messages start with "<what> <path>: ".
/// @throws triattn::format_error (not a regular file, too large, unreadable, changed while read),
///         triattn::out_of_memory when the buffer cannot be allocated.
template <class Bytes>
[[nodiscard]] Bytes read_regular_file(const std::string& path, std::uint64_t max_bytes, std::string_view what = {}) {
  static_assert(sizeof(typename Bytes::value_type) == 1, "read_regular_file fills a byte container");
  require_regular_file(path, what);
  const std::string name = detail::file_label(path, what);
  int fd = -1;
  do fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  while (fd < 0 && errno == EINTR);
  if (fd < 0) throw format_error(name + ": cannot open the file (" + detail::errno_message(errno) + ")");
  detail::FdGuard guard(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw format_error(name + ": cannot examine the file (" + detail::errno_message(errno) + ")");
  detail::require_regular_mode(st.st_mode, name);  // again: the path may have been replaced since the stat
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size > max_bytes)
    throw format_error(name + ": the file has " + detail::byte_count(size) + ", over the limit of " +
                       detail::byte_count(max_bytes) + " for this kind of file");
  Bytes out;
  try {
    out.resize(static_cast<std::size_t>(size));
  } catch (const std::bad_alloc&) {
    throw out_of_memory(name + ": cannot allocate " + detail::byte_count(size) + " to read the file");
  }
  auto* p = reinterpret_cast<char*>(out.data());
  std::uint64_t got = 0;
  while (got < size) {
    const ssize_t r = ::read(fd, p + got, static_cast<std::size_t>(size - got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw format_error(name + ": read error (" + detail::errno_message(errno) + ")");
    if (r == 0) throw format_error(name + ": the file shrank while it was read");
    got += static_cast<std::uint64_t>(r);
  }
  char extra = 0;
  ssize_t r = 0;
  do r = ::read(fd, &extra, 1);
  while (r < 0 && errno == EINTR);
  if (r > 0) throw format_error(name + ": the file grew while it was read");
  return out;
}

/// Throws triattn::error naming `path` unless a file may be written there: `path` is a regular
/// file or does not exist and its directory does. A FIFO, device, socket or directory is refused
/// without being opened. Call it before long work whose result goes to `path`.
inline void check_write_target(const std::string& path, std::string_view what = {}) {
  const std::string name = detail::file_label(path, what);
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) {
    if (!S_ISREG(st.st_mode))
      throw error(name + ": is " + std::string(detail::non_regular_kind(st.st_mode)) +
                  ", not a regular file; refusing to write to it");
    return;
  }
  const int e = errno;
  if (e != ENOENT) throw error(name + ": cannot examine the output path (" + detail::errno_message(e) + ")");
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (dir.empty()) dir = ".";
  struct stat ds {};
  if (::stat(dir.c_str(), &ds) != 0 || !S_ISDIR(ds.st_mode))
    throw error(name + ": the directory " + dir.string() + " does not exist");
}

/// Writes `bytes` to `path` through a temporary file in the same directory, flushed and then
/// renamed over `path` (a symlink's target is replaced, the link kept). On any failure the
/// temporary file is removed and `path` is left as it was. Messages start with "<what> <path>: ".
/// @throws triattn::error (target not a regular file, no directory, write or rename failure).
inline void write_file_atomically(const std::string& path, std::span<const std::uint8_t> bytes, std::string_view what = {}) {
  const std::string name = detail::file_label(path, what);
  check_write_target(path, what);
  std::filesystem::path target = path;
  struct stat lst {};
  if (::lstat(path.c_str(), &lst) == 0 && S_ISLNK(lst.st_mode)) {
    std::error_code ec;
    target = std::filesystem::canonical(path, ec);
    if (ec) throw error(name + ": cannot resolve the symbolic link (" + ec.message() + ")");
  }
  struct stat old {};
  const bool existed = ::stat(target.c_str(), &old) == 0;
  std::filesystem::path dir = target.parent_path();
  if (dir.empty()) dir = ".";

  std::string tmp;
  int fd = -1;
  std::random_device rd;
  for (int attempt = 0; attempt < 16 && fd < 0; ++attempt) {
    std::string leaf = target.filename().string();  // ".<name>.tmp-<pid>-<random>": hidden, beside the target
    leaf.insert(0, 1, '.');
    leaf += ".tmp-" + std::to_string(::getpid()) + "-" + std::to_string(rd());
    tmp = (dir / leaf).string();
    do fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOCTTY | O_CLOEXEC, 0666);
    while (fd < 0 && errno == EINTR);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0)
    throw error(name + ": cannot create a temporary file in " + dir.string() + " (" + detail::errno_message(errno) + ")");
  detail::FdGuard guard(fd);
  auto fail = [&](const std::string& why, int e) {
    if (guard.fd >= 0) (void)guard.close_now();
    ::unlink(tmp.c_str());
    throw error(name + ": " + why + " (" + detail::errno_message(e) + "); the file was not written");
  };
  if (existed) (void)::fchmod(fd, old.st_mode & 07777);  // replacing a file keeps its permissions
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t r = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail("write error", errno);
    done += static_cast<std::size_t>(r);
  }
  if (::fsync(fd) != 0) fail("cannot flush the file to disk", errno);
  if (const int e = guard.close_now(); e != 0) fail("write error on close", e);
  if (::rename(tmp.c_str(), target.c_str()) != 0) fail("cannot rename the temporary file into place", errno);
}

}  // namespace triattn
