// SPDX-License-Identifier: Apache-2.0
// triattn-stats: inspect TriAttention query statistics (.pt from TriAttention, or triattn's
// native .safetensors) and convert .pt to .safetensors. Exit codes: 0 ok, 1 error (message on
// stderr), 2 bad usage.
#include <cstdio>
#include <exception>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <triattn/core/stats.hpp>

namespace {

constexpr const char* kUsage =
    "usage:\n"
    "  triattn-stats inspect FILE [--layers L] [--q-heads H] [--head-dim D] [--rope half|interleaved]\n"
    "      print model, rope style, geometry and the per-layer concentration R = |E z| / E|z|\n"
    "  triattn-stats convert IN.pt OUT.safetensors [same options]\n"
    "      convert TriAttention's .pt statistics to triattn's native safetensors format\n"
    "FILE may be a .pt (torch.save zip) or a .safetensors file; the format is detected from its\n"
    "first bytes. The options check the file against the model's geometry.\n";

struct UsageError {
  std::string message;
};

std::optional<int> parse_positive(const std::string& s) {
  if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  const int v = std::stoi(s);
  return v > 0 ? std::optional<int>(v) : std::nullopt;
}

// Splits argv into positional arguments and the expectation options.
std::vector<std::string> parse(int argc, char** argv, triattn::StatsExpectation& expect) {
  std::vector<std::string> positional;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--", 0) != 0) {
      positional.push_back(a);
      continue;
    }
    if (i + 1 >= argc) throw UsageError{"option " + a + " needs a value"};
    const std::string v = argv[++i];
    if (a == "--rope") {
      expect.rope_style = triattn::parse_rope_style(v);
      if (!expect.rope_style) throw UsageError{"--rope must be 'half' or 'interleaved', not '" + v + "'"};
      continue;
    }
    const auto n = parse_positive(v);
    if (!n) throw UsageError{"option " + a + " needs a positive integer, not '" + v + "'"};
    if (a == "--layers") expect.num_layers = *n;
    else if (a == "--q-heads") expect.num_q_heads = *n;
    else if (a == "--head-dim") expect.head_dim = *n;
    else throw UsageError{"unknown option " + a};
  }
  return positional;
}

/// A statistics file read once (a regular file within triattn::kMaxStatsFileBytes; a FIFO or
/// device is refused without blocking), and whether it is a torch.save zip.
struct StatsFile {
  std::vector<std::uint8_t> bytes;
  bool zip = false;
};

StatsFile read_stats_file(const std::string& path) {
  StatsFile f{triattn::read_regular_file<std::vector<std::uint8_t>>(path, triattn::kMaxStatsFileBytes)};
  const auto& b = f.bytes;
  f.zip = b.size() >= 4 && b[0] == 'P' && b[1] == 'K' && b[2] == 3 && b[3] == 4;
  return f;
}

int inspect(const std::string& path, const triattn::StatsExpectation& expect) {
  const StatsFile f = read_stats_file(path);
  const std::span<const std::uint8_t> bytes(f.bytes);
  const triattn::QueryStats s = f.zip ? triattn::load_pt_stats(bytes, path, expect)
                                      : triattn::load_safetensors_stats(bytes, path, expect);
  std::printf("file         %s\n", path.c_str());
  std::printf("format       %s\n", f.zip ? "TriAttention .pt (torch.save zip)" : "triattn safetensors");
  std::printf("model        %s\n", s.model_name.c_str());
  std::printf("rope style   %s\n", triattn::rope_style_name(s.rope_style));
  std::printf("layers       %d\n", s.num_layers);
  std::printf("q heads      %d (global heads %d..%d)\n", s.num_q_heads, s.first_q_head,
              s.first_q_head + s.num_q_heads - 1);
  std::printf("head_dim     %d\n", s.head_dim);
  std::printf("F            %d\n", s.num_freqs());
  std::printf("\nconcentration R = |q_mean| / q_abs_mean over heads x frequencies\n");
  std::printf("layer   R mean    R min    R max\n");
  for (const auto& c : triattn::concentration_by_layer(s))
    std::printf("%5d  %7.4f  %7.4f  %7.4f\n", c.layer, c.mean, c.min, c.max);
  return 0;
}

int convert(const std::string& in, const std::string& out, const triattn::StatsExpectation& expect) {
  triattn::check_write_target(out);  // a FIFO or device target fails before any work
  const triattn::QueryStats s = triattn::load_pt_stats(in, expect);
  triattn::save_safetensors_stats(out, s);  // through a temporary file renamed into place
  // Read back what was written: a conversion that cannot be loaded must not look successful.
  const triattn::QueryStats back = triattn::load_safetensors_stats(out);
  if (back.q_mean_real != s.q_mean_real || back.q_mean_imag != s.q_mean_imag || back.q_abs_mean != s.q_abs_mean)
    throw triattn::error(out + ": read-back differs from the source");
  std::printf("%s -> %s: %s, %d layers x %d q heads, head_dim %d\n", in.c_str(), out.c_str(), s.model_name.c_str(),
              s.num_layers, s.num_q_heads, s.head_dim);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc < 2) throw UsageError{"missing command"};
    const std::string cmd = argv[1];
    if (cmd == "-h" || cmd == "--help" || cmd == "help") {
      std::fputs(kUsage, stdout);
      return 0;
    }
    triattn::StatsExpectation expect;
    const std::vector<std::string> args = parse(argc, argv, expect);
    if (cmd == "inspect") {
      if (args.size() != 1) throw UsageError{"inspect takes one FILE"};
      return inspect(args[0], expect);
    }
    if (cmd == "convert") {
      if (args.size() != 2) throw UsageError{"convert takes IN.pt and OUT.safetensors"};
      return convert(args[0], args[1], expect);
    }
    throw UsageError{"unknown command '" + cmd + "'"};
  } catch (const UsageError& e) {
    std::fprintf(stderr, "triattn-stats: %s\n%s", e.message.c_str(), kUsage);
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "triattn-stats: %s\n", e.what());
    return 1;
  }
}
