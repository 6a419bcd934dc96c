// libparamcast.so is made of the static rooms (cmake/install.cmake); CMake
// wants one source of its own for a shared library.
