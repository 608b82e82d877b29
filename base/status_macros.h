// Early return on error, for code that calls several Status-returning steps in a row. Debian's
// abseil (20220623) has no ABSL_RETURN_IF_ERROR / ASSIGN_OR_RETURN; these are the same idea.
//
//   NORMGRAD_RETURN_IF_ERROR(ctx.MakeCurrent());
//   NORMGRAD_ASSIGN_OR_RETURN(const EmittedPtx ptx, kernel.Emit(config));
//
// The expression is evaluated once. ASSIGN_OR_RETURN moves the value out of the StatusOr into the
// declaration (or existing variable) on its left; it expands to two statements, so it cannot be
// the body of an unbraced if.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define NORMGRAD_RETURN_IF_ERROR(expr)                                      \
  do {                                                                      \
    if (::absl::Status normgrad_status_ = (expr); !normgrad_status_.ok()) { \
      return normgrad_status_;                                              \
    }                                                                       \
  } while (false)

#define NORMGRAD_STATUS_MACROS_CONCAT_INNER_(a, b) a##b
#define NORMGRAD_STATUS_MACROS_CONCAT_(a, b) NORMGRAD_STATUS_MACROS_CONCAT_INNER_(a, b)

#define NORMGRAD_ASSIGN_OR_RETURN(lhs, expr)                                                    \
  NORMGRAD_ASSIGN_OR_RETURN_IMPL_(NORMGRAD_STATUS_MACROS_CONCAT_(normgrad_statusor_, __LINE__), \
                                  lhs, expr)

#define NORMGRAD_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                    \
  if (!statusor.ok()) return std::move(statusor).status();   \
  lhs = *std::move(statusor)
