// SPDX-License-Identifier: Apache-2.0
// Loads TriAttention's published calibration files (PyTorch `torch.save` zip archives) into
// QueryStats without torch: zip_reader finds `<root>/data.pkl` and the `<root>/data/<key>`
// storages, pickle_reader decodes the pickle, and this file interprets it. Expected shape:
//   {"metadata": {"rope_style", "head_dim", "model_name", "sampled_heads": [[layer, head], ...]},
//    "stats": {"layerLL_headHH": {"q_mean_real": T, "q_mean_imag": T, "q_abs_mean": T}, ...}}
//   T = torch._utils._rebuild_tensor_v2(persistent_id(("storage", torch.FloatStorage, key,
//       location, numel)), offset, (F,), (1,), requires_grad, hooks[, metadata])
// Every deviation (other dtypes, shapes, strides, missing or duplicated heads, big-endian data,
// non-finite values, |q_mean| > q_abs_mean) throws format_error starting with the file name.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/rope_types.hpp>
#include <triattn/core/stats/common.hpp>
#include <triattn/core/stats/pickle_reader.hpp>
#include <triattn/core/stats/query_stats.hpp>
#include <triattn/core/stats/zip_reader.hpp>

namespace triattn {
namespace detail {

class PtInterpreter {
 public:
  PtInterpreter(const PickleDoc& doc, const ZipReader& zip, std::string root, const std::string& path)
      : doc_(doc), zip_(zip), root_(std::move(root)), path_(path) {}

  QueryStats run() {
    const std::uint32_t top = doc_.root;
    require(top, PyKind::kDict, "the pickled object");
    const std::uint32_t meta = get(top, "metadata", "the pickled dict");
    const std::uint32_t stats = get(top, "stats", "the pickled dict");
    require(meta, PyKind::kDict, "metadata");
    require(stats, PyKind::kDict, "stats");

    QueryStats out;
    const std::string& style = str(get(meta, "rope_style", "metadata"), "metadata.rope_style");
    const auto parsed = parse_rope_style(style);
    if (!parsed) fail("metadata.rope_style '" + style + "' is neither 'half' nor 'interleaved'");
    out.rope_style = *parsed;
    out.model_name = str(get(meta, "model_name", "metadata"), "metadata.model_name");
    const std::int64_t head_dim = integer(get(meta, "head_dim", "metadata"), "metadata.head_dim");
    if (head_dim < 2 || head_dim > kMaxStatsHeadDim || head_dim % 2 != 0)
      fail("metadata.head_dim " + std::to_string(head_dim) + " must be even and in [2, " +
           std::to_string(kMaxStatsHeadDim) + "]");
    out.head_dim = static_cast<int>(head_dim);
    read_sampled_heads(get(meta, "sampled_heads", "metadata"), out);
    read_stats(stats, out);
    return out;
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { throw format_error(path_ + ": " + what); }

  const PyObj& obj(std::uint32_t id) const { return doc_[id]; }
  // Context strings are `what` + `suffix`, joined only when a check fails (the success path runs
  // thousands of times per file).
  void require(std::uint32_t id, PyKind kind, const std::string& what, const char* suffix = "") const {
    if (obj(id).kind != kind)
      fail(what + suffix + " is a " + py_kind_name(obj(id).kind) + ", expected a " + py_kind_name(kind));
  }
  const std::string& str(std::uint32_t id, const std::string& what, const char* suffix = "") const {
    require(id, PyKind::kStr, what, suffix);
    return obj(id).text;
  }
  std::int64_t integer(std::uint32_t id, const std::string& what, const char* suffix = "") const {
    require(id, PyKind::kInt, what, suffix);
    return obj(id).integer;
  }
  // Value of string key `key` in a dict; missing or duplicated keys are errors.
  std::optional<std::uint32_t> find(std::uint32_t dict, std::string_view key, const std::string& what) const {
    const auto& items = obj(dict).items;
    std::optional<std::uint32_t> found;
    for (std::size_t i = 0; i + 1 < items.size(); i += 2) {
      const PyObj& k = obj(items[i]);
      if (k.kind != PyKind::kStr || k.text != key) continue;
      if (found) fail(what + " has the key '" + std::string(key) + "' twice");
      found = items[i + 1];
    }
    return found;
  }
  std::uint32_t get(std::uint32_t dict, std::string_view key, const std::string& what) const {
    const auto v = find(dict, key, what);
    if (!v) fail(what + " has no '" + std::string(key) + "' entry");
    return *v;
  }
  const std::vector<std::uint32_t>& sequence(std::uint32_t id, const std::string& what, const char* suffix = "") const {
    const PyObj& o = obj(id);
    if (o.kind != PyKind::kList && o.kind != PyKind::kTuple)
      fail(what + suffix + " is a " + py_kind_name(o.kind) + ", expected a list or tuple");
    return o.items;
  }

  // sampled_heads must list every (layer, head) of a full [L, Hq] grid exactly once.
  void read_sampled_heads(std::uint32_t id, QueryStats& out) const {
    const auto& pairs = sequence(id, "metadata.sampled_heads");
    if (pairs.empty()) fail("metadata.sampled_heads is empty");
    std::vector<std::pair<int, int>> heads;
    heads.reserve(pairs.size());
    int layers = 0, q_heads = 0;
    const std::string what = "an element of metadata.sampled_heads";
    for (std::size_t i = 0; i < pairs.size(); ++i) {
      const auto& lh = sequence(pairs[i], what);
      if (lh.size() != 2)
        fail("metadata.sampled_heads[" + std::to_string(i) + "] has " + std::to_string(lh.size()) +
             " elements, expected [layer, head]");
      const std::int64_t l = integer(lh[0], what, " (layer)"), h = integer(lh[1], what, " (head)");
      if (l < 0 || l >= kMaxStatsLayers || h < 0 || h >= kMaxStatsHeads)
        fail("metadata.sampled_heads[" + std::to_string(i) + "] = [" + std::to_string(l) + ", " + std::to_string(h) +
             "] is out of range");
      heads.emplace_back(static_cast<int>(l), static_cast<int>(h));
      layers = std::max(layers, static_cast<int>(l) + 1);
      q_heads = std::max(q_heads, static_cast<int>(h) + 1);
    }
    std::vector<std::uint8_t> seen(static_cast<std::size_t>(layers) * q_heads, 0);  // [layers, q_heads]
    for (const auto& [l, h] : heads) {
      auto& s = seen[static_cast<std::size_t>(l) * q_heads + h];
      if (s) fail("metadata.sampled_heads lists " + head_key(l, h) + " twice");
      s = 1;
    }
    for (std::size_t i = 0; i < seen.size(); ++i) {
      if (seen[i]) continue;
      const int l = static_cast<int>(i / q_heads), h = static_cast<int>(i % q_heads);
      fail("missing head " + head_key(l, h) + ": metadata.sampled_heads does not cover the full grid of " +
           std::to_string(layers) + " layers x " + std::to_string(q_heads) + " query heads");
    }
    out.num_layers = layers;
    out.num_q_heads = q_heads;
  }

  // "layer03_head05" -> (3, 5); only the canonical spelling is accepted.
  std::optional<std::pair<int, int>> parse_key(const std::string& key) const {
    int l = 0, h = 0;
    std::size_t i = 0;
    auto digits = [&](int& v) {
      const std::size_t start = i;
      while (i < key.size() && key[i] >= '0' && key[i] <= '9' && i - start < 6) v = v * 10 + (key[i++] - '0');
      return i > start;
    };
    if (key.compare(0, 5, "layer") != 0) return std::nullopt;
    i = 5;
    if (!digits(l) || key.compare(i, 5, "_head") != 0) return std::nullopt;
    i += 5;
    if (!digits(h) || i != key.size() || head_key(l, h) != key) return std::nullopt;
    return std::make_pair(l, h);
  }

  void read_stats(std::uint32_t stats, QueryStats& out) const {
    // Check the size before allocating: a small hostile pickle can claim a huge grid.
    if (auto p = geometry_problem(out.num_layers, out.num_q_heads, out.head_dim)) fail("unsupported geometry: " + *p);
    const int nf = out.num_freqs();
    const std::size_t n = static_cast<std::size_t>(out.num_layers) * out.num_q_heads * nf;
    out.q_mean_real.assign(n, 0.0f);
    out.q_mean_imag.assign(n, 0.0f);
    out.q_abs_mean.assign(n, 0.0f);
    std::vector<std::uint8_t> seen(static_cast<std::size_t>(out.num_layers) * out.num_q_heads, 0);  // [L, Hq]
    const auto& items = obj(stats).items;
    for (std::size_t i = 0; i + 1 < items.size(); i += 2) {
      const std::string& key = str(items[i], "a key of stats");
      const auto lh = parse_key(key);
      if (!lh) fail("stats key '" + key + "' is not of the form layerLL_headHH");
      const auto [l, h] = *lh;
      if (l >= out.num_layers || h >= out.num_q_heads)
        fail("stats has " + key + ", which metadata.sampled_heads does not list");
      auto& s = seen[static_cast<std::size_t>(l) * out.num_q_heads + h];
      if (s) fail("stats has " + key + " twice");
      s = 1;
      const std::uint32_t entry = items[i + 1];
      const std::string what = "stats['" + key + "']";
      require(entry, PyKind::kDict, what);
      const std::size_t off = out.offset(l, h);
      read_tensor(get(entry, "q_mean_real", what), what, "['q_mean_real']", nf, out.q_mean_real.data() + off);
      read_tensor(get(entry, "q_mean_imag", what), what, "['q_mean_imag']", nf, out.q_mean_imag.data() + off);
      read_tensor(get(entry, "q_abs_mean", what), what, "['q_abs_mean']", nf, out.q_abs_mean.data() + off);
    }
    for (std::size_t i = 0; i < seen.size(); ++i) {
      if (seen[i]) continue;
      fail("missing head " + head_key(static_cast<int>(i / out.num_q_heads), static_cast<int>(i % out.num_q_heads)) +
           ": stats has no entry for it");
    }
  }

  // "(64,)" / "(8, 8)", as Python prints a shape.
  std::string shape_text(const std::vector<std::uint32_t>& dims) const {
    std::string s = "(";
    for (std::size_t i = 0; i < dims.size(); ++i) {
      const PyObj& d = obj(dims[i]);
      s += (i ? ", " : "") + (d.kind == PyKind::kInt ? std::to_string(d.integer) : std::string("?"));
    }
    return s + (dims.size() == 1 ? ",)" : ")");
  }

  // Decodes one _rebuild_tensor_v2 call (named entry + field) and copies its F float32 values
  // into `dst` [F].
  void read_tensor(std::uint32_t id, const std::string& head, const char* field, int nf, float* dst) const {
    const std::string what = head + field;
    const PyObj& call = obj(id);
    const bool is_call = call.kind == PyKind::kReduce && obj(call.items[0]).kind == PyKind::kGlobal &&
                         obj(call.items[0]).text == "torch._utils" && obj(call.items[0]).name == "_rebuild_tensor_v2";
    if (!is_call) fail(what + " is not a tensor (expected a torch._utils._rebuild_tensor_v2 call)");
    const auto& args = obj(call.items[1]).items;
    if (args.size() != 6 && args.size() != 7)
      fail(what + ": _rebuild_tensor_v2 has " + std::to_string(args.size()) + " arguments, expected 6 or 7");
    // Storage: persistent_id(("storage", torch.<T>Storage, key, location, numel)).
    require(args[0], PyKind::kPersId, what, " storage");
    const auto& pid = sequence(obj(args[0]).items[0], what, " storage id");
    if (pid.size() != 5 || obj(pid[0]).kind != PyKind::kStr || obj(pid[0]).text != "storage")
      fail(what + ": storage id is not ('storage', type, key, location, numel)");
    const PyObj& type = obj(pid[1]);
    if (type.kind != PyKind::kGlobal) fail(what + ": storage type is a " + std::string(py_kind_name(type.kind)));
    if (type.text != "torch" || type.name != "FloatStorage")
      fail(what + ": storage type " + type.text + "." + type.name +
           " is not supported (only torch.FloatStorage, i.e. float32)");
    const std::string& key = str(pid[2], what, " storage key");
    str(pid[3], what, " storage location");
    const std::int64_t numel = integer(pid[4], what, " storage numel");
    const std::int64_t offset = integer(args[1], what, " storage offset");
    const auto& size = sequence(args[2], what, " size");
    const auto& stride = sequence(args[3], what, " stride");
    if (size.size() != 1 || obj(size[0]).kind != PyKind::kInt || obj(size[0]).integer != nf)
      fail(what + " has shape " + shape_text(size) + ", expected (" + std::to_string(nf) + ",) = (head_dim / 2,)");
    if (stride.size() != 1 || obj(stride[0]).kind != PyKind::kInt || obj(stride[0]).integer != 1)
      fail(what + " has stride " + shape_text(stride) + ", expected (1,) (contiguous)");
    require(args[4], PyKind::kBool, what, " requires_grad");

    const std::string entry_name = root_ + "data/" + key;
    const ZipEntry* entry = zip_.find(entry_name);
    if (!entry) fail(what + ": storage entry '" + entry_name + "' is missing from the archive");
    const auto data = zip_.read(*entry);
    if (numel < 0 || static_cast<std::uint64_t>(numel) * 4 != data.size())
      fail(what + ": storage '" + entry_name + "' holds " + std::to_string(data.size()) + " bytes, but its id says " +
           std::to_string(numel) + " float32 values");
    if (offset < 0 || offset > numel || nf > numel - offset)
      fail(what + ": storage offset " + std::to_string(offset) + " + " + std::to_string(nf) +
           " values runs past the storage's " + std::to_string(numel) + " values");
    const std::uint8_t* p = data.data() + static_cast<std::size_t>(offset) * 4;
    for (int f = 0; f < nf; ++f) dst[f] = load_le_f32(p + 4 * f);
  }

  const PickleDoc& doc_;
  const ZipReader& zip_;
  std::string root_;  // "<archive folder>/"
  const std::string& path_;
};

}  // namespace detail

/// Loads a TriAttention `.pt` statistics file held in memory; `name` starts every message.
/// Throws format_error for anything malformed, unsupported or unexpected (see file comment).
[[nodiscard]] inline QueryStats load_pt_stats(std::span<const std::uint8_t> bytes, const std::string& name,
                                              const StatsExpectation& expect = {}) {
  const detail::ZipReader zip(bytes, name);
  const detail::ZipEntry* pkl = nullptr;
  for (const auto& e : zip.entries()) {
    const std::size_t slash = e.name.find('/');
    if (slash == std::string::npos || slash == 0 || e.name.compare(slash, std::string::npos, "/data.pkl") != 0) continue;
    if (pkl) throw format_error(name + ": two pickles ('" + pkl->name + "' and '" + e.name + "')");
    pkl = &e;
  }
  if (!pkl) throw format_error(name + ": no '<folder>/data.pkl' entry: not a PyTorch archive");
  const std::string root = pkl->name.substr(0, pkl->name.size() - 8);  // keeps the trailing '/'

  if (const detail::ZipEntry* bo = zip.find(root + "byteorder")) {
    const auto b = zip.read(*bo);
    const std::string order(b.begin(), b.end());
    if (order == "big") throw format_error(name + ": byteorder is 'big': big-endian not supported");
    if (order != "little") throw format_error(name + ": unrecognized byteorder '" + order + "'");
  }
  const detail::PickleDoc doc = detail::parse_pickle(zip.read(*pkl), name + ": " + pkl->name);
  QueryStats stats = detail::PtInterpreter(doc, zip, root, name).run();
  detail::finish_loaded_stats(stats, expect, name);
  return stats;
}

/// Loads a TriAttention `.pt` statistics file from disk.
[[nodiscard]] inline QueryStats load_pt_stats(const std::string& path, const StatsExpectation& expect = {}) {
  const std::vector<std::uint8_t> bytes = detail::read_file_bytes(path);
  return load_pt_stats(std::span<const std::uint8_t>(bytes), path, expect);
}

}  // namespace triattn
