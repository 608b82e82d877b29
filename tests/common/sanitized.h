// kSanitized: true in a build with AddressSanitizer or ThreadSanitizer, whose shadow memory and
// allocator make a process's memory figures (VmHWM, RSS) meaningless against a bound. Tests that
// check such figures skip that check there and still run everything else.
#pragma once

namespace normgrad::testing {

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
inline constexpr bool kSanitized = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
#else
inline constexpr bool kSanitized = false;
#endif

}  // namespace normgrad::testing
