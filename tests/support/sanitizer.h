// Whether this test binary runs under a sanitizer, and what a test does
// about it. The sanitizer stages check memory and locking; they run the
// same scenarios as the plain build, with two exceptions that keep CI
// inside its time:
//   - volume is cut where it adds nothing to what a sanitizer checks (the
//     same code paths with fewer or smaller messages: kSanitized), and
//   - scenarios whose point is a timing property of a shaped network (TCP
//     back-off over a 20-s drop, rates measured through a throttled link)
//     run in the plain build only; each says so when it skips.
#pragma once

#include <gtest/gtest.h>

namespace paramcast::test {

// PARAMCAST_TEST_ASAN / PARAMCAST_TEST_TSAN: which sanitizer, for GCC
// (__SANITIZE_ADDRESS__) and clang (__has_feature) alike.
#if defined(__SANITIZE_ADDRESS__)
#define PARAMCAST_TEST_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__)
#define PARAMCAST_TEST_TSAN 1
#endif
#if defined(__has_feature)
#if __has_feature(address_sanitizer) && !defined(PARAMCAST_TEST_ASAN)
#define PARAMCAST_TEST_ASAN 1
#endif
#if __has_feature(thread_sanitizer) && !defined(PARAMCAST_TEST_TSAN)
#define PARAMCAST_TEST_TSAN 1
#endif
#endif
#if defined(PARAMCAST_TEST_ASAN) || defined(PARAMCAST_TEST_TSAN)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif

}  // namespace paramcast::test

// In a TEST body: skips a timing scenario under a sanitizer, saying why and
// which test covers its code paths there.
#define PARAMCAST_TIMING_SCENARIO(covered_by)                                                         \
  do {                                                                                                \
    if (::paramcast::test::kSanitized)                                                                \
      GTEST_SKIP() << "a timing scenario: it runs in the plain build; under a sanitizer its code "    \
                      "paths are covered by " covered_by;                                             \
  } while (0)
