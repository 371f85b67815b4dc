// SPDX-License-Identifier: Apache-2.0
// Writes QueryStats as a TriAttention-compatible `.pt` file (the layout `torch.save` produces:
// stored zip with 64-byte aligned payloads, data descriptors and ZIP64 end records, a protocol-2
// pickle of {"metadata": ..., "stats": {"layerLL_headHH": {3 tensors}}}, one float32 storage
// per tensor). This lets statistics computed by Calibrator be used by TriAttention's Python
// code, and gives tests and fuzzers well-formed archives to start from. The low-level
// ZipWriter and PickleWriter are exposed in triattn::detail for hand-made test inputs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/stats/common.hpp>
#include <triattn/core/stats/query_stats.hpp>

namespace triattn {
namespace detail {

/// Builds a stored zip in memory, laid out as PyTorch does (flags 0x0808, 'FB' padding to
/// 64-byte aligned payloads, 16-byte data descriptors, ZIP64 end records).
class ZipWriter {
 public:
  void add(std::string_view name, std::span<const std::uint8_t> data) {
    if (data.size() >= 0xFFFFFFFFu || out_.size() >= 0xFFFFFFFFu)
      throw logic_error("ZipWriter: archives of 4 GiB or more are not supported");
    Record r{std::string(name), crc32(data), static_cast<std::uint32_t>(data.size()), static_cast<std::uint32_t>(out_.size())};
    append_le32(out_, 0x04034b50);
    append_le16(out_, 0);       // version needed
    append_le16(out_, 0x0808);  // data descriptor + UTF-8 name
    append_le16(out_, 0);       // stored
    append_le32(out_, 0);       // time, date
    append_le32(out_, 0);       // crc (in the descriptor)
    append_le64(out_, 0);       // sizes (in the descriptor)
    append_le16(out_, static_cast<std::uint16_t>(name.size()));
    const std::size_t unpadded = out_.size() + 2 + name.size() + 4;
    const std::size_t pad = (64 - unpadded % 64) % 64;
    append_le16(out_, static_cast<std::uint16_t>(4 + pad));
    append_bytes(out_, name);
    append_le16(out_, 0x4246);
    append_le16(out_, static_cast<std::uint16_t>(pad));
    out_.insert(out_.end(), pad, static_cast<std::uint8_t>('Z'));
    out_.insert(out_.end(), data.begin(), data.end());
    append_le32(out_, 0x08074b50);
    append_le32(out_, r.crc);
    append_le32(out_, r.size);
    append_le32(out_, r.size);
    records_.push_back(std::move(r));
  }
  void add(std::string_view name, std::string_view text) {
    add(name, std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(text.data()), text.size()));
  }

  /// Appends central directory and end records and returns the archive.
  [[nodiscard]] std::vector<std::uint8_t> finish() && {
    const std::uint64_t cd_offset = out_.size();
    for (const Record& r : records_) {
      append_le32(out_, 0x02014b50);
      append_le16(out_, 0);       // version made by
      append_le16(out_, 0);       // version needed
      append_le16(out_, 0x0808);
      append_le16(out_, 0);       // stored
      append_le32(out_, 0);       // time, date
      append_le32(out_, r.crc);
      append_le32(out_, r.size);
      append_le32(out_, r.size);
      append_le16(out_, static_cast<std::uint16_t>(r.name.size()));
      append_le16(out_, 0);       // extra
      append_le16(out_, 0);       // comment
      append_le16(out_, 0);       // disk
      append_le16(out_, 0);       // internal attributes
      append_le32(out_, 0);       // external attributes
      append_le32(out_, r.offset);
      append_bytes(out_, r.name);
    }
    const std::uint64_t cd_size = out_.size() - cd_offset, zip64_offset = out_.size();
    const std::uint64_t n = records_.size();
    append_le32(out_, 0x06064b50);
    append_le64(out_, 44);
    append_le16(out_, 0x031e);  // made by (as PyTorch's miniz)
    append_le16(out_, 0x002d);  // needed: 4.5 (ZIP64)
    append_le32(out_, 0);
    append_le32(out_, 0);
    append_le64(out_, n);
    append_le64(out_, n);
    append_le64(out_, cd_size);
    append_le64(out_, cd_offset);
    append_le32(out_, 0x07064b50);
    append_le32(out_, 0);
    append_le64(out_, zip64_offset);
    append_le32(out_, 1);
    append_le32(out_, 0x06054b50);
    append_le32(out_, 0);  // disk numbers
    append_le16(out_, static_cast<std::uint16_t>(n < 0xFFFF ? n : 0xFFFF));
    append_le16(out_, static_cast<std::uint16_t>(n < 0xFFFF ? n : 0xFFFF));
    append_le32(out_, static_cast<std::uint32_t>(cd_size));
    append_le32(out_, static_cast<std::uint32_t>(cd_offset));
    append_le16(out_, 0);  // comment length
    return std::move(out_);
  }

 private:
  struct Record {
    std::string name;
    std::uint32_t crc;
    std::uint32_t size;
    std::uint32_t offset;
  };
  std::vector<std::uint8_t> out_;  // [archive bytes so far]
  std::vector<Record> records_;    // [num_entries] for the central directory
};

/// Emits pickle opcodes; each method appends one opcode (plus its argument).
class PickleWriter {
 public:
  std::vector<std::uint8_t> bytes;  // [pickle bytes so far]

  PickleWriter& op(std::uint8_t code) {
    bytes.push_back(code);
    return *this;
  }
  PickleWriter& proto() { return op(0x80).op(2); }
  PickleWriter& stop() { return op('.'); }
  PickleWriter& mark() { return op('('); }
  PickleWriter& empty_dict() { return op('}'); }
  PickleWriter& empty_list() { return op(']'); }
  PickleWriter& empty_tuple() { return op(')'); }
  PickleWriter& setitems() { return op('u'); }
  PickleWriter& appends() { return op('e'); }
  PickleWriter& tuple() { return op('t'); }
  PickleWriter& tuple1() { return op(0x85); }
  PickleWriter& reduce() { return op('R'); }
  PickleWriter& binpersid() { return op('Q'); }
  PickleWriter& boolean(bool v) { return op(v ? 0x88 : 0x89); }
  PickleWriter& integer(std::int64_t v) {
    if (v >= 0 && v < 256) return op('K').op(static_cast<std::uint8_t>(v));
    if (v >= 0 && v < 65536) {
      op('M');
      append_le16(bytes, static_cast<std::uint16_t>(v));
      return *this;
    }
    if (v >= std::numeric_limits<std::int32_t>::min() && v <= std::numeric_limits<std::int32_t>::max()) {
      op('J');
      append_le32(bytes, static_cast<std::uint32_t>(static_cast<std::int32_t>(v)));
      return *this;
    }
    op(0x8a).op(8);
    append_le64(bytes, static_cast<std::uint64_t>(v));
    return *this;
  }
  PickleWriter& str(std::string_view s) {
    op('X');
    append_le32(bytes, static_cast<std::uint32_t>(s.size()));
    append_bytes(bytes, s);
    return *this;
  }
  PickleWriter& global(std::string_view module, std::string_view name) {
    op('c');
    append_bytes(bytes, module);
    bytes.push_back('\n');
    append_bytes(bytes, name);
    bytes.push_back('\n');
    return *this;
  }
  /// torch._utils._rebuild_tensor_v2(persistent_id(("storage", torch.<type>, key, "cpu", numel)),
  /// offset, size, stride, False, collections.OrderedDict()) -- what torch.save writes per tensor.
  PickleWriter& tensor(std::string_view storage_key, std::int64_t numel, std::int64_t offset,
                       std::span<const std::int64_t> size /* [ndim] */, std::span<const std::int64_t> stride /* [ndim] */,
                       std::string_view storage_type = "FloatStorage") {
    global("torch._utils", "_rebuild_tensor_v2").mark();
    mark().str("storage").global("torch", storage_type).str(storage_key).str("cpu").integer(numel).tuple();
    binpersid().integer(offset);
    mark();
    for (const auto d : size) integer(d);
    tuple().mark();
    for (const auto d : stride) integer(d);
    tuple().boolean(false).global("collections", "OrderedDict").empty_tuple().reduce();
    return tuple().reduce();
  }
};

/// Knobs for hand-made archives (tests): the archive folder and the byteorder entry.
struct PtArchiveOptions {
  std::string root = "stats";
  std::string byteorder = "little";
};

/// Whole archive from a pickle and its storages (storage i is written as `<root>/data/i`).
[[nodiscard]] inline std::vector<std::uint8_t> build_pt_archive(std::span<const std::uint8_t> pickle,
                                                                const std::vector<std::vector<std::uint8_t>>& storages,  // [n][bytes]
                                                                const PtArchiveOptions& options = {}) {
  const std::string root = options.root + "/";
  ZipWriter zip;
  zip.add(root + "data.pkl", pickle);
  zip.add(root + ".format_version", std::string_view("1"));
  zip.add(root + ".storage_alignment", std::string_view("64"));
  zip.add(root + "byteorder", std::string_view(options.byteorder));
  for (std::size_t i = 0; i < storages.size(); ++i) zip.add(root + "data/" + std::to_string(i), storages[i]);
  zip.add(root + "version", std::string_view("3\n"));
  // PyTorch writes a random id; ours is derived from the content so output is reproducible.
  const std::uint32_t id = crc32(pickle);
  zip.add(root + ".data/serialization_id", std::string_view(std::to_string(id) + std::to_string(pickle.size())));
  return std::move(zip).finish();
}

/// Pickle and storages for `s` in TriAttention's layout (storage 3i + {0, 1, 2} for entry i),
/// without validating the values (tests use it to write bad files).
inline void build_stats_pickle(const QueryStats& s, std::vector<std::uint8_t>& pickle,
                               std::vector<std::vector<std::uint8_t>>& storages /* [3 L Hq][F * 4] */) {
  const int nf = s.num_freqs();
  const std::int64_t size[1] = {nf}, stride[1] = {1};
  PickleWriter w;
  w.proto().empty_dict().mark().str("metadata").empty_dict().mark();
  w.str("rope_style").str(rope_style_name(s.rope_style)).str("sampled_heads").empty_list().mark();
  for (int l = 0; l < s.num_layers; ++l)
    for (int h = 0; h < s.num_q_heads; ++h) w.empty_list().mark().integer(l).integer(h).appends();
  w.appends().str("head_dim").integer(s.head_dim).str("model_name").str(s.model_name).setitems();
  w.str("stats").empty_dict().mark();
  storages.clear();
  for (int l = 0; l < s.num_layers; ++l) {
    for (int h = 0; h < s.num_q_heads; ++h) {
      w.str(head_key(l, h)).empty_dict().mark();
      const float* arrays[3] = {s.mean_real(l, h), s.mean_imag(l, h), s.abs_mean(l, h)};
      const char* names[3] = {"q_mean_real", "q_mean_imag", "q_abs_mean"};
      for (int a = 0; a < 3; ++a) {
        w.str(names[a]).tensor(std::to_string(storages.size()), nf, 0, size, stride);
        std::vector<std::uint8_t> data;
        data.reserve(static_cast<std::size_t>(nf) * 4);
        for (int f = 0; f < nf; ++f) append_le_f32(data, arrays[a][f]);
        storages.push_back(std::move(data));
      }
      w.setitems();
    }
  }
  w.setitems().setitems().stop();
  pickle = std::move(w.bytes);
}

}  // namespace detail

/// `stats` as a TriAttention-compatible `.pt` archive whose folder is `archive_name` (PyTorch
/// uses the file stem). Throws logic_error for a malformed object or a TP slice (first_q_head
/// != 0): the format lists heads from 0 and cannot describe a slice.
[[nodiscard]] inline std::vector<std::uint8_t> serialize_pt_stats(const QueryStats& stats,
                                                                  const std::string& archive_name = "stats") {
  detail::require_valid_stats(stats, "serialize_pt_stats");
  if (stats.first_q_head != 0)
    throw logic_error("serialize_pt_stats: a tensor-parallel slice (first_q_head " + std::to_string(stats.first_q_head) +
                      ") cannot be written as .pt; write the full statistics");
  if (archive_name.empty() || archive_name.find('/') != std::string::npos)
    throw logic_error("serialize_pt_stats: archive name '" + archive_name + "' must be non-empty without '/'");
  std::vector<std::uint8_t> pickle;
  std::vector<std::vector<std::uint8_t>> storages;
  detail::build_stats_pickle(stats, pickle, storages);
  detail::PtArchiveOptions options;
  options.root = archive_name;
  return detail::build_pt_archive(pickle, storages, options);
}

/// Writes serialize_pt_stats(stats, <file stem of path>) to `path`.
inline void save_pt_stats(const std::string& path, const QueryStats& stats) {
  std::string stem = path.substr(path.find_last_of('/') == std::string::npos ? 0 : path.find_last_of('/') + 1);
  if (const auto dot = stem.find_last_of('.'); dot != std::string::npos && dot > 0) stem.resize(dot);
  if (stem.empty()) stem = "stats";
  detail::write_file_bytes(path, serialize_pt_stats(stats, stem));
}

}  // namespace triattn
