# Settings for triattn's own tests, benchmarks and examples. Included only at top level.
if(NOT CMAKE_BUILD_TYPE AND NOT CMAKE_CONFIGURATION_TYPES)
  set(CMAKE_BUILD_TYPE Release CACHE STRING "Build type" FORCE)
endif()

# Applies the project's warning set (and sanitizers when asked) to one of its own targets.
function(triattn_project_target target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Wno-unused-parameter -lineinfo>)
  if(TRIATTN_SANITIZE)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all>)
    target_link_options(${target} PRIVATE -fsanitize=address,undefined)
  endif()
  target_compile_definitions(${target} PRIVATE TRIATTN_SHARED_DATA_DIR="${TRIATTN_SHARED_DATA_DIR}")
endfunction()

# A test or benchmark source that includes example code names the example target it needs with a
# line "// links: <target>" (triattn_example_model, or triattn_example_cuda for the CUDA backend).
function(triattn_link_marked target src)
  file(STRINGS ${src} link_lines REGEX "^// links: [A-Za-z0-9_:]+$")
  foreach(line IN LISTS link_lines)
    string(REGEX REPLACE "^// links: " "" lib "${line}")
    target_link_libraries(${target} PRIVATE ${lib})
  endforeach()
endfunction()
