// SPDX-License-Identifier: Apache-2.0
// Decoder for the small subset of Python pickle (protocol 2) that `torch.save` writes for plain
// dicts of tensors. It never executes anything: GLOBAL, REDUCE and BINPERSID become inert nodes
// (a named global, a call record, a persistent id) that the caller interprets. Objects live in
// one arena and refer to each other by index, so shared references (memo) cost nothing, cycles
// cannot leak, and destruction is flat however deeply a hostile input nests. Any opcode outside
// the subset, a stack underflow, a memo miss or a length past the end throws format_error.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <triattn/core/error.hpp>
#include <triattn/core/stats/common.hpp>

namespace triattn::detail {

enum class PyKind : std::uint8_t { kNone, kBool, kInt, kFloat, kStr, kList, kTuple, kDict, kGlobal, kPersId, kReduce };

[[nodiscard]] inline const char* py_kind_name(PyKind k) noexcept {
  switch (k) {
    case PyKind::kNone: return "None";
    case PyKind::kBool: return "bool";
    case PyKind::kInt: return "int";
    case PyKind::kFloat: return "float";
    case PyKind::kStr: return "str";
    case PyKind::kList: return "list";
    case PyKind::kTuple: return "tuple";
    case PyKind::kDict: return "dict";
    case PyKind::kGlobal: return "global";
    case PyKind::kPersId: return "persistent id";
    case PyKind::kReduce: return "call";
  }
  return "?";
}

/// One decoded value. Which members mean something depends on `kind`.
struct PyObj {
  PyKind kind = PyKind::kNone;
  bool boolean = false;
  std::int64_t integer = 0;
  double real = 0.0;
  std::string text;                  ///< kStr: the string; kGlobal: the module
  std::string name;                  ///< kGlobal: the attribute
  std::vector<std::uint32_t> items;  ///< kList/kTuple: elements; kDict: key0, value0, key1, ...;
                                     ///< kPersId: {pid}; kReduce: {callable, args}
  std::size_t offset = 0;            ///< byte offset of the opcode that created it (for messages)
};

/// The decoded pickle: an arena of objects and the index of the one STOP returned.
struct PickleDoc {
  std::vector<PyObj> objects;  // [num_objects]; items refer to indices in here
  std::uint32_t root = 0;

  [[nodiscard]] const PyObj& operator[](std::uint32_t id) const { return objects[id]; }
};

/// Name of a pickle opcode byte for messages ("?" when it is not an opcode at all).
[[nodiscard]] inline const char* pickle_opcode_name(std::uint8_t op) noexcept {
  switch (op) {
    case 0x80: return "PROTO"; case '.': return "STOP"; case '}': return "EMPTY_DICT"; case ']': return "EMPTY_LIST";
    case ')': return "EMPTY_TUPLE"; case '(': return "MARK"; case 's': return "SETITEM"; case 'u': return "SETITEMS";
    case 'a': return "APPEND"; case 'e': return "APPENDS"; case 'J': return "BININT"; case 'K': return "BININT1";
    case 'M': return "BININT2"; case 0x8a: return "LONG1"; case 0x8b: return "LONG4"; case 't': return "TUPLE";
    case 0x85: return "TUPLE1"; case 0x86: return "TUPLE2"; case 0x87: return "TUPLE3"; case 'X': return "BINUNICODE";
    case 0x8c: return "SHORT_BINUNICODE"; case 'q': return "BINPUT"; case 'r': return "LONG_BINPUT";
    case 'h': return "BINGET"; case 'j': return "LONG_BINGET"; case 'c': return "GLOBAL"; case 'R': return "REDUCE";
    case 'Q': return "BINPERSID"; case 'P': return "PERSID"; case 0x88: return "NEWTRUE"; case 0x89: return "NEWFALSE";
    case 'N': return "NONE"; case 'G': return "BINFLOAT"; case 'F': return "FLOAT"; case 'I': return "INT";
    case 'L': return "LONG"; case 'S': return "STRING"; case 'T': return "BINSTRING"; case 'U': return "SHORT_BINSTRING";
    case 'V': return "UNICODE"; case 'B': return "BINBYTES"; case 'C': return "SHORT_BINBYTES"; case 'b': return "BUILD";
    case 'i': return "INST"; case 'o': return "OBJ"; case 0x81: return "NEWOBJ"; case 0x92: return "NEWOBJ_EX";
    case 0x93: return "STACK_GLOBAL"; case 0x94: return "MEMOIZE"; case 0x95: return "FRAME"; case 'd': return "DICT";
    case 'l': return "LIST"; case 'p': return "PUT"; case 'g': return "GET"; case '0': return "POP";
    case '1': return "POP_MARK"; case '2': return "DUP"; case 0x82: return "EXT1"; case 0x83: return "EXT2";
    case 0x84: return "EXT4"; case 0x8d: return "BINUNICODE8"; case 0x8e: return "BINBYTES8"; case 0x8f: return "EMPTY_SET";
    case 0x90: return "ADDITEMS"; case 0x91: return "FROZENSET"; case 0x96: return "BYTEARRAY8";
    case 0x97: return "NEXT_BUFFER"; case 0x98: return "READONLY_BUFFER";
    default: return "?";
  }
}

namespace pickle_impl {

class Decoder {
 public:
  Decoder(std::span<const std::uint8_t> bytes, const std::string& where) : in_(bytes), where_(where) {
    // torch's pickles create about one object per 7 bytes; reserving avoids most regrowth.
    doc_.objects.reserve(in_.size() / 8 + 16);
  }

  PickleDoc run() {
    while (true) {
      if (pos_ >= in_.size()) fail(in_.size(), "pickle ends without a STOP opcode (truncated)");
      const std::size_t op_at = pos_;
      const std::uint8_t op = in_[pos_++];
      switch (op) {
        case 0x80: {  // PROTO
          const std::uint8_t v = take(1, op_at)[0];
          if (v < 2 || v > 5) fail(op_at, "unsupported pickle protocol " + std::to_string(v));
          break;
        }
        case '.': {  // STOP
          if (!marks_.empty()) fail(op_at, "STOP with an open MARK");
          if (stack_.size() != 1) fail(op_at, "STOP with " + std::to_string(stack_.size()) + " values on the stack, expected 1");
          if (pos_ != in_.size()) fail(pos_, std::to_string(in_.size() - pos_) + " bytes after STOP");
          doc_.root = stack_.back();
          return std::move(doc_);
        }
        case '}': push(make(PyKind::kDict, op_at)); break;
        case ']': push(make(PyKind::kList, op_at)); break;
        case ')': push(make(PyKind::kTuple, op_at)); break;
        case 'N': push(make(PyKind::kNone, op_at)); break;
        case 0x88: case 0x89: {
          const std::uint32_t id = make(PyKind::kBool, op_at);
          doc_.objects[id].boolean = op == 0x88;
          push(id);
          break;
        }
        case '(': marks_.push_back(stack_.size()); break;
        case 't': {  // TUPLE: everything above the mark
          const std::size_t m = pop_mark(op_at);
          push_tuple(m, op_at);
          break;
        }
        case 0x85: case 0x86: case 0x87: {  // TUPLE1..3
          const std::size_t n = op - 0x84u;
          if (stack_.size() < n + floor()) underflow(op_at, op);
          push_tuple(stack_.size() - n, op_at);
          break;
        }
        case 'a': {  // APPEND
          if (stack_.size() < 2 + floor()) underflow(op_at, op);
          const std::uint32_t v = stack_.back();
          stack_.pop_back();
          container(stack_.back(), PyKind::kList, op_at, op).items.push_back(v);
          break;
        }
        case 'e': {  // APPENDS
          const std::size_t m = pop_mark(op_at);
          if (m == 0 || m - 1 < floor()) underflow(op_at, op);
          auto& list = container(stack_[m - 1], PyKind::kList, op_at, op);
          list.items.insert(list.items.end(), stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
          stack_.resize(m);
          break;
        }
        case 's': {  // SETITEM
          if (stack_.size() < 3 + floor()) underflow(op_at, op);
          const std::uint32_t v = stack_.back();
          stack_.pop_back();
          const std::uint32_t k = stack_.back();
          stack_.pop_back();
          auto& dict = container(stack_.back(), PyKind::kDict, op_at, op);
          dict.items.push_back(k);
          dict.items.push_back(v);
          break;
        }
        case 'u': {  // SETITEMS
          const std::size_t m = pop_mark(op_at);
          if (m == 0 || m - 1 < floor()) underflow(op_at, op);
          if ((stack_.size() - m) % 2 != 0) fail(op_at, "SETITEMS with an odd number of keys and values");
          auto& dict = container(stack_[m - 1], PyKind::kDict, op_at, op);
          dict.items.insert(dict.items.end(), stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
          stack_.resize(m);
          break;
        }
        case 'J': push_int(static_cast<std::int32_t>(load_le32(take(4, op_at))), op_at); break;
        case 'K': push_int(take(1, op_at)[0], op_at); break;
        case 'M': push_int(load_le16(take(2, op_at)), op_at); break;
        case 0x8a: {  // LONG1: little-endian two's complement of n bytes
          const std::uint8_t n = take(1, op_at)[0];
          if (n > 8) fail(op_at, "LONG1 integer of " + std::to_string(n) + " bytes does not fit in 64 bits");
          const std::uint8_t* p = take(n, op_at);
          std::uint64_t v = 0;
          for (std::uint8_t i = 0; i < n; ++i) v |= static_cast<std::uint64_t>(p[i]) << (8 * i);
          if (n > 0 && n < 8 && (p[n - 1] & 0x80u)) v |= ~std::uint64_t{0} << (8 * n);  // sign-extend
          push_int(static_cast<std::int64_t>(v), op_at);
          break;
        }
        case 'G': {  // BINFLOAT: big-endian IEEE double
          const std::uint8_t* p = take(8, op_at);
          std::uint64_t v = 0;
          for (int i = 0; i < 8; ++i) v = (v << 8) | p[i];
          const std::uint32_t id = make(PyKind::kFloat, op_at);
          doc_.objects[id].real = std::bit_cast<double>(v);
          push(id);
          break;
        }
        case 'X': {  // BINUNICODE
          const std::uint32_t n = load_le32(take(4, op_at));
          push_str(take(n, op_at), n, op_at);
          break;
        }
        case 0x8c: {  // SHORT_BINUNICODE
          const std::uint8_t n = take(1, op_at)[0];
          push_str(take(n, op_at), n, op_at);
          break;
        }
        case 'q': memo_put(take(1, op_at)[0], op_at); break;
        case 'r': memo_put(load_le32(take(4, op_at)), op_at); break;
        case 'h': memo_get(take(1, op_at)[0], op_at); break;
        case 'j': memo_get(load_le32(take(4, op_at)), op_at); break;
        case 'c': {  // GLOBAL "module\nname\n"
          const std::uint32_t id = make(PyKind::kGlobal, op_at);
          std::string module = line(op_at), name = line(op_at);
          doc_.objects[id].text = std::move(module);
          doc_.objects[id].name = std::move(name);
          push(id);
          break;
        }
        case 'R': {  // REDUCE: callable(args) -> inert call record
          if (stack_.size() < 2 + floor()) underflow(op_at, op);
          const std::uint32_t args = stack_.back();
          stack_.pop_back();
          const std::uint32_t fn = stack_.back();
          stack_.pop_back();
          if (doc_.objects[args].kind != PyKind::kTuple)
            fail(op_at, std::string("REDUCE arguments are a ") + py_kind_name(doc_.objects[args].kind) + ", not a tuple");
          const std::uint32_t id = make(PyKind::kReduce, op_at);
          doc_.objects[id].items = {fn, args};
          push(id);
          break;
        }
        case 'Q': {  // BINPERSID
          if (stack_.size() < 1 + floor()) underflow(op_at, op);
          const std::uint32_t pid = stack_.back();
          stack_.pop_back();
          const std::uint32_t id = make(PyKind::kPersId, op_at);
          doc_.objects[id].items = {pid};
          push(id);
          break;
        }
        default: {
          char buf[8];
          std::snprintf(buf, sizeof buf, "0x%02x", static_cast<unsigned>(op));
          fail(op_at, std::string("unsupported pickle opcode ") + buf + " (" + pickle_opcode_name(op) + ")");
        }
      }
    }
  }

 private:
  [[noreturn]] void fail(std::size_t at, const std::string& what) const {
    throw format_error(where_ + ": " + what + " at byte offset " + std::to_string(at));
  }
  [[noreturn]] void underflow(std::size_t at, std::uint8_t op) const {
    fail(at, std::string("stack underflow in ") + pickle_opcode_name(op));
  }
  // Values below the innermost MARK are out of reach for opcodes that do not pop the mark.
  std::size_t floor() const noexcept { return marks_.empty() ? 0 : marks_.back(); }

  const std::uint8_t* take(std::size_t n, std::size_t op_at) {
    if (n > in_.size() - pos_)
      fail(op_at, std::string(pickle_opcode_name(in_[op_at])) + " argument of " + std::to_string(n) +
                      " bytes runs past the end of the pickle (truncated)");
    const std::uint8_t* p = in_.data() + pos_;
    pos_ += n;
    return p;
  }
  std::string line(std::size_t op_at) {
    constexpr std::size_t kMaxLine = 256;  // module and attribute names are short
    const std::size_t end = std::min(in_.size(), pos_ + kMaxLine + 1);
    for (std::size_t i = pos_; i < end; ++i) {
      if (in_[i] != '\n') continue;
      std::string s(reinterpret_cast<const char*>(in_.data() + pos_), i - pos_);
      pos_ = i + 1;
      return s;
    }
    fail(op_at, "GLOBAL name is unterminated or longer than " + std::to_string(kMaxLine) + " bytes");
  }
  std::size_t pop_mark(std::size_t op_at) {
    if (marks_.empty()) fail(op_at, std::string(pickle_opcode_name(in_[op_at])) + " without a MARK");
    const std::size_t m = marks_.back();
    marks_.pop_back();
    return m;
  }
  std::uint32_t make(PyKind kind, std::size_t op_at) {
    doc_.objects.emplace_back();
    doc_.objects.back().kind = kind;
    doc_.objects.back().offset = op_at;
    return static_cast<std::uint32_t>(doc_.objects.size() - 1);
  }
  void push(std::uint32_t id) { stack_.push_back(id); }
  void push_int(std::int64_t v, std::size_t op_at) {
    const std::uint32_t id = make(PyKind::kInt, op_at);
    doc_.objects[id].integer = v;
    push(id);
  }
  void push_str(const std::uint8_t* p, std::size_t n, std::size_t op_at) {
    const std::uint32_t id = make(PyKind::kStr, op_at);
    doc_.objects[id].text.assign(reinterpret_cast<const char*>(p), n);
    push(id);
  }
  void push_tuple(std::size_t from, std::size_t op_at) {
    const std::uint32_t id = make(PyKind::kTuple, op_at);
    doc_.objects[id].items.assign(stack_.begin() + static_cast<std::ptrdiff_t>(from), stack_.end());
    stack_.resize(from);
    push(id);
  }
  PyObj& container(std::uint32_t id, PyKind want, std::size_t op_at, std::uint8_t op) {
    PyObj& o = doc_.objects[id];
    if (o.kind != want)
      fail(op_at, std::string(pickle_opcode_name(op)) + " applied to a " + py_kind_name(o.kind) + ", not a " +
                      py_kind_name(want));
    return o;
  }
  void memo_put(std::uint32_t key, std::size_t op_at) {
    if (stack_.size() <= floor()) fail(op_at, "memo PUT with nothing on the stack");
    memo_[key] = stack_.back();
  }
  void memo_get(std::uint32_t key, std::size_t op_at) {
    const auto it = memo_.find(key);
    if (it == memo_.end()) fail(op_at, "memo GET of key " + std::to_string(key) + ", which was never PUT");
    push(it->second);
  }

  std::span<const std::uint8_t> in_;                       // [pickle size]
  const std::string& where_;
  std::size_t pos_ = 0;
  PickleDoc doc_;
  std::vector<std::uint32_t> stack_;                       // object ids
  std::vector<std::size_t> marks_;                         // stack sizes at each open MARK
  std::unordered_map<std::uint32_t, std::uint32_t> memo_;  // memo key -> object id
};

}  // namespace pickle_impl

/// Decodes `bytes`; `where` (e.g. "file.pt: data.pkl") starts every error message.
[[nodiscard]] inline PickleDoc parse_pickle(std::span<const std::uint8_t> bytes, const std::string& where) {
  return pickle_impl::Decoder(bytes, where).run();
}

}  // namespace triattn::detail
