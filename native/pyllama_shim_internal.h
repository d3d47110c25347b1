// What the shim's C++ files share (never seen by cffi).
#pragma once

#include <cstdint>

namespace pyllama {
// Keep `what` as this thread's pyllama_last_error() and return -1.
int32_t fail(const char * what);
}  // namespace pyllama
