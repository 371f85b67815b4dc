// SPDX-License-Identifier: Apache-2.0
// Parameters (scoring, selection, RoPE) and query statistics: QueryStats, the .pt and native
// (safetensors) loaders and writers, synthetic statistics, tensor-parallel slicing.
#include "bindings.hpp"

#include <cstring>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <triattn/core/selection.hpp>
#include <triattn/core/rope_types.hpp>
#include <triattn/core/scoring_params.hpp>
#include <triattn/core/stats/pt_loader.hpp>
#include <triattn/core/stats/pt_writer.hpp>
#include <triattn/core/stats/common.hpp>
#include <triattn/core/stats/random.hpp>
#include <triattn/core/stats/safetensors.hpp>
#include <triattn/core/stats/slice.hpp>
#include <triattn/core/trigger.hpp>

namespace triattn::python {
namespace {

using FloatArray = nb::ndarray<nb::numpy, float>;

/// A numpy array [L, Hq, F] owning a copy of `v`.
FloatArray to_numpy(const std::vector<float>& v, const QueryStats& s) {
  auto* copy = new std::vector<float>(v);
  nb::capsule owner(copy, [](void* p) noexcept { delete static_cast<std::vector<float>*>(p); });
  const std::size_t shape[3] = {static_cast<std::size_t>(s.num_layers), static_cast<std::size_t>(s.num_q_heads),
                                static_cast<std::size_t>(s.num_freqs())};
  return FloatArray(copy->data(), 3, shape, owner);
}

std::vector<float> from_numpy(const ConstArray& a, const char* name, std::size_t (&shape)[3]) {
  expect_host(a, name);
  expect_contiguous<float>(a, 3, name);
  for (int i = 0; i < 3; ++i) {
    if (shape[i] == 0) shape[i] = a.shape(i);
    if (a.shape(i) != shape[i])
      throw logic_error(std::string("triattn: QueryStats: ") + name + " has shape [" + std::to_string(a.shape(0)) + ", " +
                        std::to_string(a.shape(1)) + ", " + std::to_string(a.shape(2)) + "]; expected [" +
                        std::to_string(shape[0]) + ", " + std::to_string(shape[1]) + ", " + std::to_string(shape[2]) +
                        "] like the other arrays");
  }
  const auto* p = static_cast<const float*>(a.data());
  return std::vector<float>(p, p + a.size());
}

StatsExpectation expectation(std::optional<int> layers, std::optional<int> heads, std::optional<int> head_dim,
                             std::optional<RopeStyle> style) {
  StatsExpectation e;
  e.num_layers = layers;
  e.num_q_heads = heads;
  e.head_dim = head_dim;
  e.rope_style = style;
  return e;
}

}  // namespace

void bind_params(nb::module_& m) {
  nb::enum_<Aggregation>(m, "Aggregation", "How a key's per-offset scores are reduced over the offsets.")
      .value("MEAN", Aggregation::kMean)
      .value("MAX", Aggregation::kMax);
  nb::enum_<PruningMode>(m, "PruningMode", "What one selection round chooses (spec section 4).")
      .value("PER_HEAD", PruningMode::kPerHead)
      .value("PER_LAYER_PER_HEAD", PruningMode::kPerLayerPerHead)
      .value("UNION", PruningMode::kUnion);
  nb::enum_<NonFinitePolicy>(m, "NonFinitePolicy", "What a round does with non-finite scores.")
      .value("REFUSE", NonFinitePolicy::kRefuse)
      .value("EVICT_FIRST", NonFinitePolicy::kEvictFirst);
  nb::enum_<PromptMode>(m, "PromptMode", "How prompt tokens take part in selection (spec section 5).")
      .value("PINNED_IN_BUDGET", PromptMode::kPinnedInBudget)
      .value("PINNED_ON_TOP", PromptMode::kPinnedOnTop)
      .value("COMPETE", PromptMode::kCompete);
  nb::enum_<RopeStyle>(m, "RopeStyle", "How the head_dim entries form complex pairs.")
      .value("HALF", RopeStyle::kHalf)
      .value("INTERLEAVED", RopeStyle::kInterleaved);
  nb::enum_<RopeScalingKind>(m, "RopeScalingKind")
      .value("NONE", RopeScalingKind::kNone)
      .value("LINEAR", RopeScalingKind::kLinear)
      .value("LLAMA3", RopeScalingKind::kLlama3)
      .value("YARN", RopeScalingKind::kYarn);

  nb::class_<ScoringParams>(m, "ScoringParams", "How a cached key is scored (spec section 3).")
      .def("__init__",
           [](ScoringParams* self, int offset_max_length, Aggregation aggregation, bool disable_mlr, bool disable_trig) {
             new (self) ScoringParams{offset_max_length, aggregation, disable_mlr, disable_trig};
           },
           nb::kw_only(), nb::arg("offset_max_length") = ScoringParams{}.offset_max_length,
           nb::arg("aggregation") = ScoringParams{}.aggregation, nb::arg("disable_mlr") = false,
           nb::arg("disable_trig") = false)
      .def_rw("offset_max_length", &ScoringParams::offset_max_length)
      .def_rw("aggregation", &ScoringParams::aggregation)
      .def_rw("disable_mlr", &ScoringParams::disable_mlr)
      .def_rw("disable_trig", &ScoringParams::disable_trig)
      .def("validate", &ScoringParams::validate, "Raises LogicError naming the first bad value.")
      .def("__repr__", [](const ScoringParams& p) {
        return "ScoringParams(offset_max_length=" + std::to_string(p.offset_max_length) + ", aggregation=" +
               to_string(p.aggregation) + ", disable_mlr=" + (p.disable_mlr ? "True" : "False") +
               ", disable_trig=" + (p.disable_trig ? "True" : "False") + ")";
      });

  const SelectionParams d{};
  nb::class_<SelectionParams>(m, "SelectionParams", "Which keys a round keeps and when rounds happen (spec 4, 5).")
      .def("__init__",
           [](SelectionParams* self, int budget, int divide_length, PruningMode mode, bool normalize, PromptMode prompt,
              int n_sink, int window, bool compress_during_prefill, NonFinitePolicy nonfinite) {
             new (self) SelectionParams{budget, divide_length, mode, normalize, prompt, n_sink, window,
                                        compress_during_prefill, nonfinite};
           },
           nb::kw_only(), nb::arg("budget") = d.budget, nb::arg("divide_length") = d.divide_length,
           nb::arg("mode") = d.mode, nb::arg("normalize") = d.normalize, nb::arg("prompt") = d.prompt,
           nb::arg("n_sink") = d.n_sink, nb::arg("window") = d.window,
           nb::arg("compress_during_prefill") = d.compress_during_prefill, nb::arg("nonfinite") = d.nonfinite)
      .def_rw("budget", &SelectionParams::budget)
      .def_rw("divide_length", &SelectionParams::divide_length)
      .def_rw("mode", &SelectionParams::mode)
      .def_rw("normalize", &SelectionParams::normalize)
      .def_rw("prompt", &SelectionParams::prompt)
      .def_rw("n_sink", &SelectionParams::n_sink)
      .def_rw("window", &SelectionParams::window)
      .def_rw("compress_during_prefill", &SelectionParams::compress_during_prefill)
      .def_rw("nonfinite", &SelectionParams::nonfinite)
      .def("validate", &SelectionParams::validate, "Raises LogicError naming the first bad value.")
      .def("threshold", &CompressionTrigger::threshold, "Counted length at which a round fires (budget + divide_length).")
      .def("__repr__", [](const SelectionParams& p) {
        return "SelectionParams(budget=" + std::to_string(p.budget) + ", divide_length=" + std::to_string(p.divide_length) +
               ", mode=" + to_string(p.mode) + ", normalize=" + (p.normalize ? "True" : "False") +
               ", prompt=" + to_string(p.prompt) + ", n_sink=" + std::to_string(p.n_sink) +
               ", window=" + std::to_string(p.window) +
               ", compress_during_prefill=" + (p.compress_during_prefill ? "True" : "False") +
               ", nonfinite=" + to_string(p.nonfinite) + ")";
      });

  nb::class_<KeepCounts>(m, "KeepCounts", "How a round splits a sequence's slots (keep_counts()).")
      .def_ro("length", &KeepCounts::length)
      .def_ro("num_protected", &KeepCounts::num_protected)
      .def_ro("selectable_begin", &KeepCounts::selectable_begin)
      .def_ro("selectable_end", &KeepCounts::selectable_end)
      .def_ro("quota", &KeepCounts::quota)
      .def_ro("keep", &KeepCounts::keep)
      .def_ro("identity", &KeepCounts::identity);
  // Plain SelectionParams in, validated once at the conversion the call makes (ValidSelectionParams).
  m.def("keep_counts",
        [](int length, int prompt_len, const SelectionParams& params, int protected_prefix) {
          return selection::keep_counts(length, prompt_len, params, protected_prefix);
        },
        nb::arg("length"), nb::arg("prompt_len"), nb::arg("params"),
        nb::arg("protected_prefix") = 0,
        "Protected / selectable split and kept count of a round over `length` slots (the first "
        "`protected_prefix` of them, e.g. a shared prefix, kept in place).");
  m.def("counted_length", &CompressionTrigger::counted_length, nb::arg("phys_len"), nb::arg("prompt_len"),
        nb::arg("params"), "Length the trigger compares with budget + divide_length.");
  m.def("should_compress",
        [](int counted_len, bool is_decode_step, const SelectionParams& params) {
          return CompressionTrigger::should_compress(counted_len, is_decode_step, params);
        },
        nb::arg("counted_len"), nb::arg("is_decode_step"),
        nb::arg("params"), "Whether a round runs now.");

  nb::class_<RopeScaling>(m, "RopeScaling", "Frequency scaling as the model computes its inv_freq.")
      .def(nb::init<>())
      .def_rw("kind", &RopeScaling::kind)
      .def_rw("factor", &RopeScaling::factor)
      .def_rw("low_freq_factor", &RopeScaling::low_freq_factor)
      .def_rw("high_freq_factor", &RopeScaling::high_freq_factor)
      .def_rw("original_max_position", &RopeScaling::original_max_position)
      .def_rw("beta_fast", &RopeScaling::beta_fast)
      .def_rw("beta_slow", &RopeScaling::beta_slow)
      .def_rw("mscale", &RopeScaling::mscale)
      .def_rw("mscale_all_dim", &RopeScaling::mscale_all_dim)
      .def_rw("attention_factor", &RopeScaling::attention_factor)
      .def_rw("truncate", &RopeScaling::truncate);
  nb::class_<RopeConfig>(m, "RopeConfig", "The model's rotary embedding: pairing style, theta, scaling.")
      .def("__init__",
           [](RopeConfig* self, RopeStyle style, double theta, std::optional<RopeScaling> scaling) {
             new (self) RopeConfig{style, theta, scaling.value_or(RopeScaling{})};
           },
           nb::kw_only(), nb::arg("style") = RopeStyle::kHalf, nb::arg("theta") = 10000.0,
           nb::arg("scaling") = nb::none())
      .def_rw("style", &RopeConfig::style)
      .def_rw("theta", &RopeConfig::theta)
      .def_rw("scaling", &RopeConfig::scaling);
}

void bind_stats(nb::module_& m) {
  nb::class_<QueryStats>(m, "QueryStats",
                         "Calibrated per-(layer, query head) pre-RoPE query statistics, arrays [layers, q_heads, "
                         "head_dim / 2].")
      .def("__init__",
           [](QueryStats* self, const ConstArray& q_mean_real, const ConstArray& q_mean_imag, const ConstArray& q_abs_mean,
              RopeStyle rope_style, std::string model_name, int first_q_head) {
             std::size_t shape[3] = {0, 0, 0};
             QueryStats s;
             s.q_mean_real = from_numpy(q_mean_real, "q_mean_real", shape);
             s.q_mean_imag = from_numpy(q_mean_imag, "q_mean_imag", shape);
             s.q_abs_mean = from_numpy(q_abs_mean, "q_abs_mean", shape);
             s.num_layers = static_cast<int>(shape[0]);
             s.num_q_heads = static_cast<int>(shape[1]);
             s.head_dim = static_cast<int>(2 * shape[2]);
             s.rope_style = rope_style;
             s.model_name = std::move(model_name);
             s.first_q_head = first_q_head;
             detail::require_valid_stats(s, "QueryStats");
             new (self) QueryStats(std::move(s));
           },
           nb::arg("q_mean_real"), nb::arg("q_mean_imag"), nb::arg("q_abs_mean"), nb::kw_only(),
           nb::arg("rope_style") = RopeStyle::kHalf, nb::arg("model_name") = "", nb::arg("first_q_head") = 0,
           "From float32 arrays [layers, q_heads, head_dim / 2]; the values are checked like a loaded file's.")
      .def_ro("model_name", &QueryStats::model_name)
      .def_ro("rope_style", &QueryStats::rope_style)
      .def_ro("num_layers", &QueryStats::num_layers)
      .def_ro("num_q_heads", &QueryStats::num_q_heads)
      .def_ro("head_dim", &QueryStats::head_dim)
      .def_ro("first_q_head", &QueryStats::first_q_head)
      .def_prop_ro("q_mean_real", [](const QueryStats& s) { return to_numpy(s.q_mean_real, s); }, nb::rv_policy::move, "A copy, [L, Hq, F].")
      .def_prop_ro("q_mean_imag", [](const QueryStats& s) { return to_numpy(s.q_mean_imag, s); }, nb::rv_policy::move, "A copy, [L, Hq, F].")
      .def_prop_ro("q_abs_mean", [](const QueryStats& s) { return to_numpy(s.q_abs_mean, s); }, nb::rv_policy::move, "A copy, [L, Hq, F].")
      .def("__repr__", [](const QueryStats& s) {
        return "QueryStats(model_name='" + s.model_name + "', num_layers=" + std::to_string(s.num_layers) +
               ", num_q_heads=" + std::to_string(s.num_q_heads) + ", head_dim=" + std::to_string(s.head_dim) +
               ", rope_style=" + rope_style_name(s.rope_style) + ", first_q_head=" + std::to_string(s.first_q_head) + ")";
      });

  const char* expect_doc =
      "Keyword arguments that are given must match the file (FormatError otherwise): the files carry no model "
      "config, so this is the guard against another model's statistics.";
  m.def("load_pt_stats",
        [](const std::string& path, std::optional<int> num_layers, std::optional<int> num_q_heads,
           std::optional<int> head_dim, std::optional<RopeStyle> rope_style) {
          return load_pt_stats(path, expectation(num_layers, num_q_heads, head_dim, rope_style));
        },
        nb::arg("path"), nb::kw_only(), nb::arg("num_layers") = nb::none(), nb::arg("num_q_heads") = nb::none(),
        nb::arg("head_dim") = nb::none(), nb::arg("rope_style") = nb::none(),
        (std::string("Loads TriAttention's published .pt statistics. ") + expect_doc).c_str());
  m.def("load_stats",
        [](const std::string& path, std::optional<int> num_layers, std::optional<int> num_q_heads,
           std::optional<int> head_dim, std::optional<RopeStyle> rope_style) {
          return load_safetensors_stats(path, expectation(num_layers, num_q_heads, head_dim, rope_style));
        },
        nb::arg("path"), nb::kw_only(), nb::arg("num_layers") = nb::none(), nb::arg("num_q_heads") = nb::none(),
        nb::arg("head_dim") = nb::none(), nb::arg("rope_style") = nb::none(),
        (std::string("Loads triattn's native (safetensors) statistics. ") + expect_doc).c_str());
  m.def("save_pt_stats", &save_pt_stats, nb::arg("path"), nb::arg("stats"), "Writes TriAttention's .pt format.");
  m.def("save_stats", &save_safetensors_stats, nb::arg("path"), nb::arg("stats"),
        "Writes triattn's native (safetensors) format.");
  m.def("random_query_stats",
        [](std::uint64_t seed, int num_layers, int num_q_heads, int head_dim, RopeStyle style) {
          // The loaders' limits (stats/common.hpp), checked before anything is allocated.
          if (const auto problem = detail::geometry_problem(num_layers, num_q_heads, head_dim))
            throw logic_error("triattn: random_query_stats: " + *problem);
          std::mt19937_64 rng(seed);
          return random_query_stats(rng, num_layers, num_q_heads, head_dim, style);
        },
        nb::arg("seed"), nb::arg("num_layers"), nb::arg("num_q_heads"), nb::arg("head_dim"),
        nb::arg("rope_style") = RopeStyle::kHalf,
        ("Synthetic statistics (tests, benchmarks; not a model's): the same seed gives the same statistics. The "
         "shape has the stats files' limits: at most " + std::to_string(detail::kMaxStatsLayers) + " layers, " +
         std::to_string(detail::kMaxStatsHeads) + " heads, head_dim " + std::to_string(detail::kMaxStatsHeadDim) +
         " and " + std::to_string(detail::kMaxStatsValues) +
         " values per array; LogicError beyond them, before anything is allocated.")
            .c_str());
  m.def("slice_for_rank", &slice_for_rank, nb::arg("stats"), nb::arg("rank"), nb::arg("tp"), nb::arg("num_kv_heads"),
        "The query heads tensor-parallel rank `rank` of `tp` serves.");
}

}  // namespace triattn::python
