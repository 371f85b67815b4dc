// SPDX-License-Identifier: Apache-2.0
// Model files by path: a llama-architecture GGUF (*.gguf: weights and BPE tokenizer in one file)
// or a llama2.c v0 checkpoint. What the reference transformer and the serving loop both load.
#pragma once

#include <string>

#include "gguf.hpp"
#include "gguf_llama.hpp"
#include "llama2c.hpp"
#include "model_config.hpp"

namespace triattn_example {

/// Whether `path` names a GGUF model (by its extension).
inline bool is_gguf_path(const std::string& path) {
  return path.size() > 5 && path.compare(path.size() - 5, 5, ".gguf") == 0;
}

/// The weights of the model file at `path` (GGUF or llama2.c, by is_gguf_path).
/// @throws what the loaders throw on a missing or malformed file.
inline ModelWeights load_model_weights(const std::string& path) {
  if (is_gguf_path(path)) return gguf_llama_weights(gguf::File::load(path));
  return load_llama2c_checkpoint(path);
}

}  // namespace triattn_example
