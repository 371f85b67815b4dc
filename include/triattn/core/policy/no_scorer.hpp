// SPDX-License-Identifier: Apache-2.0
// Default scorer and selector roles of KvCache: none. A cache without them pages and compacts
// plans the engine supplies, but has no compress().
#pragma once

#include <triattn/core/concepts.hpp>

namespace triattn {

struct NoScorer {
  using policy_role = scorer_role;
};

struct NoSelector {
  using policy_role = selector_role;
};

}  // namespace triattn
