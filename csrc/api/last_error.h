// last_error.h — the exception barrier for C entry points defined outside api.cpp
// (the CUDA backend's, and their stubs when CUDA is not built).
//
// `api_guard` does exactly what api.cpp's `guard` does: dfl::Error (or any
// other exception) becomes DFL_ERROR plus the message for dfl_last_error().
#pragma once
#include <exception>
#include <new>

#include "dflash27b_dev.h"  // the public ABI and the tool entry points

namespace dfl {

// Stores msg as this thread's dfl_last_error() (defined in api.cpp).
void set_last_error(const char* msg);

template <class F>
int api_guard(F&& f) {
  try {
    f();
    return DFL_OK;
  } catch (const std::bad_alloc&) {
    set_last_error("out of memory");
  } catch (const std::exception& e) {
    set_last_error(e.what());
  } catch (...) {
    set_last_error("unknown error");
  }
  return DFL_ERROR;
}

}  // namespace dfl
