# triattn package config. Components: core (host-only, always), cuda (needs CUDAToolkit + CCCL).
#   find_package(triattn COMPONENTS core)  -> triattn::core, works with CUDA disabled
#   find_package(triattn)                  -> triattn::core, plus triattn::cuda where CUDA exists

####### Expanded from @PACKAGE_INIT@ by configure_package_config_file() #######
####### Any changes to this file will be overwritten by the next CMake run ####
####### The input file was triattnConfig.cmake.in                            ########

get_filename_component(PACKAGE_PREFIX_DIR "${CMAKE_CURRENT_LIST_DIR}/../../../" ABSOLUTE)

macro(set_and_check _var _file)
  set(${_var} "${_file}")
  if(NOT EXISTS "${_file}")
    message(FATAL_ERROR "File or directory ${_file} referenced by variable ${_var} does not exist !")
  endif()
endmacro()

macro(check_required_components _NAME)
  foreach(comp ${${_NAME}_FIND_COMPONENTS})
    if(NOT ${_NAME}_${comp}_FOUND)
      if(${_NAME}_FIND_REQUIRED_${comp})
        set(${_NAME}_FOUND FALSE)
      endif()
    endif()
  endforeach()
endmacro()

####################################################################################
include(CMakeFindDependencyMacro)
include("${CMAKE_CURRENT_LIST_DIR}/triattn-core-targets.cmake")
set(triattn_core_FOUND TRUE)

set(_triattn_want_cuda FALSE)
if("cuda" IN_LIST triattn_FIND_COMPONENTS)
  set(_triattn_want_cuda TRUE)
elseif(NOT triattn_FIND_COMPONENTS AND EXISTS "${CMAKE_CURRENT_LIST_DIR}/triattn-cuda-targets.cmake")
  set(_triattn_want_cuda OPTIONAL)
endif()
set(triattn_cuda_FOUND FALSE)
if(_triattn_want_cuda AND EXISTS "${CMAKE_CURRENT_LIST_DIR}/triattn-cuda-targets.cmake")
  if(_triattn_want_cuda STREQUAL "OPTIONAL")
    find_package(CUDAToolkit QUIET)
  else()
    find_dependency(CUDAToolkit)
  endif()
  if(CUDAToolkit_FOUND)
    find_dependency(CCCL CONFIG HINTS "${CUDAToolkit_LIBRARY_DIR}/cmake")
    include("${CMAKE_CURRENT_LIST_DIR}/triattn-cuda-targets.cmake")
    set(triattn_cuda_FOUND TRUE)
  endif()
endif()
unset(_triattn_want_cuda)
check_required_components(triattn)
