// SPDX-License-Identifier: Apache-2.0
// Minimal, strict zip reader over an in-memory byte buffer, enough for PyTorch `torch.save`
// archives: end-of-central-directory (plus ZIP64 locator and record), central directory with the
// ZIP64 extra field, local headers, data descriptors, STORED (method 0) entries only. Because a
// corrupted statistics file must never load silently, the archive is checked as a whole when it
// is opened: every offset and size is bounds-checked, local headers and data descriptors must
// agree with the central directory, entries must tile the file without gaps, PyTorch's alignment
// padding must be intact, and the CRC-32 of every stored entry is verified.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/stats/common.hpp>

namespace triattn::detail {

/// One archive member, as described by the central directory (local header offsets resolved).
struct ZipEntry {
  std::string name;
  std::uint16_t method = 0;               ///< 0 = stored; anything else is refused on read()
  std::uint16_t flags = 0;                ///< general-purpose bit flags
  std::uint32_t crc32 = 0;                ///< from the central directory
  std::uint64_t compressed_size = 0;
  std::uint64_t uncompressed_size = 0;
  std::uint64_t local_header_offset = 0;
  std::uint64_t central_header_offset = 0;  ///< where this entry's central directory record starts
  std::uint64_t data_offset = 0;            ///< first payload byte (after local header, name, extra)
};

class ZipReader {
 public:
  /// Parses and verifies the whole archive. `bytes` must outlive the reader; `file_name` starts
  /// every error message.
  ZipReader(std::span<const std::uint8_t> bytes, std::string file_name) : bytes_(bytes), file_(std::move(file_name)) {
    parse();
  }

  [[nodiscard]] const std::vector<ZipEntry>& entries() const noexcept { return entries_; }
  [[nodiscard]] const std::string& file_name() const noexcept { return file_; }

  /// The entry called `name`, or nullptr.
  [[nodiscard]] const ZipEntry* find(std::string_view name) const {
    const auto it = by_name_.find(std::string(name));
    return it == by_name_.end() ? nullptr : &entries_[it->second];
  }

  /// Payload of a stored entry (already CRC-checked when the archive was opened).
  [[nodiscard]] std::span<const std::uint8_t> read(const ZipEntry& e) const {
    if (e.method != 0)
      throw format_error(file_ + ": entry '" + e.name + "' uses compression method " + std::to_string(e.method) + " (" +
                         method_name(e.method) + "); only stored (method 0) entries are supported");
    return bytes_.subspan(static_cast<std::size_t>(e.data_offset), static_cast<std::size_t>(e.compressed_size));
  }

 private:
  static constexpr std::uint32_t kLocalSig = 0x04034b50, kCentralSig = 0x02014b50, kEocdSig = 0x06054b50,
                                 kZip64EocdSig = 0x06064b50, kZip64LocatorSig = 0x07064b50, kDescriptorSig = 0x08074b50;
  static constexpr std::size_t kEocdSize = 22, kZip64LocatorSize = 20, kZip64EocdMinSize = 56, kCentralSize = 46,
                               kLocalSize = 30;

  static const char* method_name(std::uint16_t m) noexcept {
    switch (m) {
      case 0: return "stored";
      case 8: return "deflate";
      case 9: return "deflate64";
      case 12: return "bzip2";
      case 14: return "lzma";
      case 93: return "zstd";
      default: return "unknown";
    }
  }

  [[noreturn]] void fail(const std::string& what) const { throw format_error(file_ + ": " + what); }
  [[noreturn]] void fail_entry(const ZipEntry& e, const std::string& what) const {
    fail("entry '" + e.name + "': " + what);
  }
  const std::uint8_t* at(std::uint64_t off) const noexcept { return bytes_.data() + off; }

  void parse() {
    const std::uint64_t size = bytes_.size();
    const std::uint64_t eocd = find_eocd();
    const std::uint8_t* p = at(eocd);
    const std::uint16_t disk = load_le16(p + 4), cd_disk = load_le16(p + 6);
    std::uint64_t n_disk = load_le16(p + 8), n_total = load_le16(p + 10);
    std::uint64_t cd_size = load_le32(p + 12), cd_offset = load_le32(p + 16);
    std::uint64_t cd_end = eocd;  // the central directory must end where the next record starts

    const bool has_locator = eocd >= kZip64LocatorSize && load_le32(at(eocd - kZip64LocatorSize)) == kZip64LocatorSig;
    if (has_locator) {
      const std::uint64_t loc = eocd - kZip64LocatorSize;
      const std::uint32_t z_disk = load_le32(at(loc + 4)), z_disks = load_le32(at(loc + 16));
      const std::uint64_t z_off = load_le64(at(loc + 8));
      if (z_disk != 0 || z_disks != 1)
        fail("ZIP64 locator names disk " + std::to_string(z_disk) + " of " + std::to_string(z_disks) +
             "; multi-disk archives are not supported");
      if (!fits(z_off, kZip64EocdMinSize, loc))
        fail("ZIP64 end-of-central-directory record at offset " + std::to_string(z_off) +
             " lies outside the file (truncated or corrupted)");
      const std::uint8_t* z = at(z_off);
      if (load_le32(z) != kZip64EocdSig)
        fail("no ZIP64 end-of-central-directory record at offset " + std::to_string(z_off));
      const std::uint64_t rec_size = load_le64(z + 4);
      if (rec_size < kZip64EocdMinSize - 12 || rec_size != loc - z_off - 12)
        fail("ZIP64 end-of-central-directory record size " + std::to_string(rec_size) +
             " does not reach the locator (corrupted)");
      if (load_le32(z + 16) != 0 || load_le32(z + 20) != 0) fail("multi-disk ZIP64 archives are not supported");
      const std::uint64_t z_n_disk = load_le64(z + 24), z_n_total = load_le64(z + 32);
      const std::uint64_t z_cd_size = load_le64(z + 40), z_cd_offset = load_le64(z + 48);
      // Each 16/32-bit EOCD field is either the ZIP64 sentinel or a copy of the ZIP64 value.
      auto agree = [&](std::uint64_t small, std::uint64_t sentinel, std::uint64_t big, const char* what) {
        if (small != sentinel && small != big)
          fail(std::string("end-of-central-directory ") + what + " " + std::to_string(small) +
               " disagrees with the ZIP64 record's " + std::to_string(big));
      };
      agree(n_disk, 0xFFFF, z_n_disk, "entry count");
      agree(n_total, 0xFFFF, z_n_total, "entry count");
      agree(cd_size, 0xFFFFFFFF, z_cd_size, "central directory size");
      agree(cd_offset, 0xFFFFFFFF, z_cd_offset, "central directory offset");
      if ((disk != 0 && disk != 0xFFFF) || (cd_disk != 0 && cd_disk != 0xFFFF))
        fail("multi-disk archives are not supported");
      n_disk = z_n_disk;
      n_total = z_n_total;
      cd_size = z_cd_size;
      cd_offset = z_cd_offset;
      cd_end = z_off;
    } else {
      if (disk != 0 || cd_disk != 0) fail("multi-disk archives are not supported");
      if (n_total == 0xFFFF || cd_size == 0xFFFFFFFF || cd_offset == 0xFFFFFFFF)
        fail("end-of-central-directory record needs a ZIP64 record, but there is no ZIP64 locator (truncated?)");
    }
    if (n_disk != n_total)
      fail("entry counts disagree (" + std::to_string(n_disk) + " on this disk, " + std::to_string(n_total) + " in total)");
    if (!fits(cd_offset, cd_size, size) || cd_offset + cd_size != cd_end)
      fail("central directory (offset " + std::to_string(cd_offset) + ", " + std::to_string(cd_size) +
           " bytes) does not end where the end-of-central-directory records start (offset " + std::to_string(cd_end) +
           "): file truncated or corrupted");
    if (n_total > cd_size / kCentralSize)
      fail("central directory claims " + std::to_string(n_total) + " entries but holds only " + std::to_string(cd_size) +
           " bytes");
    parse_central_directory(cd_offset, cd_end, n_total);
    parse_local_headers(cd_offset);
  }

  // The EOCD is the last 22+ bytes; its comment must run exactly to the end of the file.
  std::uint64_t find_eocd() const {
    const std::uint64_t size = bytes_.size();
    if (size < kEocdSize)
      fail("file has only " + std::to_string(size) + " bytes: no end-of-central-directory record (truncated or not a zip)");
    const std::uint64_t lowest = size - kEocdSize > 0xFFFF ? size - kEocdSize - 0xFFFF : 0;
    for (std::uint64_t pos = size - kEocdSize;; --pos) {
      if (load_le32(at(pos)) == kEocdSig && load_le16(at(pos + 20)) == size - pos - kEocdSize) return pos;
      if (pos == lowest) break;
    }
    fail("no end-of-central-directory record at the end of the file (truncated or not a zip archive)");
  }

  void parse_central_directory(std::uint64_t cd_offset, std::uint64_t cd_end, std::uint64_t count) {
    entries_.reserve(static_cast<std::size_t>(count));
    std::uint64_t pos = cd_offset;
    for (std::uint64_t i = 0; i < count; ++i) {
      const std::string where = "central directory record #" + std::to_string(i);
      if (!fits(pos, kCentralSize, cd_end)) fail(where + " is truncated");
      const std::uint8_t* p = at(pos);
      if (load_le32(p) != kCentralSig) fail(where + " has a bad signature (corrupted)");
      ZipEntry e;
      e.central_header_offset = pos;
      e.flags = load_le16(p + 8);
      e.method = load_le16(p + 10);
      e.crc32 = load_le32(p + 16);
      e.compressed_size = load_le32(p + 20);
      e.uncompressed_size = load_le32(p + 24);
      const std::uint16_t name_len = load_le16(p + 28), extra_len = load_le16(p + 30), comment_len = load_le16(p + 32);
      std::uint64_t disk = load_le16(p + 34);
      e.local_header_offset = load_le32(p + 42);
      if (!fits(pos + kCentralSize, std::uint64_t{name_len} + extra_len + comment_len, cd_end))
        fail(where + ": name, extra field or comment runs past the central directory (truncated)");
      e.name.assign(reinterpret_cast<const char*>(p + kCentralSize), name_len);
      const std::string ewhere = "entry '" + e.name + "' (" + where + ")";
      if (e.name.empty()) fail(where + " has an empty name");
      parse_zip64_extra(p + kCentralSize + name_len, extra_len, e, disk, ewhere);
      if (disk != 0) fail(ewhere + " starts on disk " + std::to_string(disk) + "; multi-disk archives are not supported");
      if (e.flags & 0x0001u) fail(ewhere + " is encrypted; encryption is not supported");
      if (e.method == 0 && e.compressed_size != e.uncompressed_size)
        fail(ewhere + " is stored but its compressed size " + std::to_string(e.compressed_size) +
             " differs from its size " + std::to_string(e.uncompressed_size));
      if (!by_name_.emplace(e.name, entries_.size()).second) fail("duplicate entry '" + e.name + "'");
      entries_.push_back(std::move(e));
      pos += kCentralSize + name_len + extra_len + comment_len;
    }
    if (pos != cd_end)
      fail("central directory holds " + std::to_string(cd_end - pos) + " bytes after its last record (corrupted)");
  }

  // ZIP64 extra (0x0001): 64-bit values for exactly those fields that hold the sentinel, in order.
  void parse_zip64_extra(const std::uint8_t* x, std::uint64_t len, ZipEntry& e, std::uint64_t& disk,
                         const std::string& where) const {
    bool seen = false;
    for (std::uint64_t off = 0; off < len;) {
      if (len - off < 4) fail(where + ": truncated extra field header");
      const std::uint16_t id = load_le16(x + off), sz = load_le16(x + off + 2);
      if (sz > len - off - 4) fail(where + ": extra field 0x" + hex32(id).substr(4) + " runs past its area (truncated)");
      if (id == 0x0001) {
        if (seen) fail(where + ": two ZIP64 extra fields");
        seen = true;
        const std::uint8_t* v = x + off + 4;
        std::uint64_t left = sz;
        auto take64 = [&](std::uint64_t& field, const char* what) {
          if (left < 8) fail(where + ": ZIP64 extra field too short for the " + what);
          field = load_le64(v);
          v += 8;
          left -= 8;
        };
        if (e.uncompressed_size == 0xFFFFFFFF) take64(e.uncompressed_size, "size");
        if (e.compressed_size == 0xFFFFFFFF) take64(e.compressed_size, "compressed size");
        if (e.local_header_offset == 0xFFFFFFFF) take64(e.local_header_offset, "local header offset");
        if (disk == 0xFFFF) {
          if (left < 4) fail(where + ": ZIP64 extra field too short for the disk number");
          disk = load_le32(v);
        }
      }
      off += 4u + sz;
    }
    if (!seen && (e.uncompressed_size == 0xFFFFFFFF || e.compressed_size == 0xFFFFFFFF ||
                  e.local_header_offset == 0xFFFFFFFF || disk == 0xFFFF))
      fail(where + ": 32-bit field holds the ZIP64 sentinel but there is no ZIP64 extra field");
  }

  // Walks entries in file order: each local header must match its central record, and local
  // header + data + descriptor must reach exactly the next entry (or the central directory).
  void parse_local_headers(std::uint64_t cd_offset) {
    std::vector<std::size_t> order(entries_.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
      return entries_[a].local_header_offset < entries_[b].local_header_offset;
    });
    std::uint64_t expected = 0;  // no bytes may hide between records
    for (std::size_t k = 0; k < order.size(); ++k) {
      ZipEntry& e = entries_[order[k]];
      if (e.local_header_offset != expected)
        fail_entry(e, "local header at offset " + std::to_string(e.local_header_offset) + ", expected " +
                          std::to_string(expected) + " (overlapping entries or unaccounted bytes)");
      const std::uint64_t next = k + 1 < order.size() ? entries_[order[k + 1]].local_header_offset : cd_offset;
      expected = parse_one_local(e, next);
    }
    if (expected != cd_offset)
      fail("central directory starts at offset " + std::to_string(cd_offset) + ", but the last entry ends at " +
           std::to_string(expected));
  }

  // Returns the offset just past this entry (past its data descriptor, if any).
  std::uint64_t parse_one_local(ZipEntry& e, std::uint64_t limit) {
    const std::uint64_t pos = e.local_header_offset;
    if (!fits(pos, kLocalSize, limit)) fail_entry(e, "local header is truncated");
    const std::uint8_t* p = at(pos);
    const std::uint8_t* c = at(e.central_header_offset);
    if (load_le32(p) != kLocalSig) fail_entry(e, "bad local header signature at offset " + std::to_string(pos));
    // version needed, flags, method, time, date: bytes 4..13 local == bytes 6..15 central.
    if (std::memcmp(p + 4, c + 6, 10) != 0) fail_entry(e, "local header disagrees with the central directory");
    const std::uint16_t name_len = load_le16(p + 26), extra_len = load_le16(p + 28);
    if (!fits(pos + kLocalSize, std::uint64_t{name_len} + extra_len, limit))
      fail_entry(e, "local header name or extra field is truncated");
    if (std::string_view(reinterpret_cast<const char*>(p + kLocalSize), name_len) != e.name)
      fail_entry(e, "local header names a different entry");
    const bool descriptor = (e.flags & 0x0008u) != 0;
    std::uint64_t l_crc = load_le32(p + 14), l_comp = load_le32(p + 18), l_size = load_le32(p + 22);
    check_local_extra(e, p + kLocalSize + name_len, extra_len, l_comp, l_size);
    // Without a descriptor the local values are authoritative; with one they are all zero (or
    // all copies): a mix means a damaged header.
    const bool copies = l_crc == e.crc32 && l_comp == e.compressed_size && l_size == e.uncompressed_size;
    const bool zeros = descriptor && l_crc == 0 && l_comp == 0 && l_size == 0;
    if (!copies && !zeros) fail_entry(e, "local header CRC or sizes disagree with the central directory");

    e.data_offset = pos + kLocalSize + name_len + extra_len;
    if (!fits(e.data_offset, e.compressed_size, limit))
      fail_entry(e, "data (" + std::to_string(e.compressed_size) + " bytes at offset " + std::to_string(e.data_offset) +
                        ") is truncated or overlaps the next record");
    const std::uint64_t end = e.data_offset + e.compressed_size;
    if (descriptor) check_descriptor(e, end, limit - end);
    else if (end != limit)
      fail_entry(e, std::to_string(limit - end) + " unaccounted bytes after the data");
    if (e.method == 0) {
      const std::uint32_t actual = crc32_update(0, at(e.data_offset), static_cast<std::size_t>(e.compressed_size));
      if (actual != e.crc32 && kEnforceChecksums)
        fail_entry(e, "CRC-32 mismatch (stored " + hex32(e.crc32) + ", computed " + hex32(actual) +
                          "): the data is corrupted");
    }
    return limit;
  }

  void check_local_extra(const ZipEntry& e, const std::uint8_t* x, std::uint64_t len, std::uint64_t& l_comp,
                         std::uint64_t& l_size) const {
    for (std::uint64_t off = 0; off < len;) {
      if (len - off < 4) fail_entry(e, "truncated local extra field header");
      const std::uint16_t id = load_le16(x + off), sz = load_le16(x + off + 2);
      if (sz > len - off - 4) fail_entry(e, "local extra field runs past its area (truncated)");
      const std::uint8_t* v = x + off + 4;
      switch (id) {
        case 0x0001: {  // ZIP64: sizes, in order, for the fields holding the sentinel
          std::uint64_t left = sz;
          for (std::uint64_t* field : {&l_size, &l_comp}) {
            if (*field != 0xFFFFFFFF) continue;
            if (left < 8) fail_entry(e, "local ZIP64 extra field is too short");
            *field = load_le64(v);
            v += 8;
            left -= 8;
          }
          break;
        }
        case 0x4246:  // "FB": PyTorch's payload alignment padding, always filled with 'Z'
          for (std::uint16_t i = 0; i < sz; ++i)
            if (v[i] != 'Z') fail_entry(e, "alignment padding is corrupted");
          break;
        case 0x000a: case 0x5455: case 0x7875:  // NTFS times, extended timestamp, Unix owner: ignorable
          break;
        default:
          fail_entry(e, "unsupported local extra field 0x" + hex32(id).substr(4));
      }
      off += 4u + sz;
    }
  }

  // Data descriptor: [signature] crc32, then 32-bit or (ZIP64) 64-bit sizes; the space left
  // before the next record tells which of the four layouts it is.
  void check_descriptor(const ZipEntry& e, std::uint64_t pos, std::uint64_t room) const {
    const std::uint8_t* d = at(pos);
    bool sig = false, wide = false;
    if (room == 16 || room == 24) sig = true;
    if (room == 20 || room == 24) wide = true;
    if (room != 12 && room != 16 && room != 20 && room != 24)
      fail_entry(e, "data descriptor truncated or followed by " + std::to_string(room) + " unaccounted bytes");
    if (sig) {
      if (load_le32(d) != kDescriptorSig) fail_entry(e, "bad data descriptor signature");
      d += 4;
    }
    const std::uint32_t crc = load_le32(d);
    const std::uint64_t comp = wide ? load_le64(d + 4) : load_le32(d + 4);
    const std::uint64_t usize = wide ? load_le64(d + 12) : load_le32(d + 8);
    if (crc != e.crc32 || comp != e.compressed_size || usize != e.uncompressed_size)
      fail_entry(e, "data descriptor disagrees with the central directory");
  }

  std::span<const std::uint8_t> bytes_;                   // [file size] the whole archive
  std::string file_;
  std::vector<ZipEntry> entries_;                         // central directory order
  std::unordered_map<std::string, std::size_t> by_name_;  // name -> index into entries_
};

}  // namespace triattn::detail
