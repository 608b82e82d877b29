// Verify(): the checks a finished Module must pass before its text is emitted, in the spirit of
// LLVM's Verifier. The builder never checks its inputs; this does, once, for the whole module.
//
//   NORMGRAD_RETURN_IF_ERROR(Verify(module));
//
// Checked: the target is supported and the .version is high enough for it and for the
// instructions; entry and parameter names are valid, unique identifiers; every register handle
// names a register of that type; every register is written on every path before it is read;
// operand and destination types match the instruction's type (PTX's compatibility rules: same
// type, or a .bN type of the same size, or integers of the same size); rounding modifiers are
// present where PTX requires them and absent where it forbids them; every branch target is bound
// exactly once; every ld.param names a declared parameter of that type; guards are predicates;
// constant address offsets are multiples of the access size (16 for a .v4.f32); shared arrays have
// unique names, a power-of-two alignment and at most 48 KiB in all, and their addresses are only
// taken with mov; a declared `.maxntid` is at most 1024; control does not run off the end of an
// entry.
#pragma once

#include "absl/status/status.h"
#include "kernels/ptx/ptx_ir.h"

namespace normgrad::kernels {

// OK, or INVALID_ARGUMENT naming the entry, the instruction index, its text and the problem.
absl::Status Verify(const Module& module);

// One entry only (used by Verify; module-level checks excluded).
absl::Status VerifyFunction(const Function& function);

}  // namespace normgrad::kernels
