// One verified module with every instruction form the builder can emit (docs/kernels.md lists
// them), shared by the tests that must accept all of it: ptxas assembles it
// (tests/kernels/ptxas_test.cc) and the PTX interpreter's parser reads it
// (tests/ptxsim/builder_forms_test.cc). A form added to the builder is added here once.
//
//   Module m = EveryInstructionFormModule();
//   ASSERT_TRUE(Verify(m).ok());
//   const std::string text = EmitPtx(m);   // entry kEveryFormEntry, .version 7.0, .target sm_80
#pragma once

#include <cstdint>

#include "absl/strings/string_view.h"
#include "kernels/ptx/ptx_ir.h"

namespace normgrad::kernels {

inline constexpr absl::string_view kEveryFormEntry = "all_forms";
inline constexpr int kEveryFormTargetSm = 80;  // the lowest target with every form (bf16 cvt)
inline constexpr uint32_t kEveryFormParams = 3;          // ptr (u64), n (u32), scale (f32)
inline constexpr uint32_t kEveryFormSharedBytes = 256;  // one static shared array

// The module, built fresh on every call.
Module EveryInstructionFormModule();

}  // namespace normgrad::kernels
