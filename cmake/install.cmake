# `cmake --install build --prefix P`: what a C++ user builds against.
#
#   P/include/paramcast/{publisher,subscriber}.h  and the headers they include
#   P/lib/libparamcast.so                         the publisher, the subscriber and the
#                                                 rooms they share, in one shared library
#   P/lib/cmake/paramcast/paramcastConfig.cmake   find_package(paramcast): targets
#                                                 paramcast::publisher, paramcast::subscriber
#   P/lib/pkgconfig/paramcast.pc                  pkg-config --cflags --libs paramcast
#   P/bin/paramcast, paramcast-trainer, paramcast-worker
#
# The public headers include only the standard library, so the shared
# library keeps ZeroMQ, Cap'n Proto, yaml-cpp, Gloo and NCCL private: a user
# needs none of their headers or CMake packages. In the source tree the
# headers include each other as "common/x.h"; the installed copies say
# "paramcast/common/x.h", so that P/include is the only include directory.
if(SKBUILD)
  return()   # pip installs the Python package only (python/CMakeLists.txt)
endif()
if(PARAMCAST_SANITIZE)
  # What is installed is the regular build; a sanitized shared library would
  # need the sanitizer runtime in every program that loads it.
  message(STATUS "install rules and libparamcast.so: not in a PARAMCAST_SANITIZE build")
  return()
endif()
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

# ---- the installed headers, rewritten into build/include/paramcast ---------
set(paramcast_public_headers   # source path -> path under include/paramcast
  trainer_side/publisher.h publisher.h
  inference_side/subscriber.h subscriber.h
  common/config.h common/config.h
  common/control/member_event.h common/control/member_event.h
  common/log.h common/log.h
  common/plan.h common/plan.h
  common/status.h common/status.h
  common/tensor.h common/tensor.h
  common/xxhash.h common/xxhash.h
  common/transform/transform.h common/transform/transform.h)
set(paramcast_header_dir ${PROJECT_BINARY_DIR}/include/paramcast)
set(paramcast_header_map "")
list(LENGTH paramcast_public_headers n)
math(EXPR last "${n} - 1")
foreach(i RANGE 0 ${last} 2)
  math(EXPR j "${i} + 1")
  list(GET paramcast_public_headers ${i} src)
  list(GET paramcast_public_headers ${j} dst)
  list(APPEND paramcast_header_map "${src}=${dst}")
endforeach()
foreach(entry ${paramcast_header_map})
  string(REPLACE "=" ";" pair "${entry}")
  list(GET pair 0 src)
  list(GET pair 1 dst)
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/${src})
  file(READ ${PROJECT_SOURCE_DIR}/${src} text)
  foreach(other ${paramcast_header_map})
    string(REPLACE "=" ";" p "${other}")
    list(GET p 0 from)
    list(GET p 1 to)
    string(REPLACE "#include \"${from}\"" "#include \"paramcast/${to}\"" text "${text}")
  endforeach()
  if(text MATCHES "#include \"(common|trainer_side|inference_side)/")
    message(FATAL_ERROR "${src} includes a header outside the installed set (cmake/install.cmake): ${CMAKE_MATCH_0}")
  endif()
  set(old "")
  if(EXISTS ${paramcast_header_dir}/${dst})
    file(READ ${paramcast_header_dir}/${dst} old)
  endif()
  if(NOT old STREQUAL text)   # unchanged headers keep their time stamps
    file(WRITE ${paramcast_header_dir}/${dst} "${text}")
  endif()
endforeach()

# ---- libparamcast.so: the static rooms, whole, in one shared library --------
set_target_properties(paramcast_common paramcast_publisher paramcast_subscriber
  PROPERTIES POSITION_INDEPENDENT_CODE ON)
add_library(paramcast_shared SHARED ${PROJECT_SOURCE_DIR}/cmake/empty.cc)
set_target_properties(paramcast_shared PROPERTIES
  OUTPUT_NAME paramcast
  VERSION ${PROJECT_VERSION}
  SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR}
  LIBRARY_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/lib)
target_link_libraries(paramcast_shared PRIVATE
  -Wl,--whole-archive paramcast_publisher paramcast_subscriber paramcast_common -Wl,--no-whole-archive
  paramcast_flags)
target_link_options(paramcast_shared PRIVATE -Wl,--no-undefined)
target_include_directories(paramcast_shared INTERFACE
  $<BUILD_INTERFACE:${PROJECT_BINARY_DIR}/include>
  $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
target_compile_features(paramcast_shared INTERFACE cxx_std_20)
set_target_properties(paramcast_shared PROPERTIES EXPORT_NAME paramcast)

# The two names users link: both are the one library (the sides share their
# rooms, and a process may hold a publisher and a subscriber).
foreach(side publisher subscriber)
  add_library(paramcast_${side}_api INTERFACE)
  target_link_libraries(paramcast_${side}_api INTERFACE paramcast_shared)
  set_target_properties(paramcast_${side}_api PROPERTIES EXPORT_NAME ${side})
  add_library(paramcast::${side} ALIAS paramcast_${side}_api)
endforeach()

install(TARGETS paramcast_shared paramcast_publisher_api paramcast_subscriber_api
  EXPORT paramcastTargets
  LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
  INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${paramcast_header_dir} DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(TARGETS paramcast paramcast-trainer paramcast-worker RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(EXPORT paramcastTargets NAMESPACE paramcast::
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/paramcast)
configure_package_config_file(${PROJECT_SOURCE_DIR}/cmake/paramcastConfig.cmake.in
  ${PROJECT_BINARY_DIR}/paramcastConfig.cmake
  INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/paramcast)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/paramcastConfigVersion.cmake
  VERSION ${PROJECT_VERSION} COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/paramcastConfig.cmake ${PROJECT_BINARY_DIR}/paramcastConfigVersion.cmake
  DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/paramcast)
# The .pc file finds its prefix from where it lies (relocatable), however
# many parts CMAKE_INSTALL_LIBDIR has (lib/x86_64-linux-gnu under /usr).
file(RELATIVE_PATH PARAMCAST_PC_TO_PREFIX /p/${CMAKE_INSTALL_LIBDIR}/pkgconfig /p)
configure_file(${PROJECT_SOURCE_DIR}/cmake/paramcast.pc.in ${PROJECT_BINARY_DIR}/paramcast.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/paramcast.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)
