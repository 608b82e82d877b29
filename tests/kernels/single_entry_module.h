// A module with one entry `k` (PTX 7.0, sm_80) taking a u64 `data` and a u32 `n`, and a builder
// at the end of its still empty body: the starting point of the tests that write a small body
// and check what the verifier or the divergence analysis says about it.
//
//   SingleEntryModule e;
//   e.b.St(StateSpace::kGlobal, Address{e.b.LdParam(e.data)}, Value::F32(0.0f));
//   e.b.Ret();
//   EXPECT_TRUE(Verify(e.m).ok());
#pragma once

#include "kernels/kernel_config.h"
#include "kernels/ptx/ptx_builder.h"
#include "kernels/ptx/ptx_ir.h"

namespace normgrad::kernels {

struct SingleEntryModule {
  Module m{PtxVersion{7, 0}, 80};
  Function& f = m.AddEntry("k");
  Param data = f.AddParam(PtxType::kU64, "data");
  Param n = f.AddParam(PtxType::kU32, "n");
  Builder b{&f};
};

}  // namespace normgrad::kernels
