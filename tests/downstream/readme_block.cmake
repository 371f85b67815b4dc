# Runs the README's ```cmake block as written (the one consumers copy), so the downstream
# consumers link exactly what the README says. The including project defines the target
# my_engine first.
file(READ "${CMAKE_CURRENT_LIST_DIR}/../../README.md" _readme)
string(FIND "${_readme}" "\n```cmake\n" _open)
if(_open EQUAL -1)
  message(FATAL_ERROR "README.md has no ```cmake block")
endif()
math(EXPR _body "${_open} + 10")
string(SUBSTRING "${_readme}" ${_body} -1 _rest)
string(FIND "${_rest}" "\n```" _close)
math(EXPR _close "${_close} + 1")
string(SUBSTRING "${_rest}" 0 ${_close} _block)
file(WRITE "${CMAKE_CURRENT_BINARY_DIR}/readme_block.cmake" "${_block}")
include("${CMAKE_CURRENT_BINARY_DIR}/readme_block.cmake")
