# Locates the CUDA runtime and NCCL for the GPU data plane.
#
# Honours PARAMCAST_WITH_NCCL (AUTO|ON|OFF) and the hints NCCL_HOME / CUDA_HOME
# (CMake variables or environment). Defines PARAMCAST_HAVE_NCCL (0/1) and, when
# found, the imported target paramcast::nccl (NCCL + CUDA runtime).
set(PARAMCAST_HAVE_NCCL 0)
if(PARAMCAST_WITH_NCCL STREQUAL "OFF")
  message(STATUS "ParamCast: NCCL data plane disabled (PARAMCAST_WITH_NCCL=OFF)")
  return()
endif()

find_package(CUDAToolkit QUIET)
# /opt/paramcast/nccl: where deploy/install-deps.sh puts NCCL from PyPI.
set(_nccl_hints ${NCCL_HOME} $ENV{NCCL_HOME} ${CUDA_HOME} $ENV{CUDA_HOME} /opt/paramcast/nccl)
if(CUDAToolkit_FOUND)
  list(APPEND _nccl_hints ${CUDAToolkit_LIBRARY_ROOT} ${CUDAToolkit_TARGET_DIR})
endif()
find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_nccl_hints} PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu)

set(_missing "")
if(NOT CUDAToolkit_FOUND)
  list(APPEND _missing "CUDA Toolkit (set CUDA_HOME or CUDAToolkit_ROOT)")
endif()
if(NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY)
  list(APPEND _missing "NCCL headers/library (set NCCL_HOME to the prefix holding include/nccl.h and lib/libnccl.so)")
endif()

if(_missing)
  if(PARAMCAST_WITH_NCCL STREQUAL "ON")
    string(REPLACE ";" "; " _m "${_missing}")
    message(FATAL_ERROR "PARAMCAST_WITH_NCCL=ON but not found: ${_m}. "
                        "Install them or configure with -DPARAMCAST_WITH_NCCL=OFF.")
  endif()
  message(STATUS "ParamCast: NCCL data plane not built (missing: ${_missing})")
  return()
endif()

add_library(paramcast::nccl INTERFACE IMPORTED)
target_include_directories(paramcast::nccl INTERFACE ${NCCL_INCLUDE_DIR})
target_link_libraries(paramcast::nccl INTERFACE ${NCCL_LIBRARY} CUDA::cudart)
set(PARAMCAST_HAVE_NCCL 1)
message(STATUS "ParamCast: NCCL data plane ON (${NCCL_LIBRARY}, CUDA ${CUDAToolkit_VERSION})")
