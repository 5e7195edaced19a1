// A minimal test harness for the native tests: CHECK records a failure and carries on, so one run
// reports every failing case; main() returns non-zero when anything failed.
#pragma once

#include <cstdio>

namespace native_test {
inline int& failures() {
  static int n = 0;
  return n;
}
inline int& checks() {
  static int n = 0;
  return n;
}
inline int finish(const char* name) {
  std::printf("%s: %d checks, %d failed\n", name, checks(), failures());
  return failures() == 0 ? 0 : 1;
}
}  // namespace native_test

#define CHECK(cond, ...)                                                    \
  do {                                                                      \
    ++native_test::checks();                                                \
    if (!(cond)) {                                                          \
      if (++native_test::failures() <= 20) {                                \
        std::printf("FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond);         \
        std::printf(__VA_ARGS__);                                           \
        std::printf("\n");                                                  \
      }                                                                     \
    }                                                                       \
  } while (0)
