// SPDX-License-Identifier: Apache-2.0
// The batched compression round over an engine's own paged cache: PagedCache (a view of the
// engine's per-layer K and V tensors, any strides), Compressor (statistics, RoPE, parameters)
// and its round over host arrays (the library's CPU round) or CUDA arrays (the kernels, on the
// caller's stream; CUDA builds only). Every array is checked (dtype, device, shape, contiguity)
// before the library is called, and the library checks the view's contents before it writes.
#include "bindings.hpp"

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <triattn/core/admission.hpp>
#include <triattn/core/cache_geometry.hpp>
#include <triattn/engine/paged_round.hpp>
#include <triattn/core/policy/triattention_scorer.hpp>

#ifdef TRIATTN_PYTHON_WITH_CUDA
#include "cuda_glue.hpp"
#endif

namespace triattn::python {
namespace {

constexpr int kCpu = nb::device::cpu::value;

/// Host nanoseconds the last round spent inside the library call (the C++ launch on the GPU):
/// what benchmarks/python/bench_round.py subtracts from the Python call's time.
std::atomic<long long> g_last_round_ns{0};

long long since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t).count();
}
constexpr int kCuda = nb::device::cuda::value;

std::string device_str(int type, int id) {
  if (type == kCpu) return "cpu";
  if (type == kCuda) return "cuda:" + std::to_string(id);
  return "DLPack device type " + std::to_string(type) + ":" + std::to_string(id);
}

/// An engine's per-layer K and V tensors, viewed in place: each [num_blocks, block_size,
/// num_kv_heads, head_dim] with any strides (head_dim contiguous), all of one shape, strides,
/// dtype and device. The object holds the arrays themselves (not the caller's lists), so they
/// stay alive as long as it does, whatever the caller does with its lists.
struct PagedCache {
  DType dtype = DType::kF32;
  int device_type = kCpu;
  int device_id = 0;
  BlockLayout block{};
  int num_layers = 0;
  int num_blocks = 0;
  std::vector<void*> ranges;     // [2 * num_layers] (layer, K|V) bases, host copy
  void* device_ranges = nullptr; // the same on the device (CUDA caches)
  std::vector<Array> k, v;       // the viewed arrays (each holds its exporter and its export)
  nb::tuple k_objects, v_objects;  // the same, as the caller's objects

  PagedCache(std::vector<Array> k_arrays, std::vector<Array> v_arrays, nb::tuple k_objs, nb::tuple v_objs)
      : k(std::move(k_arrays)), v(std::move(v_arrays)), k_objects(std::move(k_objs)), v_objects(std::move(v_objs)) {
    if (k.empty() || k.size() != v.size())
      throw logic_error("triattn: PagedCache needs one K and one V tensor per layer; got " + std::to_string(k.size()) +
                        " K and " + std::to_string(v.size()) + " V tensors");
    const Array& a0 = k[0];
    dtype = cache_dtype(a0, "k[0]");
    device_type = a0.device_type();
    device_id = a0.device_id();
    if (device_type != kCpu && device_type != kCuda)
      throw logic_error("triattn: k[0] is on " + device_str(device_type, device_id) + "; expected cpu or cuda");
    if (a0.ndim() != 4)
      throw logic_error("triattn: k[0] has " + std::to_string(a0.ndim()) +
                        " dimensions; expected 4: [num_blocks, block_size, num_kv_heads, head_dim] (a view of the "
                        "engine's tensor, see triattn.vllm_cache / triattn.sglang_cache)");
    std::int64_t shape[4], stride[4];
    for (int i = 0; i < 4; ++i) {
      shape[i] = static_cast<std::int64_t>(a0.shape(i));
      // A dimension of extent 1 is never stepped over; give it the dense stride so that numpy's
      // 0 strides of inserted axes do not look like overlapping vectors.
      stride[i] = a0.stride(i);
    }
    for (int i = 0; i < 4; ++i) {
      if (shape[i] < 1 || shape[i] > 0x7fffffff)
        throw logic_error("triattn: k[0] dimension " + std::to_string(i) + " has extent " + std::to_string(shape[i]));
      if (shape[i] == 1) {
        std::int64_t dense = 1;
        for (int j = i + 1; j < 4; ++j) dense *= shape[j];
        stride[i] = dense;
      }
    }
    if (stride[3] != 1)
      throw logic_error("triattn: k[0]'s head_dim is not contiguous (stride " + std::to_string(stride[3]) +
                        " elements); every head vector must be contiguous");
    for (int i = 0; i < 3; ++i)
      if (stride[i] <= 0)
        throw logic_error("triattn: k[0] has a non-positive stride " + std::to_string(stride[i]) + " in dimension " +
                          std::to_string(i));
    num_layers = static_cast<int>(k.size());
    num_blocks = static_cast<int>(shape[0]);
    block = BlockLayout::strided(static_cast<int>(shape[1]), static_cast<int>(shape[2]), static_cast<int>(shape[3]),
                                 stride[0], stride[1], stride[2]);
    ranges.resize(2 * k.size());
    for (std::size_t l = 0; l < k.size(); ++l) {
      for (int kind = 0; kind < 2; ++kind) {
        const Array& a = kind == 0 ? k[l] : v[l];
        const std::string name = std::string(kind == 0 ? "k[" : "v[") + std::to_string(l) + "]";
        if (cache_dtype(a, name) != dtype)
          throw logic_error("triattn: " + name + " has dtype " + dtype_name(cache_dtype(a, name)) + " but k[0] has " +
                            dtype_name(dtype));
        if (a.device_type() != device_type || a.device_id() != device_id)
          throw logic_error("triattn: " + name + " is on " + device_str(a.device_type(), a.device_id()) +
                            " but k[0] is on " + device_str(device_type, device_id));
        bool same = a.ndim() == 4;
        for (int i = 0; same && i < 4; ++i)
          same = static_cast<std::int64_t>(a.shape(i)) == shape[i] && (shape[i] == 1 || a.stride(i) == stride[i]);
        if (!same)
          throw logic_error("triattn: " + name + " differs from k[0] in shape or strides; every layer's K and V must "
                            "share one layout");
        ranges[2 * l + kind] = a.data();
      }
    }
    for (std::size_t i = 0; i < ranges.size(); ++i)
      for (std::size_t j = i + 1; j < ranges.size(); ++j)
        if (ranges[i] == ranges[j])
          throw logic_error("triattn: " + std::string(i % 2 ? "v[" : "k[") + std::to_string(i / 2) + "] and " +
                            (j % 2 ? "v[" : "k[") + std::to_string(j / 2) +
                            "] are the same memory; every (layer, K|V) needs its own");
    if (device_type == kCuda) {
#ifdef TRIATTN_PYTHON_WITH_CUDA
      device_ranges = cuda_glue::upload_pointers(ranges.data(), ranges.size(), device_id);
#else
      throw logic_error("triattn: the cache tensors are CUDA tensors but this triattn was built without CUDA "
                        "(rebuild with TRIATTN_PYTHON_CUDA=ON)");
#endif
    }
  }
  PagedCache(const PagedCache&) = delete;
  PagedCache& operator=(const PagedCache&) = delete;
  ~PagedCache() {
#ifdef TRIATTN_PYTHON_WITH_CUDA
    if (device_ranges) cuda_glue::free_pointers(device_ranges, device_id);
#endif
  }

  template <class T>
  [[nodiscard]] KvCacheView<T, std::int32_t> host_view(T* const* r, int max_seqs, int max_blocks_per_seq,
                                                       const std::int32_t* tables, const std::int32_t* lens) const {
    KvCacheView<T, std::int32_t> view;
    view.ranges = r;
    view.block = block;
    view.num_layers = num_layers;
    view.num_blocks = num_blocks;
    view.max_seqs = max_seqs;
    view.max_blocks_per_seq = max_blocks_per_seq;
    view.block_tables = tables;
    view.seq_lens = lens;
    return view;
  }
};

/// Statistics, RoPE and parameters of the round; the host scorer and, per device, the scorer's
/// constants on the GPU. One round at a time per Compressor (the host scorer has scratch):
/// `mutex` guards the selection, the scorers and the device models, and is only ever taken
/// with the GIL released (locked()), so no thread waits for one while holding the other.
struct Compressor {
  QueryStats stats;
  RopeConfig rope;
  ScoringParams scoring;
  SelectionParams selection;
  ModelGeometry geometry;
  TriAttentionScorer host;
  std::mutex mutex;
#ifdef TRIATTN_PYTHON_WITH_CUDA
  std::vector<std::pair<int, cuda_glue::DeviceModel*>> device_models;
#endif

  Compressor(const QueryStats& s, const RopeConfig& r, const SelectionParams& sel, const ScoringParams& sc, int num_kv_heads)
      : stats(s), rope(r), scoring(sc), selection(validated(sel)),
        geometry{s.num_layers, s.num_q_heads, num_kv_heads, s.head_dim}, host(s, r, sc, num_kv_heads) {
    geometry.validate();
  }
  Compressor(const Compressor&) = delete;
  Compressor& operator=(const Compressor&) = delete;
  ~Compressor() {
#ifdef TRIATTN_PYTHON_WITH_CUDA
    for (auto& [dev, m] : device_models) cuda_glue::free_device_model(m);
#endif
  }
  static const SelectionParams& validated(const SelectionParams& p) {
    p.validate();
    return p;
  }
#ifdef TRIATTN_PYTHON_WITH_CUDA
  cuda_glue::DeviceModel* device_model(int device) {
    for (auto& [dev, m] : device_models)
      if (dev == device) return m;
    device_models.emplace_back(device, cuda_glue::make_device_model(stats, rope, scoring, geometry.num_kv_heads, device));
    return device_models.back().second;
  }
#endif
};

/// f() under c's mutex. The GIL is released first and taken back after the mutex is released:
/// f must not touch Python objects (read the arrays' pointers before).
template <class F>
decltype(auto) locked(Compressor& c, F&& f) {
  nb::gil_scoped_release nogil;
  std::lock_guard<std::mutex> lock(c.mutex);
  return f();
}

/// Checks a [n] (or [n, rows, m]) int array of the round: dtype, device, shape, C order; `n` is
/// `expect` (what `expected` names) unless negative.
template <class Int, class A>
const Int* round_array(const A& a, const char* name, std::size_t ndim, std::int64_t expect, int dev_type, int dev_id,
                       const char* expected = "batch") {
  if (a.device_type() != dev_type || a.device_id() != dev_id)
    throw logic_error(std::string("triattn: ") + name + " is on " + device_str(a.device_type(), a.device_id()) +
                      " but the cache is on " + device_str(dev_type, dev_id));
  expect_contiguous<Int>(a, ndim, name);
  if (expect >= 0 && static_cast<std::int64_t>(a.shape(0)) != expect)
    throw logic_error(std::string("triattn: ") + name + " has " + std::to_string(a.shape(0)) +
                      " entries in its first dimension; expected " + expected + " = " + std::to_string(expect));
  return static_cast<const Int*>(a.data());
}

/// An optional array argument (None: absent).
template <class A>
std::optional<A> optional_array(nb::handle h, const char* name) {
  if (h.is_none()) return std::nullopt;
  return as_array<A>(h, name);
}

nb::object run_round(Compressor& c, PagedCache& cache, nb::handle block_tables_h, nb::handle seq_lens_h,
                     nb::handle seq_ids_h, nb::handle t0_h, nb::handle prompt_lens_h, nb::handle new_lens_h,
                     nb::handle status_h, nb::handle freed_begin_h, nb::handle freed_end_h, nb::handle kept_h,
                     nb::handle slot_positions_h, nb::handle workspace_h, int max_len, RoundTrigger trigger,
                     std::uintptr_t stream, nb::handle protected_prefix_h) {
  const int dt = cache.device_type, di = cache.device_id;
  // Geometry: the statistics and the cache must describe the same model.
  check_cache_geometry({cache.num_layers, cache.block.num_kv_heads, cache.block.head_dim}, cache_geometry(c.geometry),
                       "triattn", "the compressor's statistics");
  // The arrays live (and hold their memory) until this call returns, after the round.
  const auto block_tables = as_array<ConstArray>(block_tables_h, "block_tables");
  const auto seq_lens = as_array<ConstArray>(seq_lens_h, "seq_lens");
  const auto seq_ids = as_array<ConstArray>(seq_ids_h, "seq_ids");
  const auto t0 = as_array<ConstArray>(t0_h, "t0");
  const auto prompt_lens = as_array<ConstArray>(prompt_lens_h, "prompt_lens");
  const auto new_lens = as_array<Array>(new_lens_h, "new_lens");
  const auto status = as_array<Array>(status_h, "status");
  const auto freed_begin = as_array<Array>(freed_begin_h, "freed_begin");
  const auto freed_end = as_array<Array>(freed_end_h, "freed_end");
  const auto kept = optional_array<Array>(kept_h, "kept");
  const auto slot_positions = optional_array<ConstArray>(slot_positions_h, "slot_positions");
  const auto workspace = as_array<Array>(workspace_h, "workspace");
  const auto protected_prefix = optional_array<ConstArray>(protected_prefix_h, "protected_prefix");

  const auto* tables = round_array<std::int32_t>(block_tables, "block_tables", 2, -1, dt, di);
  const int max_seqs = static_cast<int>(block_tables.shape(0));
  const int max_blocks_per_seq = static_cast<int>(block_tables.shape(1));
  const auto* lens = round_array<std::int32_t>(seq_lens, "seq_lens", 1, max_seqs, dt, di, "max_seqs (block_tables rows)");
  const std::int64_t B = seq_ids.ndim() == 1 ? static_cast<std::int64_t>(seq_ids.shape(0)) : -1;
  RoundBatch batch;
  batch.seq_ids = round_array<std::int32_t>(seq_ids, "seq_ids", 1, -1, dt, di);
  batch.t0 = round_array<std::int64_t>(t0, "t0", 1, B, dt, di);
  batch.prompt_lens = round_array<std::int32_t>(prompt_lens, "prompt_lens", 1, B, dt, di);
  if (protected_prefix)
    batch.protected_prefix = round_array<std::int32_t>(*protected_prefix, "protected_prefix", 1, B, dt, di);
  batch.batch = static_cast<int>(B);
  batch.max_len = max_len;
  RoundOutputs out;
  out.new_lens = const_cast<std::int32_t*>(round_array<std::int32_t>(new_lens, "new_lens", 1, B, dt, di));
  out.status = const_cast<std::int32_t*>(round_array<std::int32_t>(status, "status", 1, B, dt, di));
  out.freed_begin = const_cast<std::int32_t*>(round_array<std::int32_t>(freed_begin, "freed_begin", 1, B, dt, di));
  out.freed_end = const_cast<std::int32_t*>(round_array<std::int32_t>(freed_end, "freed_end", 1, B, dt, di));
  if (kept) {
    out.kept = const_cast<std::int32_t*>(round_array<std::int32_t>(*kept, "kept", 3, B, dt, di));
    out.kept_rows = static_cast<int>(kept->shape(1));
    out.max_keep = static_cast<int>(kept->shape(2));
  }
  if (slot_positions) {
    out.slot_positions = round_array<std::int32_t>(*slot_positions, "slot_positions", 3, B, dt, di);
    out.positions_stride = static_cast<std::int64_t>(slot_positions->shape(2));
    const int rows = static_cast<int>(slot_positions->shape(1));
    if (kept && rows != out.kept_rows)
      throw logic_error("triattn: slot_positions has " + std::to_string(rows) + " rows per sequence but kept has " +
                        std::to_string(out.kept_rows) + "; both hold one row per kept_rows(mode, layers, kv_heads)");
    out.kept_rows = rows;
  }
  if (workspace.device_type() != dt || workspace.device_id() != di)
    throw logic_error("triattn: workspace is on " + device_str(workspace.device_type(), workspace.device_id()) +
                      " but the cache is on " + device_str(dt, di));
  expect_contiguous<std::uint8_t>(workspace, workspace.ndim(), "workspace");
  void* const ws = workspace.data();
  const std::size_t ws_bytes = workspace.nbytes();

  // Everything Python is read: the round runs with the GIL released, under the mutex.
  if (dt == kCpu) {
    const int done = locked(c, [&] {
      int n = 0;
      auto go = [&](auto tag) {
        using T = typename decltype(tag)::type;
        std::vector<T*> r(cache.ranges.size());
        for (std::size_t i = 0; i < r.size(); ++i) r[i] = static_cast<T*>(cache.ranges[i]);
        const auto view = cache.host_view<T>(r.data(), max_seqs, max_blocks_per_seq, tables, lens);
        const auto t = std::chrono::steady_clock::now();
        n = paged_round(view, c.host, c.selection, c.geometry, trigger, batch, out, ws, ws_bytes);
        g_last_round_ns = since(t);
      };
      triattn::dispatch_dtype(cache.dtype, go);
      return n;
    });
    return nb::int_(done);
  }
#ifdef TRIATTN_PYTHON_WITH_CUDA
  cuda_glue::ViewParts v;
  v.ranges = static_cast<void* const*>(cache.device_ranges);
  v.block = cache.block;
  v.num_layers = cache.num_layers;
  v.num_blocks = cache.num_blocks;
  v.max_seqs = max_seqs;
  v.max_blocks_per_seq = max_blocks_per_seq;
  v.block_tables = tables;
  v.seq_lens = lens;
  locked(c, [&] {
    cuda_glue::DeviceModel* model = c.device_model(di);
    const auto t = std::chrono::steady_clock::now();
    cuda_glue::run_round(cache.dtype, v, model, c.selection, trigger, batch, out, ws, ws_bytes, stream, di);
    g_last_round_ns = since(t);
  });
  return nb::none();
#else
  (void)stream;
  throw logic_error("triattn: built without CUDA");
#endif
}

}  // namespace

void bind_paged(nb::module_& m) {
  nb::enum_<RoundTrigger>(m, "RoundTrigger", "Which sequences of a batch a round compresses.", nb::is_arithmetic())
      .value("IF_DUE", RoundTrigger::kIfDue)
      .value("ALWAYS", RoundTrigger::kAlways);
  nb::enum_<RoundStatus>(m, "RoundStatus", "Outcome of one sequence of a round (the `status` output).", nb::is_arithmetic())
      .value("COMPRESSED", RoundStatus::kCompressed)
      .value("NOT_DUE", RoundStatus::kNotDue)
      .value("NON_FINITE", RoundStatus::kNonFinite)
      .value("NO_ROOM", RoundStatus::kNoRoom)
      .value("INVALID", RoundStatus::kInvalid);
#ifdef TRIATTN_PYTHON_WITH_CUDA
  m.def("round_error",
        [](const ConstArray& workspace) {
          if (workspace.device_type() != nb::device::cuda::value)
            throw logic_error("triattn: round_error: the workspace is not a CUDA array (CPU rounds raise instead)");
          nb::gil_scoped_release release;
          return cuda_glue::round_error(workspace.data(), workspace.device_id());
        },
        nb::arg("workspace"),
        "Why the device refused the last round run with `workspace` (statuses INVALID): \"\" when it did not. "
        "Waits for the device.");
#endif
  m.def("_last_round_ns", [] { return g_last_round_ns.load(); },
        "Host nanoseconds the last round spent inside the library call (benchmarks).");
  m.def("kept_rows", &kept_rows, nb::arg("mode"), nb::arg("num_layers"), nb::arg("num_kv_heads"),
        "Rows of kept positions one sequence has in `mode` (per_head: kv heads; per_layer_per_head: layers * kv "
        "heads; union: 1).");

  nb::class_<PagedCache>(m, "PagedCache",
                         "An engine's per-layer K and V tensors viewed in place (no copy): each [num_blocks, "
                         "block_size, num_kv_heads, head_dim] with any strides, head_dim contiguous.")
      .def("__init__",
           [](PagedCache* self, nb::handle k, nb::handle v) {
             std::vector<Array> arrays[2];
             nb::list objects[2];
             for (int kind = 0; kind < 2; ++kind) {
               const nb::handle seq = kind == 0 ? k : v;
               const char* name = kind == 0 ? "k" : "v";
               if (!nb::isinstance<nb::sequence>(seq))
                 throw argument_type_error(std::string("triattn: PagedCache: ") + name +
                                           " is not a sequence of arrays (one per layer); got " +
                                           nb::type_name(seq.type()).c_str());
               std::size_t i = 0;
               for (nb::handle h : nb::borrow<nb::sequence>(seq)) {
                 arrays[kind].push_back(
                     as_array<Array>(h, "PagedCache: " + std::string(name) + "[" + std::to_string(i++) + "]"));
                 objects[kind].append(h);
               }
             }
             new (self) PagedCache(std::move(arrays[0]), std::move(arrays[1]), nb::tuple(objects[0]),
                                   nb::tuple(objects[1]));
           },
           nb::arg("k"), nb::arg("v"))
      .def_prop_ro("k", [](const PagedCache& c) { return c.k_objects; }, "The K arrays viewed (a tuple; owned).")
      .def_prop_ro("v", [](const PagedCache& c) { return c.v_objects; }, "The V arrays viewed (a tuple; owned).")
      .def_prop_ro("num_layers", [](const PagedCache& c) { return c.num_layers; })
      .def_prop_ro("num_blocks", [](const PagedCache& c) { return c.num_blocks; })
      .def_prop_ro("block_size", [](const PagedCache& c) { return c.block.block_size; })
      .def_prop_ro("num_kv_heads", [](const PagedCache& c) { return c.block.num_kv_heads; })
      .def_prop_ro("head_dim", [](const PagedCache& c) { return c.block.head_dim; })
      .def_prop_ro("dtype", [](const PagedCache& c) { return c.dtype; })
      .def_prop_ro("device", [](const PagedCache& c) { return device_str(c.device_type, c.device_id); })
      .def_prop_ro("strides", [](const PagedCache& c) {
        return nb::make_tuple(c.block.stride_block, c.block.stride_token, c.block.stride_head);
      }, "Element strides (block, token, head) inside one range.");

  nb::class_<Compressor>(m, "Compressor",
                         "TriAttention's compression round: statistics, RoPE, selection and scoring parameters.")
      .def(nb::init<const QueryStats&, const RopeConfig&, const SelectionParams&, const ScoringParams&, int>(),
           nb::arg("stats"), nb::arg("rope"), nb::arg("selection"), nb::arg("scoring") = ScoringParams{}, nb::kw_only(),
           nb::arg("num_kv_heads"))
      .def_prop_rw("selection", [](Compressor& c) { return locked(c, [&] { return c.selection; }); },
                   [](Compressor& c, const SelectionParams& p) {
                     const SelectionParams copy = p;  // read while the GIL protects the Python object
                     copy.validate();
                     locked(c, [&] { c.selection = copy; });
                   })
      .def_prop_ro("scoring", [](const Compressor& c) { return c.scoring; })
      .def_prop_ro("rope", [](const Compressor& c) { return c.rope; })
      .def_prop_ro("geometry", [](const Compressor& c) { return c.geometry; })
      .def("kept_rows", [](Compressor& c) {
        const PruningMode mode = locked(c, [&] { return c.selection.mode; });
        return kept_rows(mode, c.geometry.num_layers, c.geometry.num_kv_heads);
      }, "Rows of kept positions per sequence under the current mode.")
      .def("workspace_size",
           [](Compressor& c, int batch, int max_len, const std::string& device, int max_seqs,
              int num_blocks) -> std::size_t {
             if (batch < 0 || max_len < 0)
               throw logic_error("triattn: workspace_size: batch = " + std::to_string(batch) + " and max_len = " +
                                 std::to_string(max_len) + " must be non-negative");
             if (device == "cpu") return paged_round_workspace_size(c.geometry, max_len);
#ifdef TRIATTN_PYTHON_WITH_CUDA
             if (device.rfind("cuda", 0) == 0) {
               int id = 0;
               if (device.size() > 5 && (device[4] != ':' || device.size() > 9 ||
                                         device.find_first_not_of("0123456789", 5) != std::string::npos))
                 throw logic_error("triattn: workspace_size: device '" + device + "' is not \"cuda\" or \"cuda:N\"");
               if (device.size() > 5) id = std::stoi(device.substr(5));
               return locked(c, [&] {
                 return cuda_glue::workspace_size(c.device_model(id), c.selection, batch, max_len, max_seqs,
                                                  num_blocks);
               });
             }
#endif
             throw logic_error("triattn: workspace_size: unknown or unsupported device '" + device + "'");
           },
           nb::arg("batch"), nb::arg("max_len"), nb::arg("device") = "cpu", nb::arg("max_seqs") = 0,
           nb::arg("num_blocks") = 0,
           "Workspace bytes of a round of `batch` sequences of at most `max_len` slots on `device` (\"cpu\" or "
           "\"cuda:N\"); the device round also needs the view's rows, `max_seqs`, and its blocks, `num_blocks` "
           "(the device counts every block's references).")
      .def("_round", &run_round, nb::arg("cache"), nb::arg("block_tables").none(), nb::arg("seq_lens").none(),
           nb::arg("seq_ids").none(), nb::arg("t0").none(), nb::arg("prompt_lens").none(), nb::arg("new_lens").none(),
           nb::arg("status").none(), nb::arg("freed_begin").none(), nb::arg("freed_end").none(), nb::arg("kept").none(),
           nb::arg("slot_positions").none(), nb::arg("workspace").none(), nb::arg("max_len"), nb::arg("trigger"), nb::arg("stream"), nb::arg("protected_prefix").none() = nb::none(),
           "The round with every array given (see triattn.Compressor.round for the documented entry point).");

  // ---- admission ------------------------------------------------------------------------------
  nb::class_<AdmissionRequest>(m, "AdmissionRequest")
      .def(nb::init<>())
      .def("__init__", [](AdmissionRequest* self, int p, int n) { new (self) AdmissionRequest{p, n}; },
           nb::arg("prompt_len"), nb::arg("max_new_tokens"))
      .def_rw("prompt_len", &AdmissionRequest::prompt_len)
      .def_rw("max_new_tokens", &AdmissionRequest::max_new_tokens);
  nb::class_<RequestFootprint>(m, "RequestFootprint", "Worst-case resources of one request over its life.")
      .def_ro("max_tokens", &RequestFootprint::max_tokens)
      .def_ro("max_blocks", &RequestFootprint::max_blocks)
      .def_ro("kv_bytes", &RequestFootprint::kv_bytes)
      .def_ro("round_workspace_bytes", &RequestFootprint::round_workspace_bytes)
      .def_ro("uncompressed_tokens", &RequestFootprint::uncompressed_tokens);
  m.def("max_resident_tokens",
        [](int prompt_len, int max_new_tokens, const SelectionParams& params) {
          return max_resident_tokens(prompt_len, max_new_tokens, params);
        },
        nb::arg("prompt_len"), nb::arg("max_new_tokens"),
        nb::arg("params"), "Most tokens a request ever holds with rounds after every decode step.");
  m.def("request_footprint", &request_footprint, nb::arg("config"), nb::arg("request"), nb::arg("params"),
        "Exact worst-case blocks and bytes of one request.");
  m.def("admissible_prefix",
        [](const CacheConfig& cfg, const std::vector<AdmissionRequest>& requests, const SelectionParams& params,
           std::int64_t free_blocks, std::int64_t reserved_blocks) {
          return admissible_prefix(cfg, requests, params, free_blocks, reserved_blocks);
        },
        nb::arg("config"), nb::arg("requests"), nb::arg("params"), nb::arg("free_blocks"), nb::arg("reserved_blocks") = 0,
        "How many leading requests fit in `free_blocks` next to `reserved_blocks` running ones may still need.");
}

}  // namespace triattn::python
