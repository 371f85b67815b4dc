// SPDX-License-Identifier: Apache-2.0
// The library's own paged cache on the CPU (KvCache with the TriAttention scorer and top-k
// selector): what an engine without its own cache uses, and the oracle the round over an
// engine's view is compared with.
#include "bindings.hpp"

#include <cstring>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <triattn/core/kv_cache.hpp>
#include <triattn/core/policy/topk_selector.hpp>
#include <triattn/core/policy/triattention_scorer.hpp>

namespace triattn::python {
namespace {

using HostCache = KvCache<TriAttentionScorer, TopKSelector>;

using NumpyArray = nb::ndarray<nb::numpy>;

/// numpy dtype of the cache's storage type; bfloat16 and fp8 e4m3 (which numpy lacks) as their
/// uint16 / uint8 bits.
nb::dlpack::dtype numpy_dtype(DType t) {
  return triattn::dispatch_dtype(t, [](auto tag) -> nb::dlpack::dtype {
    using T = typename decltype(tag)::type;
    if constexpr (std::is_same_v<T, f16_storage>)
      return {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float), 16, 1};
    else if constexpr (std::is_same_v<T, bf16_storage>)
      return nb::dtype<std::uint16_t>();
    else if constexpr (std::is_same_v<T, fp8_e4m3_storage>)
      return nb::dtype<std::uint8_t>();
    else
      return nb::dtype<T>();
  });
}

/// A fresh numpy array of `bytes` bytes owned by a capsule, with the given shape and dtype.
NumpyArray owned_array(std::size_t bytes, std::initializer_list<std::size_t> shape, nb::dlpack::dtype dt) {
  auto* buf = new std::vector<std::uint8_t>(bytes);
  nb::capsule owner(buf, [](void* p) noexcept { delete static_cast<std::vector<std::uint8_t>*>(p); });
  return NumpyArray(buf->data(), shape.size(), shape.begin(), owner, nullptr, dt, nb::device::cpu::value);
}

void check_tokens(const HostCache& c, const ConstArray& a, const char* what, std::size_t n) {
  const ModelGeometry& g = c.config().model;
  expect_host(a, what);
  // fp8 e4m3 codes come as a uint8 view (numpy has no fp8 type): the cache's dtype says what they are
  const bool fp8_codes = c.config().dtype == DType::kFP8E4M3 && a.dtype() == nb::dtype<std::uint8_t>();
  const DType t = fp8_codes ? DType::kFP8E4M3 : cache_dtype(a, what);
  if (t != c.config().dtype)
    throw logic_error(std::string("triattn: ") + what + " has dtype " + dtype_name(t) + " but the cache stores " +
                      dtype_name(c.config().dtype));
  if (a.ndim() != 4 || a.shape(0) != static_cast<std::size_t>(g.num_layers) || a.shape(1) != n ||
      a.shape(2) != static_cast<std::size_t>(g.num_kv_heads) || a.shape(3) != static_cast<std::size_t>(g.head_dim))
    throw logic_error(std::string("triattn: ") + what + " must have shape [num_layers, n, num_kv_heads, head_dim] = [" +
                      std::to_string(g.num_layers) + ", " + std::to_string(n) + ", " + std::to_string(g.num_kv_heads) +
                      ", " + std::to_string(g.head_dim) + "]");
  std::int64_t expect = 1;
  for (std::size_t i = 4; a.size() != 0 && i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expect)
      throw logic_error(std::string("triattn: ") + what + " must be C-contiguous");
    expect *= static_cast<std::int64_t>(a.shape(i));
  }
}

}  // namespace

void bind_round(nb::module_& m) {
  nb::enum_<DType>(m, "DType", "Storage type of cached keys and values.")
      .value("FLOAT32", DType::kF32)
      .value("FLOAT16", DType::kF16)
      .value("BFLOAT16", DType::kBF16)
      .value("FP8_E4M3", DType::kFP8E4M3);
  nb::enum_<KvLayout>(m, "KvLayout", "Token/head order inside one block: NHD [block_size, heads, dim] or HND.")
      .value("NHD", KvLayout::kNHD)
      .value("HND", KvLayout::kHND);
  nb::enum_<Phase>(m, "Phase").value("PREFILL", Phase::kPrefill).value("DECODE", Phase::kDecode);

  nb::class_<ModelGeometry>(m, "ModelGeometry", "Attention shape of a model (what the KV cache cares about).")
      .def("__init__",
           [](ModelGeometry* self, int num_layers, int num_q_heads, int num_kv_heads, int head_dim) {
             new (self) ModelGeometry{num_layers, num_q_heads, num_kv_heads, head_dim};
           },
           nb::kw_only(), nb::arg("num_layers"), nb::arg("num_q_heads"), nb::arg("num_kv_heads"), nb::arg("head_dim"))
      .def_rw("num_layers", &ModelGeometry::num_layers)
      .def_rw("num_q_heads", &ModelGeometry::num_q_heads)
      .def_rw("num_kv_heads", &ModelGeometry::num_kv_heads)
      .def_rw("head_dim", &ModelGeometry::head_dim)
      .def("validate", &ModelGeometry::validate)
      .def("__repr__", [](const ModelGeometry& g) {
        return "ModelGeometry(num_layers=" + std::to_string(g.num_layers) + ", num_q_heads=" +
               std::to_string(g.num_q_heads) + ", num_kv_heads=" + std::to_string(g.num_kv_heads) +
               ", head_dim=" + std::to_string(g.head_dim) + ")";
      });
  const CacheConfig dc{};
  nb::class_<CacheConfig>(m, "CacheConfig", "Layout of a paged cache: geometry, block size, pool size, dtype.")
      .def("__init__",
           [](CacheConfig* self, const ModelGeometry& model, int block_size, int num_blocks, int max_seqs,
              int max_blocks_per_seq, KvLayout layout, DType dtype, bool track_positions, std::vector<float> kv_scales) {
             new (self) CacheConfig{model,  block_size, num_blocks,      max_seqs,
                                    max_blocks_per_seq, layout, dtype, track_positions, std::move(kv_scales)};
           },
           nb::arg("model"), nb::kw_only(), nb::arg("block_size") = dc.block_size, nb::arg("num_blocks"),
           nb::arg("max_seqs") = dc.max_seqs, nb::arg("max_blocks_per_seq") = 0, nb::arg("layout") = dc.layout,
           nb::arg("dtype") = dc.dtype, nb::arg("track_positions") = dc.track_positions,
           nb::arg("kv_scales") = std::vector<float>{})
      .def_rw("model", &CacheConfig::model)
      .def_rw("block_size", &CacheConfig::block_size)
      .def_rw("num_blocks", &CacheConfig::num_blocks)
      .def_rw("max_seqs", &CacheConfig::max_seqs)
      .def_rw("max_blocks_per_seq", &CacheConfig::max_blocks_per_seq)
      .def_rw("layout", &CacheConfig::layout)
      .def_rw("dtype", &CacheConfig::dtype)
      .def_rw("track_positions", &CacheConfig::track_positions,
              "Keep every slot's original position so reports carry kept_positions (off: lengths and status only).")
      .def_rw("kv_scales", &CacheConfig::kv_scales,
              "FP8_E4M3 only: dequantisation scales [num_layers * 2 * n], n = 1 (per layer K, V: vLLM's k_scale, "
              "v_scale) or num_kv_heads; a code c means value(c) * scale. Empty: all 1.")
      .def("block_bytes", &CacheConfig::block_bytes, "Bytes of one block in one (layer, K|V) range.")
      .def("block_bytes_all_ranges", &CacheConfig::block_bytes_all_ranges, "Bytes one block id owns (all layers, K, V).")
      .def("validate", &CacheConfig::validate);

  nb::class_<CompressionReport>(m, "CompressionReport", "What one round did to one sequence.")
      .def_ro("seq", &CompressionReport::seq)
      .def_ro("length_before", &CompressionReport::length_before)
      .def_ro("length_after", &CompressionReport::length_after)
      .def_ro("blocks_freed", &CompressionReport::blocks_freed)
      .def_ro("status", &CompressionReport::status)
      .def_ro("kept_rows", &CompressionReport::kept_rows)
      .def_prop_ro("kept_positions",
                   [](const CompressionReport& r) {
                     r.require_positions();  // a typed error naming track_positions, never an empty array
                     const std::size_t n = r.kept_positions.size() * sizeof(std::int32_t);
                     const std::size_t rows = static_cast<std::size_t>(r.kept_rows);
                     NumpyArray out = owned_array(n, {rows, rows ? r.kept_positions.size() / rows : 0},
                                                  nb::dtype<std::int32_t>());
                     if (n) std::memcpy(out.data(), r.kept_positions.data(), n);
                     return out;
                   },
                   nb::rv_policy::move,
                   "[kept_rows, length_after] original logical positions of the kept tokens (a copy); needs "
                   "CacheConfig(track_positions=True).");

  nb::class_<HostCache>(m, "KvCache",
                        "The library's own paged cache in host memory, with the TriAttention scorer and the top-k "
                        "selector (KvCache<TriAttentionScorer, TopKSelector> of the C++ API).")
      .def("__init__",
           [](HostCache* self, const CacheConfig& cfg, const QueryStats& stats, const RopeConfig& rope,
              const SelectionParams& selection, const ScoringParams& scoring) {
             new (self) HostCache(cfg, TriAttentionScorer(stats, rope, scoring, cfg.model.num_kv_heads),
                                  TopKSelector(selection));
           },
           nb::arg("config"), nb::arg("stats"), nb::arg("rope"), nb::arg("selection"),
           nb::arg("scoring") = ScoringParams{})
      .def("add_sequence", [](HostCache& c) { return c.add_sequence(); })
      .def("release", &HostCache::release, nb::arg("seq"))
      .def("append",
           [](HostCache& c, SeqId seq, const ConstArray& k, const ConstArray& v, Phase phase) {
             const std::size_t n = k.ndim() == 4 ? k.shape(1) : 0;
             check_tokens(c, k, "k", n);
             check_tokens(c, v, "v", n);
             bool ok = false;
             triattn::dispatch_dtype(c.config().dtype, [&](auto tag) {
               using T = typename decltype(tag)::type;
               const std::size_t count = k.size();
               const AppendResult r = c.append<T>(seq, std::span<const T>(static_cast<const T*>(k.data()), count),
                                                  std::span<const T>(static_cast<const T*>(v.data()), count),
                                                  static_cast<int>(n), phase);
               ok = r.ok();
             });
             return ok;
           },
           nb::arg("seq"), nb::arg("k"), nb::arg("v"), nb::arg("phase") = Phase::kDecode,
           "Appends n tokens; k, v: [num_layers, n, num_kv_heads, head_dim] of the cache's dtype (FP8_E4M3: the "
           "codes as uint8). False (nothing changed) when the pool is out of blocks.")
      .def("append_values",
           [](HostCache& c, SeqId seq, const ConstArray& k, const ConstArray& v, Phase phase) {
             const ModelGeometry& g = c.config().model;
             const std::size_t n = k.ndim() == 4 ? k.shape(1) : 0;
             for (const auto& [a, what] : {std::pair<const ConstArray&, const char*>{k, "k"}, {v, "v"}}) {
               expect_host(a, what);
               expect_contiguous<float>(a, 4, what);
               if (a.shape(0) != static_cast<std::size_t>(g.num_layers) || a.shape(1) != n ||
                   a.shape(2) != static_cast<std::size_t>(g.num_kv_heads) || a.shape(3) != static_cast<std::size_t>(g.head_dim))
                 throw logic_error(std::string("triattn: ") + what +
                                   " must have shape [num_layers, n, num_kv_heads, head_dim]");
             }
             const std::size_t count = k.size();
             return c.append_values(seq, std::span<const float>(static_cast<const float*>(k.data()), count),
                                    std::span<const float>(static_cast<const float*>(v.data()), count),
                                    static_cast<int>(n), phase)
                 .ok();
           },
           nb::arg("seq"), nb::arg("k"), nb::arg("v"), nb::arg("phase") = Phase::kDecode,
           "Appends n tokens from float32 k, v [num_layers, n, num_kv_heads, head_dim], rounded to the cache's "
           "dtype (FP8_E4M3: divided by the scale, nearest even, saturating at +-448). False when out of blocks.")
      .def("needs_compression", &HostCache::needs_compression, nb::arg("seq"))
      .def("compress", &HostCache::compress, nb::arg("seq"), "One round: score, select, compact, free tail blocks.")
      .def("compress_if_needed",
           [](HostCache& c, const std::vector<SeqId>& seqs) { return c.compress_if_needed(seqs); }, nb::arg("seqs"),
           "The round over every sequence of `seqs` whose trigger fired; what was done.")
      .def("physical_length", &HostCache::physical_length, nb::arg("seq"))
      .def("logical_position", &HostCache::logical_position, nb::arg("seq"))
      .def("prompt_length", &HostCache::prompt_length, nb::arg("seq"))
      .def("block_table",
           [](const HostCache& c, SeqId seq) {
             const auto t = c.block_table(seq);
             NumpyArray out = owned_array(t.size_bytes(), {t.size()}, nb::dtype<std::int32_t>());
             std::memcpy(out.data(), t.data(), t.size_bytes());
             return out;
           },
           nb::arg("seq"), "Block ids of `seq` in slot order (a copy).")
      .def("blocks_free", [](const HostCache& c) { return c.memory().blocks_free; })
      .def("gather",
           [](const HostCache& c, SeqId seq) {
             const ModelGeometry& g = c.config().model;
             const int len = c.physical_length(seq);
             const std::size_t esz = dtype_size(c.config().dtype);
             const std::size_t vec = static_cast<std::size_t>(g.head_dim) * esz;
             const std::size_t per = static_cast<std::size_t>(g.num_layers) * len * g.num_kv_heads * vec;
             const auto dt = numpy_dtype(c.config().dtype);
             const std::initializer_list<std::size_t> shape = {static_cast<std::size_t>(g.num_layers),
                                                               static_cast<std::size_t>(len),
                                                               static_cast<std::size_t>(g.num_kv_heads),
                                                               static_cast<std::size_t>(g.head_dim)};
             NumpyArray k = owned_array(per, shape, dt), v = owned_array(per, shape, dt);
             triattn::dispatch_dtype(c.config().dtype, [&](auto tag) {
               using T = typename decltype(tag)::type;
               const auto view = c.view<T>();
               auto* kd = static_cast<std::uint8_t*>(k.data());
               auto* vd = static_cast<std::uint8_t*>(v.data());
               for (int l = 0; l < g.num_layers; ++l)
                 for (int s = 0; s < len; ++s)
                   for (int h = 0; h < g.num_kv_heads; ++h) {
                     const std::size_t off = ((static_cast<std::size_t>(l) * len + s) * g.num_kv_heads + h) * vec;
                     std::memcpy(kd + off, view.token(l, KvKind::kKey, seq, s, h), vec);
                     std::memcpy(vd + off, view.token(l, KvKind::kValue, seq, s, h), vec);
                   }
             });
             return nb::make_tuple(k, v);
           },
           nb::arg("seq"), "(K, V) of `seq`'s cached slots, [num_layers, length, num_kv_heads, head_dim] copies (bfloat16 as uint16 bits).");
}

}  // namespace triattn::python
