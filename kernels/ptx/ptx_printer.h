// PTX text from the IR (kernels/ptx/ptx_ir.h): EmitPtx() writes a whole module in the conventional
// layout (header, one `.visible .entry` each with its `.maxntid` when declared, its `.reg` and
// `.shared` declarations, one instruction per line); InstructionText() writes one instruction, for
// messages and tests.
//
//   NORMGRAD_RETURN_IF_ERROR(Verify(module));   // kernels/ptx/verifier.h
//   std::string text = EmitPtx(module);                       // deterministic bytes
//   InstructionText(f, f.instructions()[3]);                  // "@%p1 bra $L_done_0"
#pragma once

#include <string>

#include "absl/strings/string_view.h"
#include "kernels/ptx/ptx_ir.h"

namespace normgrad::kernels {

// Bumped whenever emission changes for an unchanged config; written into every module's header
// and part of every ConfigKey (built_kernel.cc).
// 2: entries declare `.maxntid`. 3: the row-resident kernel writes grad_gamma itself (one launch).
inline constexpr absl::string_view kGeneratorVersion = "normgrad-ptx/3";

// One instruction as emitted, without indentation or ';' ("@%p1 bra $L_exit_0"); a label is
// "$L_exit_0:".
std::string InstructionText(const Function& function, const Instruction& inst);

// The module as PTX text. Deterministic: equal modules give equal bytes. Expects a module that
// passed Verify(); for a broken one the text is still produced but may not assemble.
std::string EmitPtx(const Module& module);

}  // namespace normgrad::kernels
