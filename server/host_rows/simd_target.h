// Which SIMD target (Highway) host_rows' row math and conversions run on, and, for benchmarks and
// tests, limiting it.
#pragma once

#include <string>
#include <vector>

namespace normgrad::server::host_rows {

// Name of the SIMD target the dispatcher picked on this machine ("AVX3", "AVX2", ...).
std::string SimdTargetName();

// For benchmarks and tests: from now on the dispatcher picks no target better than `name` (a
// SimdTargetName() of a target this build has and the CPU supports; "AVX2" on an AVX-512
// machine runs the code path of CPUs without AVX-512); "" lifts the limit. False, and nothing
// changed, otherwise. Not thread-safe with calls running on other threads.
bool LimitSimdTarget(const std::string& name);

// The targets this build has and this CPU runs, best first (what LimitSimdTarget takes).
std::vector<std::string> SupportedSimdTargets();

}  // namespace normgrad::server::host_rows
