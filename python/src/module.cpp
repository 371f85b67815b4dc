// SPDX-License-Identifier: Apache-2.0
// triattn._triattn: the extension module. Library exceptions become Python exceptions carrying
// the library's message: triattn.Error (RuntimeError) and its subclasses LogicError (also a
// ValueError), ArgumentTypeError (a LogicError, also a TypeError), UnsupportedError (also
// NotImplementedError), FormatError (also a ValueError) and OutOfMemoryError (also a MemoryError).
#include "bindings.hpp"

#include <exception>

#include <Python.h>

namespace triattn::python {

std::string dtype_str(nb::dlpack::dtype t) {
  using C = nb::dlpack::dtype_code;
  std::string base;
  switch (static_cast<C>(t.code)) {
    case C::Int: base = "int"; break;
    case C::UInt: base = "uint"; break;
    case C::Float: base = "float"; break;
    case C::Bfloat: base = "bfloat"; break;
    case C::Complex: base = "complex"; break;
    case C::Bool: return "bool";
    default: base = "dtype(code " + std::to_string(t.code) + ")"; break;
  }
  std::string s = base + std::to_string(t.bits);
  if (t.lanes != 1) s += "x" + std::to_string(t.lanes);
  return s;
}

void refuse_array(nb::handle h, const std::string& what, bool writable) {
  // numpy refuses to export a non-native byte order; say so instead of "not an array".
  if (nb::hasattr(h, "dtype")) {
    const nb::object dt = h.attr("dtype");
    if (nb::hasattr(dt, "byteorder") && nb::hasattr(dt, "str")) {
      const std::string order = nb::str(dt.attr("byteorder")).c_str();
      if (order == ">" || order == "<")  // numpy writes "=" for native, "|" where order does not apply
        throw logic_error("triattn: " + what + " is " + (order == ">" ? "big" : "little") + "-endian (" +
                          nb::str(dt.attr("str")).c_str() + "); triattn needs native byte order");
    }
  }
  ConstArray ro;
  if (writable && nb::try_cast(h, ro, false))
    throw logic_error("triattn: " + what + " is read-only; triattn writes into it in place");
  throw argument_type_error("triattn: " + what + " is not an array (numpy, torch, CuPy...: DLPack or the buffer "
                            "protocol); got " + nb::type_name(h.type()).c_str());
}

namespace {

PyObject* g_error = nullptr;
PyObject* g_logic = nullptr;
PyObject* g_argument_type = nullptr;
PyObject* g_unsupported = nullptr;
PyObject* g_format = nullptr;
PyObject* g_out_of_memory = nullptr;

PyObject* new_exception(nb::module_& m, const char* name, PyObject* base, PyObject* second_base, const char* doc) {
  const std::string qualified = std::string("triattn.") + name;
  nb::object bases = second_base ? nb::object(nb::make_tuple(nb::handle(base), nb::handle(second_base)))
                                 : nb::object(nb::make_tuple(nb::handle(base)));
  PyObject* type = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases.ptr(), nullptr);
  if (!type) throw nb::python_error();
  m.attr(name) = nb::handle(type);
  return type;  // the module keeps a reference for the life of the interpreter
}

void translate(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const argument_type_error& e) {
    PyErr_SetString(g_argument_type, e.what());
  } catch (const triattn::format_error& e) {
    PyErr_SetString(g_format, e.what());
  } catch (const triattn::unsupported& e) {
    PyErr_SetString(g_unsupported, e.what());
  } catch (const triattn::logic_error& e) {
    PyErr_SetString(g_logic, e.what());
  } catch (const triattn::out_of_memory& e) {
    PyErr_SetString(g_out_of_memory, e.what());
  } catch (const triattn::error& e) {
    PyErr_SetString(g_error, e.what());
  }
}

}  // namespace
}  // namespace triattn::python

NB_MODULE(_triattn, m) {
  using namespace triattn::python;
  m.doc() = "triattn: TriAttention KV-cache compression (C++ extension; use the triattn package)";
  g_error = new_exception(m, "Error", PyExc_RuntimeError, nullptr, "Base class of every error triattn raises.");
  g_logic = new_exception(m, "LogicError", g_error, PyExc_ValueError,
                          "A documented precondition was broken (bad argument, shape, dtype, view...).");
  g_argument_type = new_exception(m, "ArgumentTypeError", g_logic, PyExc_TypeError,
                                  "An argument of the wrong type (not an array, not a sequence of arrays...).");
  g_unsupported = new_exception(m, "UnsupportedError", g_error, PyExc_NotImplementedError,
                                "A run-time value names a combination that was not compiled in.");
  g_format = new_exception(m, "FormatError", g_error, PyExc_ValueError,
                           "A malformed, truncated or unsupported statistics file.");
  g_out_of_memory = new_exception(m, "OutOfMemoryError", g_error, PyExc_MemoryError,
                                  "Host memory for a valid request could not be had.");
  nb::register_exception_translator(translate);

  bind_params(m);
  bind_stats(m);
  bind_round(m);
  bind_paged(m);
#ifdef TRIATTN_PYTHON_WITH_CUDA
  m.attr("has_cuda") = true;
#else
  m.attr("has_cuda") = false;
#endif
}
