// SPDX-License-Identifier: Apache-2.0
// A GGUF reader (llama.cpp's model format, versions 2 and 3, little-endian): the header, every
// metadata key/value (all value types, arrays included), the tensor directory, the alignment
// (general.alignment, default 32) and the data section; tensors of type F32, F16, BF16, Q8_0,
// Q4_0 and Q4_1 are dequantised to float32. Any other tensor type is refused by name.
//
// Layout: "GGUF", u32 version, u64 tensor_count, u64 kv_count; kv_count times {string key, u32
// value type, value}; tensor_count times {string name, u32 n_dims, u64 ne[n_dims] (innermost
// first), u32 type, u64 offset}; padding to the alignment; the data section. A string is a u64
// length and its bytes (no NUL). Each tensor's offset is relative to the data section and a
// multiple of the alignment. Every count, length, size and offset is checked against the file
// before it is used; a bad file throws triattn::format_error("<name>: ...") and nothing is kept.
//
// Beyond the bounds checks a file must be exactly what it says:
//  - the tensors, in offset order, tile the data section: the first starts at data offset 0, and
//    each tensor's span (to the next tensor's offset, or to the end of the file for the last) is
//    its type's exact byte size n, padded at most to the alignment: n <= span <= align_up(n). As
//    offsets are aligned, every span but the last is exactly align_up(n); the last may stop at n
//    or run on to align_up(n). A tensor whose type or shape was changed to read fewer bytes fails;
//  - every quantisation scale (and Q4_1 minimum), and every F32/F16/BF16 value, is finite;
//  - what parsing allocates for the metadata and tensor directory (strings, array elements, map
//    nodes, counted with their container overhead) stays within kMetadataMemoryFactor times the
//    file size plus kMetadataMemorySlack, so a file of empty strings cannot take 18x its size.
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <triattn/core/dtype.hpp>
#include <triattn/core/error.hpp>
#include <triattn/core/file_io.hpp>

namespace triattn_example::gguf {

static_assert(std::endian::native == std::endian::little, "GGUF files read here are little-endian; add byte swaps");

/// Metadata value types (GGUF spec numbering).
enum class ValueType : std::uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7,
  kString = 8, kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12,
};

[[nodiscard]] inline const char* value_type_name(ValueType t) noexcept {
  switch (t) {
    case ValueType::kU8: return "u8";
    case ValueType::kI8: return "i8";
    case ValueType::kU16: return "u16";
    case ValueType::kI16: return "i16";
    case ValueType::kU32: return "u32";
    case ValueType::kI32: return "i32";
    case ValueType::kF32: return "f32";
    case ValueType::kBool: return "bool";
    case ValueType::kString: return "string";
    case ValueType::kArray: return "array";
    case ValueType::kU64: return "u64";
    case ValueType::kI64: return "i64";
    case ValueType::kF64: return "f64";
  }
  return "?";
}

/// Tensor types this reader dequantises (ggml numbering).
enum class TensorType : std::uint32_t { kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kBF16 = 30 };

/// ggml's name of a tensor type id ("type 99" for ids ggml does not define).
[[nodiscard]] inline std::string tensor_type_name(std::uint32_t id) {
  static constexpr const char* kNames[] = {
      "F32",     "F16",    "Q4_0",    "Q4_1",  "Q4_2 (removed)", "Q4_3 (removed)", "Q5_0",   "Q5_1",
      "Q8_0",    "Q8_1",   "Q2_K",    "Q3_K",  "Q4_K",           "Q5_K",           "Q6_K",   "Q8_K",
      "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ4_NL",         "IQ3_S",          "IQ2_S",  "IQ4_XS",
      "I8",      "I16",    "I32",     "I64",   "F64",            "IQ1_M",          "BF16",   "Q4_0_4_4 (removed)",
      "Q4_0_4_8 (removed)", "Q4_0_8_8 (removed)", "TQ1_0", "TQ2_0", "IQ4_NL_4_4 (removed)", "IQ4_NL_4_8 (removed)",
      "IQ4_NL_8_8 (removed)", "MXFP4"};
  if (id < std::size(kNames)) return kNames[id];
  return "type " + std::to_string(id);
}

/// Elements per block and bytes per block of a supported type; {0, 0} for any other id.
struct BlockShape {
  std::uint64_t elems = 0;
  std::uint64_t bytes = 0;
};
[[nodiscard]] constexpr BlockShape block_shape(std::uint32_t id) noexcept {
  switch (static_cast<TensorType>(id)) {
    case TensorType::kF32: return {1, 4};
    case TensorType::kF16: return {1, 2};
    case TensorType::kBF16: return {1, 2};
    case TensorType::kQ8_0: return {32, 34};  // f16 d, 32 x int8
    case TensorType::kQ4_0: return {32, 18};  // f16 d, 16 bytes of nibbles
    case TensorType::kQ4_1: return {32, 20};  // f16 d, f16 m, 16 bytes of nibbles
  }
  return {};
}

/// One metadata value. Scalars: integers in `i` (signed types and bool) or `u` (unsigned),
/// floats in `f`; strings in `s`. Arrays: element type in `elem`; integer and bool elements in
/// `ints` (unsigned ones converted, u64 values above INT64_MAX wrap), float elements in `floats`,
/// string and array elements in `array` (compact storage: a file cannot make the metadata take
/// much more memory than its own size).
struct Value {
  ValueType type = ValueType::kU8;
  std::int64_t i = 0;
  std::uint64_t u = 0;
  double f = 0.0;
  std::string s;
  ValueType elem = ValueType::kU8;
  std::vector<std::int64_t> ints;
  std::vector<double> floats;
  std::vector<Value> array;

  /// Number of elements of an array (0 for a scalar).
  [[nodiscard]] std::size_t size() const noexcept { return ints.size() + floats.size() + array.size(); }

  [[nodiscard]] bool is_integer() const noexcept {
    switch (type) {
      case ValueType::kU8: case ValueType::kI8: case ValueType::kU16: case ValueType::kI16:
      case ValueType::kU32: case ValueType::kI32: case ValueType::kU64: case ValueType::kI64: return true;
      default: return false;
    }
  }
  [[nodiscard]] bool is_unsigned() const noexcept {
    return type == ValueType::kU8 || type == ValueType::kU16 || type == ValueType::kU32 || type == ValueType::kU64;
  }
};

/// One entry of the tensor directory. `shape` is GGUF's ne[], innermost (contiguous) first: a
/// matrix of R rows of C columns has shape {C, R}.
struct TensorInfo {
  std::string name;
  std::vector<std::uint64_t> shape;
  std::uint32_t type = 0;
  std::uint64_t offset = 0;       ///< relative to the data section
  std::uint64_t n_elements = 0;
  std::uint64_t n_bytes = 0;

  [[nodiscard]] std::string shape_string() const {
    std::string r = "[";
    for (std::size_t d = 0; d < shape.size(); ++d) r += (d ? ", " : "") + std::to_string(shape[d]);
    return r + "]";
  }
};

/// Parsing may allocate at most kMetadataMemoryFactor x the file size + kMetadataMemorySlack
/// bytes for the metadata and the tensor directory (real models use far less than their size:
/// SmolLM2-135M's 49k-token vocabulary takes a fraction of its 98 MB; the slack lets small
/// metadata-only files through).
inline constexpr std::uint64_t kMetadataMemoryFactor = 4;
inline constexpr std::uint64_t kMetadataMemorySlack = std::uint64_t{16} << 20;

namespace detail {

/// Heap bytes a std::string of n characters allocates: none while it fits the small-string
/// buffer (15 characters in libstdc++), else n + 1 and the allocator's header.
constexpr std::uint64_t string_heap_bytes(std::uint64_t n) noexcept { return n > 15 ? n + 1 + 16 : 0; }
/// Bytes of one std::map node besides its value (red-black links and colour, allocator header).
constexpr std::uint64_t kMapNodeOverhead = 48;

/// Bounds-checked little-endian cursor over the file bytes; every failure names the file. It
/// also counts the memory that parsing allocates (charge()) and refuses a file beyond `limit`.
class Cursor {
 public:
  Cursor(std::span<const std::byte> b, const std::string& name, std::uint64_t memory_limit)
      : b_(b), name_(name), limit_(memory_limit) {}
  [[noreturn]] void fail(const std::string& what) const { throw triattn::format_error(name_ + ": " + what); }
  [[nodiscard]] std::size_t pos() const noexcept { return pos_; }
  [[nodiscard]] std::size_t left() const noexcept { return b_.size() - pos_; }
  void need(std::uint64_t n, const std::string& what) const {
    if (n > left())
      fail("truncated: " + what + " needs " + std::to_string(n) + " bytes at offset " + std::to_string(pos_) +
           ", the file has " + std::to_string(left()) + " left");
  }
  template <class T>
  T get(const std::string& what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof v);
    pos_ += sizeof v;
    return v;
  }
  /// Counts `bytes` about to be allocated for `what`; throws when the total passes the limit.
  void charge(std::uint64_t bytes, const std::string& what) {
    if (bytes > limit_ - used_)
      fail("the metadata and tensor directory would take more than " + std::to_string(limit_) +
           " bytes of memory (at " + what + "; the limit is " + std::to_string(kMetadataMemoryFactor) +
           " x the " + std::to_string(b_.size()) + "-byte file + " + std::to_string(kMetadataMemorySlack >> 20) +
           " MiB): too many small metadata values");
    used_ += bytes;
  }
  [[nodiscard]] std::uint64_t memory_used() const noexcept { return used_; }
  /// A string of the file; its heap bytes are charged (the std::string itself is the caller's).
  std::string str(const std::string& what) {
    const std::uint64_t n = get<std::uint64_t>(what + " (length)");
    need(n, what + " (" + std::to_string(n) + "-byte string)");
    charge(string_heap_bytes(n), what);
    std::string s(reinterpret_cast<const char*>(b_.data() + pos_), static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return s;
  }

 private:
  std::span<const std::byte> b_;
  const std::string& name_;
  std::size_t pos_ = 0;
  std::uint64_t limit_;
  std::uint64_t used_ = 0;
};

/// Smallest number of bytes one value of type t occupies (bounds the element counts of arrays).
constexpr std::uint64_t min_value_bytes(ValueType t) noexcept {
  switch (t) {
    case ValueType::kU8: case ValueType::kI8: case ValueType::kBool: return 1;
    case ValueType::kU16: case ValueType::kI16: return 2;
    case ValueType::kU32: case ValueType::kI32: case ValueType::kF32: return 4;
    case ValueType::kU64: case ValueType::kI64: case ValueType::kF64: case ValueType::kString: return 8;
    case ValueType::kArray: return 12;
  }
  return 1;
}

constexpr int kMaxArrayDepth = 4;

inline Value read_value(Cursor& c, ValueType t, const std::string& what, int depth) {
  Value v;
  v.type = t;
  switch (t) {
    case ValueType::kU8: v.u = c.get<std::uint8_t>(what); break;
    case ValueType::kI8: v.i = c.get<std::int8_t>(what); break;
    case ValueType::kU16: v.u = c.get<std::uint16_t>(what); break;
    case ValueType::kI16: v.i = c.get<std::int16_t>(what); break;
    case ValueType::kU32: v.u = c.get<std::uint32_t>(what); break;
    case ValueType::kI32: v.i = c.get<std::int32_t>(what); break;
    case ValueType::kU64: v.u = c.get<std::uint64_t>(what); break;
    case ValueType::kI64: v.i = c.get<std::int64_t>(what); break;
    case ValueType::kF32: v.f = c.get<float>(what); break;
    case ValueType::kF64: v.f = c.get<double>(what); break;
    case ValueType::kBool: {
      const std::uint8_t b = c.get<std::uint8_t>(what);
      if (b > 1) c.fail(what + ": bool value " + std::to_string(b) + " is neither 0 nor 1");
      v.i = b;
      break;
    }
    case ValueType::kString: v.s = c.str(what); break;
    case ValueType::kArray: {
      if (depth >= kMaxArrayDepth) c.fail(what + ": arrays nested deeper than " + std::to_string(kMaxArrayDepth));
      const std::uint32_t et = c.get<std::uint32_t>(what + " (array element type)");
      if (et > static_cast<std::uint32_t>(ValueType::kF64))
        c.fail(what + ": unknown array element type " + std::to_string(et));
      v.elem = static_cast<ValueType>(et);
      const std::uint64_t n = c.get<std::uint64_t>(what + " (array length)");
      if (n > c.left() / min_value_bytes(v.elem))
        c.fail("truncated: " + what + " declares " + std::to_string(n) + " elements of type " +
               value_type_name(v.elem) + ", more than the " + std::to_string(c.left()) + " bytes left can hold");
      // The elements' storage, charged before it is reserved; strings charge their heap bytes.
      const bool boxed = v.elem == ValueType::kString || v.elem == ValueType::kArray;
      c.charge(n * (boxed ? sizeof(Value) : sizeof(std::int64_t)), what);
      for (std::uint64_t k = 0; k < n; ++k) {
        const std::string& ew = what;  // element errors name the array; the index costs a string per element
        switch (v.elem) {
          case ValueType::kString: case ValueType::kArray:
            if (k == 0) v.array.reserve(static_cast<std::size_t>(n));
            v.array.push_back(read_value(c, v.elem, ew + "[" + std::to_string(k) + "]", depth + 1));
            break;
          case ValueType::kF32: case ValueType::kF64:
            if (k == 0) v.floats.reserve(static_cast<std::size_t>(n));
            v.floats.push_back(read_value(c, v.elem, ew, depth + 1).f);
            break;
          default: {
            if (k == 0) v.ints.reserve(static_cast<std::size_t>(n));
            const Value e = read_value(c, v.elem, ew, depth + 1);
            v.ints.push_back(e.is_unsigned() ? static_cast<std::int64_t>(e.u) : e.i);
          }
        }
      }
      break;
    }
    default: c.fail(what + ": unknown value type " + std::to_string(static_cast<std::uint32_t>(t)));
  }
  return v;
}

}  // namespace detail

/// A parsed GGUF file: metadata, tensor directory and the bytes, kept for dequantisation.
class File {
 public:
  static constexpr std::uint32_t kDefaultAlignment = 32;
  static constexpr std::uint32_t kMaxDims = 4;  ///< GGML_MAX_DIMS
  /// Largest file load() reads (it is held in memory whole): 64 GiB, a 30B model in 16 bits.
  static constexpr std::uint64_t kMaxFileBytes = std::uint64_t{64} << 30;

  /// Parses a whole file held in memory; `name` starts every error message.
  /// @throws triattn::format_error naming the file and the entry.
  static File parse(std::vector<std::byte> bytes, std::string name) {
    File f;
    f.bytes_ = std::move(bytes);
    f.name_ = std::move(name);
    f.parse_all();
    return f;
  }
  static File parse(std::span<const std::byte> bytes, std::string name) {
    return parse(std::vector<std::byte>(bytes.begin(), bytes.end()), std::move(name));
  }

  /// Reads and parses a file of at most kMaxFileBytes. A path that is not a regular file (a
  /// directory, a FIFO, a device) is refused before anything is read (triattn::read_regular_file).
  /// @throws triattn::format_error.
  static File load(const std::string& path) {
    return parse(triattn::read_regular_file<std::vector<std::byte>>(path, kMaxFileBytes), path);
  }

  [[nodiscard]] const std::string& name() const noexcept { return name_; }
  [[nodiscard]] std::uint32_t version() const noexcept { return version_; }
  [[nodiscard]] std::uint32_t alignment() const noexcept { return alignment_; }
  /// File offset of the data section (tensor offsets are relative to it).
  [[nodiscard]] std::uint64_t data_offset() const noexcept { return data_offset_; }
  [[nodiscard]] std::uint64_t file_size() const noexcept { return bytes_.size(); }
  /// Bytes parsing counted for the metadata and tensor directory (see kMetadataMemoryFactor).
  [[nodiscard]] std::uint64_t metadata_memory() const noexcept { return metadata_memory_; }

  /// Metadata keys in file order, with their values.
  [[nodiscard]] const std::vector<std::pair<std::string, Value>>& metadata() const noexcept { return kv_; }
  [[nodiscard]] const Value* find(std::string_view key) const {
    const auto it = kv_index_.find(std::string(key));
    return it == kv_index_.end() ? nullptr : &kv_[it->second].second;
  }
  [[nodiscard]] bool has(std::string_view key) const { return find(key) != nullptr; }

  /// The value of `key`, which must exist. @throws triattn::format_error naming the key.
  [[nodiscard]] const Value& at(std::string_view key) const {
    const Value* v = find(key);
    if (v == nullptr) fail("metadata key " + std::string(key) + " is missing");
    return *v;
  }
  /// Integer value of `key` (any integer type), checked to lie in [lo, hi].
  [[nodiscard]] std::int64_t get_int(std::string_view key, std::int64_t lo, std::int64_t hi) const {
    return int_in_range(at(key), std::string(key), lo, hi);
  }
  /// Float value of `key` (f32 or f64).
  [[nodiscard]] double get_float(std::string_view key) const {
    const Value& v = at(key);
    if (v.type != ValueType::kF32 && v.type != ValueType::kF64)
      fail("metadata " + std::string(key) + " has type " + value_type_name(v.type) + ", expected f32 or f64");
    return v.f;
  }
  [[nodiscard]] const std::string& get_string(std::string_view key) const {
    const Value& v = at(key);
    if (v.type != ValueType::kString)
      fail("metadata " + std::string(key) + " has type " + value_type_name(v.type) + ", expected string");
    return v.s;
  }
  /// The array value of `key`, whose elements must have type `elem`.
  [[nodiscard]] const Value& get_array(std::string_view key, ValueType elem) const {
    const Value& v = at(key);
    if (v.type != ValueType::kArray || v.elem != elem)
      fail("metadata " + std::string(key) + " has type " + value_type_name(v.type) +
           (v.type == ValueType::kArray ? std::string(" of ") + value_type_name(v.elem) : std::string()) +
           ", expected array of " + value_type_name(elem));
    return v;
  }

  /// `v` as an integer in [lo, hi]; `what` names it in the error.
  [[nodiscard]] std::int64_t int_in_range(const Value& v, const std::string& what, std::int64_t lo, std::int64_t hi) const {
    if (!v.is_integer()) fail("metadata " + what + " has type " + value_type_name(v.type) + ", expected an integer");
    const bool ok = v.is_unsigned() ? v.u <= static_cast<std::uint64_t>(hi) && static_cast<std::int64_t>(v.u) >= lo
                                    : v.i >= lo && v.i <= hi;
    if (!ok)
      fail("metadata " + what + " = " + (v.is_unsigned() ? std::to_string(v.u) : std::to_string(v.i)) +
           " is outside [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
    return v.is_unsigned() ? static_cast<std::int64_t>(v.u) : v.i;
  }

  [[nodiscard]] const std::vector<TensorInfo>& tensors() const noexcept { return tensors_; }
  [[nodiscard]] const TensorInfo* find_tensor(std::string_view name) const {
    const auto it = tensor_index_.find(std::string(name));
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
  }

  /// The tensor's raw bytes (within the file, checked at parse time).
  [[nodiscard]] std::span<const std::byte> raw(const TensorInfo& t) const {
    return {bytes_.data() + data_offset_ + t.offset, static_cast<std::size_t>(t.n_bytes)};
  }

  /// Dequantises the tensor into out[0, n_elements) in file order (row-major, ne[0] contiguous).
  void dequantize(const TensorInfo& t, std::span<float> out) const {
    if (out.size() != t.n_elements)
      throw triattn::logic_error("gguf::File::dequantize: " + name_ + ": tensor " + t.name + " has " +
                                 std::to_string(t.n_elements) + " elements, the output " + std::to_string(out.size()));
    dequantize_blocks(t.type, raw(t), out, name_ + ": tensor " + t.name);
  }
  [[nodiscard]] std::vector<float> dequantize(const TensorInfo& t) const {
    std::vector<float> v(static_cast<std::size_t>(t.n_elements));
    dequantize(t, v);
    return v;
  }

  /// Converts `src` (whole blocks of type `type`) to float32; what ggml's to-float routines do.
  /// A non-finite scale or minimum of a block, or a non-finite F32/F16/BF16 value, throws
  /// triattn::format_error starting with `what` (the file and tensor): it would turn every value
  /// it touches into NaN.
  static void dequantize_blocks(std::uint32_t type, std::span<const std::byte> src, std::span<float> out,
                                const std::string& what = "gguf tensor") {
    const auto* p = reinterpret_cast<const std::uint8_t*>(src.data());
    const BlockShape bs = block_shape(type);
    TRIATTN_EXPECTS(bs.elems > 0 && out.size() % bs.elems == 0 && src.size() == out.size() / bs.elems * bs.bytes,
                    "gguf::dequantize_blocks: " + tensor_type_name(type) + " source of " + std::to_string(src.size()) +
                        " bytes does not hold " + std::to_string(out.size()) + " elements");
    const std::size_t n = out.size();
    auto h16 = [](const std::uint8_t* q) {
      std::uint16_t b;
      std::memcpy(&b, q, 2);
      return b;
    };
    auto check_values = [&] {
      for (std::size_t i = 0; i < n; ++i)
        if (!std::isfinite(out[i]))
          throw triattn::format_error(what + " (" + tensor_type_name(type) + "): element " + std::to_string(i) +
                                      " is non-finite (" + (std::isnan(out[i]) ? "NaN" : "infinite") + ")");
    };
    auto check_scale = [&](float x, std::size_t block, const char* field) {
      if (!std::isfinite(x))
        throw triattn::format_error(what + " (" + tensor_type_name(type) + "): block " + std::to_string(block) +
                                    " has a non-finite " + field + " (" + (std::isnan(x) ? "NaN" : "infinite") + ")");
    };
    switch (static_cast<TensorType>(type)) {
      case TensorType::kF32:
        std::memcpy(out.data(), p, n * 4);
        return check_values();
      case TensorType::kF16:
        for (std::size_t i = 0; i < n; ++i) out[i] = triattn::f16_bits_to_f32(h16(p + 2 * i));
        return check_values();
      case TensorType::kBF16:
        for (std::size_t i = 0; i < n; ++i) out[i] = triattn::bf16_bits_to_f32(h16(p + 2 * i));
        return check_values();
      case TensorType::kQ8_0:
        for (std::size_t b = 0; b < n / 32; ++b, p += 34) {
          const float d = triattn::f16_bits_to_f32(h16(p));
          check_scale(d, b, "scale d");
          for (int j = 0; j < 32; ++j) out[b * 32 + j] = static_cast<float>(static_cast<std::int8_t>(p[2 + j])) * d;
        }
        return;
      case TensorType::kQ4_0:
        for (std::size_t b = 0; b < n / 32; ++b, p += 18) {
          const float d = triattn::f16_bits_to_f32(h16(p));
          check_scale(d, b, "scale d");
          for (int j = 0; j < 16; ++j) {
            out[b * 32 + j] = static_cast<float>((p[2 + j] & 0x0F) - 8) * d;
            out[b * 32 + j + 16] = static_cast<float>((p[2 + j] >> 4) - 8) * d;
          }
        }
        return;
      case TensorType::kQ4_1:
        for (std::size_t b = 0; b < n / 32; ++b, p += 20) {
          const float d = triattn::f16_bits_to_f32(h16(p));
          const float m = triattn::f16_bits_to_f32(h16(p + 2));
          check_scale(d, b, "scale d");
          check_scale(m, b, "minimum m");
          for (int j = 0; j < 16; ++j) {
            out[b * 32 + j] = static_cast<float>(p[4 + j] & 0x0F) * d + m;
            out[b * 32 + j + 16] = static_cast<float>(p[4 + j] >> 4) * d + m;
          }
        }
        return;
    }
  }

  [[noreturn]] void fail(const std::string& what) const { throw triattn::format_error(name_ + ": " + what); }

 private:
  File() = default;

  void parse_all() {
    detail::Cursor c(bytes_, name_, kMetadataMemoryFactor * bytes_.size() + kMetadataMemorySlack);
    // What one key/value pair or tensor entry costs besides its strings' heap bytes: its slot in
    // the vector, and the index map's node with its own copy of the name.
    constexpr std::uint64_t kv_entry_bytes = sizeof(std::pair<std::string, Value>);
    constexpr std::uint64_t index_node_bytes = sizeof(std::pair<const std::string, std::size_t>) + detail::kMapNodeOverhead;
    auto charge_name = [&](const std::string& name, const std::string& what) {
      c.charge(index_node_bytes + detail::string_heap_bytes(name.size()), what);  // the index map's copy
    };
    if (bytes_.size() < 4 || std::memcmp(bytes_.data(), "GGUF", 4) != 0)
      fail("not a GGUF file (the first 4 bytes are not \"GGUF\")");
    (void)c.get<std::uint32_t>("magic");
    version_ = c.get<std::uint32_t>("version");
    if (version_ == 1) fail("GGUF version 1 (32-bit counts) is not supported; convert the file to version 3");
    if (version_ != 2 && version_ != 3) {
      const std::uint32_t swapped = (version_ >> 24) | ((version_ >> 8) & 0xFF00u) | ((version_ << 8) & 0xFF0000u) | (version_ << 24);
      if (swapped == 2 || swapped == 3)
        fail("big-endian GGUF (version " + std::to_string(swapped) + ") is not supported");
      fail("GGUF version " + std::to_string(version_) + " is not supported (2 and 3 are)");
    }
    const std::uint64_t n_tensors = c.get<std::uint64_t>("tensor count");
    const std::uint64_t n_kv = c.get<std::uint64_t>("metadata count");
    // A key/value pair takes at least 8 + 1 + 4 + 1 bytes, a tensor entry 8 + 1 + 4 + 8 + 4 + 8.
    if (n_kv > c.left() / 14)
      fail("truncated: the header declares " + std::to_string(n_kv) + " metadata entries, more than the " +
           std::to_string(c.left()) + " bytes left can hold");
    c.charge(n_kv * kv_entry_bytes, "the metadata entries");
    kv_.reserve(static_cast<std::size_t>(n_kv));
    for (std::uint64_t k = 0; k < n_kv; ++k) {
      const std::string where = "metadata entry " + std::to_string(k);
      std::string key = c.str(where + " key");
      if (key.empty()) fail(where + " has an empty key");
      charge_name(key, "metadata " + key);
      const std::uint32_t t = c.get<std::uint32_t>("metadata " + key + " type");
      if (t > static_cast<std::uint32_t>(ValueType::kF64)) fail("metadata " + key + " has unknown value type " + std::to_string(t));
      Value v = detail::read_value(c, static_cast<ValueType>(t), "metadata " + key, 0);
      if (!kv_index_.emplace(key, kv_.size()).second) fail("metadata key " + key + " appears twice");
      kv_.emplace_back(std::move(key), std::move(v));
    }
    alignment_ = kDefaultAlignment;
    if (const Value* a = find("general.alignment")) {
      if (a->type != ValueType::kU32)
        fail(std::string("metadata general.alignment has type ") + value_type_name(a->type) + ", expected u32");
      if (a->u == 0 || !std::has_single_bit(a->u))
        fail("metadata general.alignment = " + std::to_string(a->u) + " is not a power of two");
      alignment_ = static_cast<std::uint32_t>(a->u);
    }

    if (n_tensors > c.left() / 33)
      fail("truncated: the header declares " + std::to_string(n_tensors) + " tensors, more than the " +
           std::to_string(c.left()) + " bytes left can hold");
    // Per tensor: its entry, and below the name's index node, the shape and the offset sort's slot.
    c.charge(n_tensors * (sizeof(TensorInfo) + sizeof(const TensorInfo*)), "the tensor directory");
    tensors_.reserve(static_cast<std::size_t>(n_tensors));
    for (std::uint64_t k = 0; k < n_tensors; ++k) {
      TensorInfo t;
      t.name = c.str("tensor " + std::to_string(k) + " name");
      const std::string where = "tensor " + t.name;
      if (t.name.empty()) fail("tensor " + std::to_string(k) + " has an empty name");
      charge_name(t.name, where);
      const std::uint32_t nd = c.get<std::uint32_t>(where + " dimension count");
      if (nd == 0 || nd > kMaxDims)
        fail(where + " has " + std::to_string(nd) + " dimensions, expected 1 to " + std::to_string(kMaxDims));
      c.charge(nd * sizeof(std::uint64_t) + 16, where + " shape");
      t.shape.reserve(nd);
      std::uint64_t count = 1;
      for (std::uint32_t d = 0; d < nd; ++d) {
        const std::uint64_t ne = c.get<std::uint64_t>(where + " dimension " + std::to_string(d));
        if (ne == 0) fail(where + " has dimension " + std::to_string(d) + " = 0");
        if (ne > (std::uint64_t{1} << 62) / count)
          fail(where + ": element count overflows (dimension " + std::to_string(d) + " = " + std::to_string(ne) + ")");
        count *= ne;
        t.shape.push_back(ne);
      }
      t.n_elements = count;
      t.type = c.get<std::uint32_t>(where + " type");
      const BlockShape bs = block_shape(t.type);
      if (bs.elems == 0)
        fail(where + " has type " + tensor_type_name(t.type) +
             ", which this reader does not dequantize (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1)");
      if (t.shape[0] % bs.elems != 0)
        fail(where + " of type " + tensor_type_name(t.type) + " has a row of " + std::to_string(t.shape[0]) +
             " elements, not a multiple of its block of " + std::to_string(bs.elems));
      t.n_bytes = count / bs.elems * bs.bytes;
      t.offset = c.get<std::uint64_t>(where + " data offset");
      if (t.offset % alignment_ != 0)
        fail(where + " data offset " + std::to_string(t.offset) + " is not a multiple of the alignment " +
             std::to_string(alignment_));
      if (!tensor_index_.emplace(t.name, tensors_.size()).second) fail("tensor " + t.name + " appears twice");
      tensors_.push_back(std::move(t));
    }

    const std::uint64_t header_end = c.pos();
    data_offset_ = (header_end + alignment_ - 1) / alignment_ * alignment_;
    if (data_offset_ > bytes_.size() && !tensors_.empty())
      fail("truncated: the data section would start at offset " + std::to_string(data_offset_) + ", past the end of the " +
           std::to_string(bytes_.size()) + "-byte file");
    const std::uint64_t data_size = bytes_.size() > data_offset_ ? bytes_.size() - data_offset_ : 0;
    // Every tensor inside the data section, none overlapping another.
    std::vector<const TensorInfo*> by_offset;
    for (const TensorInfo& t : tensors_) {
      if (t.offset > data_size || t.n_bytes > data_size - t.offset)
        fail("truncated or bad offset: tensor " + t.name + " (" +
             tensor_type_name(t.type) + " " + t.shape_string() + ", " + std::to_string(t.n_bytes) +
             " bytes at data offset " + std::to_string(t.offset) + ") ends past the end of the data section (" +
             std::to_string(data_size) + " bytes from file offset " + std::to_string(data_offset_) + ")");
      by_offset.push_back(&t);
    }
    std::sort(by_offset.begin(), by_offset.end(),
              [](const TensorInfo* a, const TensorInfo* b) { return a->offset < b->offset; });
    // The tensors tile the data section (see the file comment): no tensor reads fewer bytes than
    // its span, so a type or shape changed to a smaller one cannot load.
    for (std::size_t k = 0; k < by_offset.size(); ++k) {
      const TensorInfo& t = *by_offset[k];
      const std::string what = "tensor " + t.name + " (" + tensor_type_name(t.type) + " " + t.shape_string() + ", " +
                               std::to_string(t.n_bytes) + " bytes at data offset " + std::to_string(t.offset) + ")";
      if (k == 0 && t.offset != 0)
        fail("bad offset: " + what + " is the first tensor but does not start the data section (" +
             std::to_string(t.offset) + " unused bytes before it)");
      const bool last = k + 1 == by_offset.size();
      const std::uint64_t end = last ? data_size : by_offset[k + 1]->offset;
      if (!last && t.offset + t.n_bytes > end)
        fail("bad offset: tensor " + by_offset[k + 1]->name + " at data offset " + std::to_string(end) + " overlaps " + what);
      const std::uint64_t padded = (t.n_bytes + alignment_ - 1) / alignment_ * alignment_;
      if (end - t.offset > padded)
        fail("size mismatch: " + what + " is followed by " + std::to_string(end - t.offset - t.n_bytes) +
             " bytes before " + (last ? std::string("the end of the file") : "tensor " + by_offset[k + 1]->name) +
             ", more than the padding to the alignment " + std::to_string(alignment_) +
             " allows: its type or shape does not match its data");
    }
    metadata_memory_ = c.memory_used();
  }

  std::vector<std::byte> bytes_;
  std::string name_;
  std::uint32_t version_ = 0;
  std::uint32_t alignment_ = kDefaultAlignment;
  std::uint64_t data_offset_ = 0;
  std::uint64_t metadata_memory_ = 0;
  std::vector<std::pair<std::string, Value>> kv_;
  std::map<std::string, std::size_t> kv_index_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::size_t> tensor_index_;
};

}  // namespace triattn_example::gguf
