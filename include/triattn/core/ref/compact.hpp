// SPDX-License-Identifier: Apache-2.0
// Oracle of the CUDA compactor and append kernels: the host K/V operations (core/host_kv_ops.hpp),
// under the names tests compare against. Production code includes core/host_kv_ops.hpp.
#pragma once

#include <triattn/core/host_kv_ops.hpp>

namespace triattn::ref {

using host::append;
using host::compact;
using host::copy_block;
using host::append_values;

}  // namespace triattn::ref
