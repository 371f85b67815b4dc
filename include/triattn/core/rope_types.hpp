// SPDX-License-Identifier: Apache-2.0
// Rotary position embedding description: pairing style and frequency scaling. Plain data; the
// frequency math lives in core/rope.hpp.
#pragma once

namespace triattn {

/// How the d entries of a head form d/2 complex pairs.
enum class RopeStyle : int {
  kHalf = 0,         ///< pair f is (x[f], x[f + d/2]): NeoX / HF rotate_half (Qwen, Llama-HF)
  kInterleaved = 1,  ///< pair f is (x[2f], x[2f+1]): GPT-J, llama2.c, Meta Llama
};

enum class RopeScalingKind : int { kNone = 0, kLinear = 1, kLlama3 = 2, kYarn = 3 };

/// Frequency scaling exactly as the model computes its inv_freq. Fields not used by `kind` are
/// ignored. Defaults are the HF defaults where HF has one.
struct RopeScaling {
  RopeScalingKind kind = RopeScalingKind::kNone;
  double factor = 1.0;                   ///< linear / llama3 / yarn scaling factor
  double low_freq_factor = 1.0;          ///< llama3
  double high_freq_factor = 4.0;         ///< llama3
  double original_max_position = 8192;   ///< llama3 / yarn
  double beta_fast = 32.0;               ///< yarn
  double beta_slow = 1.0;                ///< yarn
  double mscale = 1.0;                   ///< yarn (DeepSeek style; 0 = unset)
  double mscale_all_dim = 0.0;           ///< yarn (DeepSeek style; 0 = unset)
  double attention_factor = 0.0;         ///< yarn; 0 = derive from factor (0.1 ln s + 1)
  bool truncate = true;                  ///< yarn: floor/ceil the correction range (HF default; gpt-oss: false)
};

struct RopeConfig {
  RopeStyle style = RopeStyle::kHalf;
  double theta = 10000.0;
  RopeScaling scaling{};
};

}  // namespace triattn
