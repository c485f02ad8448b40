// Argument checks of both qerl extensions with printf-style messages.
//
// Measured on the H200 machine (session 8): a failing TORCH_CHECK of these extensions whose message streams an
// integer (c10::str builds it in an ostringstream) killed the process with a segfault, while messages of string
// literals or C strings raised a clean RuntimeError, with or without C++ stack traces. The cause is not
// established (a second C++ runtime's locale facets in the process would do it); QERL_CHECK formats with snprintf
// and hands TORCH_CHECK one C string, the path that was measured to work.
#pragma once

#ifndef QERL_NO_TORCH
#include <cstdio>
#include <string>

#include <torch/extension.h>

#define QERL_CHECK(cond, ...)                                               \
  do {                                                                      \
    if (!(cond)) {                                                          \
      char qerl_msg_[512];                                                  \
      std::snprintf(qerl_msg_, sizeof(qerl_msg_), __VA_ARGS__);             \
      TORCH_CHECK(false, static_cast<const char*>(qerl_msg_));              \
    }                                                                       \
  } while (0)

namespace qerl_check {
// "[d0, d1, ...]" without an ostream
inline std::string shape(at::IntArrayRef s) {
  std::string r = "[";
  char b[32];
  for (size_t i = 0; i < s.size(); ++i) {
    std::snprintf(b, sizeof(b), i ? ", %lld" : "%lld", static_cast<long long>(s[i]));
    r += b;
  }
  return r + "]";
}
}  // namespace qerl_check
#endif
