// The parser accepts the conventional PTX subset and refuses the rest with the line and reason.
#include "tests/ptxsim/sim/parser.h"

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace normgrad::ptxsim {
namespace {

using ::testing::HasSubstr;

constexpr char kHeader[] = ".version 7.8\n.target sm_90\n.address_size 64\n";

std::string Module1(absl::string_view body) {
  return absl::StrCat(kHeader, ".visible .entry k(\n  .param .u64 out,\n  .param .u32 n\n)\n{\n",
                      body, "}\n");
}

TEST(PtxParser, AcceptsConventionalModuleAndDecodesOnce) {
  const std::string ptx = Module1(R"(
  .reg .pred %p<3>;
  .reg .b32 %r<6>;
  .reg .f32 %f<6>;
  .reg .b64 %rd<4>;
  .shared .align 4 .b8 smem[128];
  // a comment
  ld.param.u64 %rd1, [out];
  ld.param.u32 %r1, [n];
  mov.u32 %r2, %tid.x;
  /* block
     comment */
  setp.ge.u32 %p1, %r2, %r1;
  @%p1 bra $L__done;
  mul.wide.u32 %rd2, %r2, 4;
  add.s64 %rd3, %rd1, %rd2;
  mov.f32 %f1, 0f3F800000;
  mov.f32 %f2, 2.5;
  fma.rn.f32 %f3, %f1, %f2, %f1;
  shfl.sync.down.b32 %f4|%p2, %f3, 16, 31, 0xffffffff;
  ld.global.v4.f32 {%f1, %f2, %f3, %f4}, [%rd3+16];
  st.shared.f32 [smem+4], %f1;
  bar.sync 0;
  atom.global.add.f32 %f5, [%rd3], %f1;
  st.global.f32 [%rd3], %f3;
$L__done:
  ret;
)");
  absl::StatusOr<Module> module = ParsePtx(ptx);
  ASSERT_TRUE(module.ok()) << module.status();
  EXPECT_EQ(module->version_major, 7);
  EXPECT_EQ(module->version_minor, 8);
  EXPECT_EQ(module->target_sm, 90);
  const Entry* entry = module->FindEntry("k");
  ASSERT_NE(entry, nullptr);
  ASSERT_EQ(entry->params.size(), 2u);
  EXPECT_EQ(entry->params[0].offset, 0u);
  EXPECT_EQ(entry->params[1].offset, 8u);
  EXPECT_EQ(entry->param_bytes, 12u);
  EXPECT_EQ(entry->static_shared_bytes, 128u);
  // 17 instructions plus the implicit exit at the closing brace.
  ASSERT_EQ(entry->code.size(), 18u);
  const Instruction& bra = entry->code[4];
  EXPECT_EQ(bra.op, Op::kBra);
  EXPECT_EQ(bra.target, 16u);  // the ret after $L__done
  EXPECT_NE(bra.guard, kNoReg);
  const Instruction& shfl = entry->code[10];
  EXPECT_EQ(shfl.op, Op::kShfl);
  EXPECT_EQ(shfl.num_dst, 2);
  EXPECT_EQ(shfl.src[3].imm, 0xffffffffu);
  const Instruction& ld4 = entry->code[11];
  EXPECT_EQ(ld4.vec, 4);
  EXPECT_EQ(ld4.src[0].imm, 16u);
  EXPECT_EQ(entry->code[7].src[0].imm, 0x3F800000u);
  EXPECT_EQ(entry->code[8].src[0].imm, 0x40200000u);  // 2.5f
  EXPECT_EQ(entry->code[12].src[0].imm, 4u);          // smem+4
}

struct Refusal {
  const char* name;
  const char* body;
  int line;  // line of the offending statement in the whole module
  const char* reason;
};

class PtxParserRefuses : public ::testing::TestWithParam<Refusal> {};

TEST_P(PtxParserRefuses, WithLineAndReason) {
  const Refusal& r = GetParam();
  absl::StatusOr<Module> module = ParsePtx(Module1(r.body));
  ASSERT_FALSE(module.ok());
  EXPECT_EQ(module.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(module.status().message()),
              HasSubstr(absl::StrCat("line ", r.line, ":")));
  EXPECT_THAT(std::string(module.status().message()), HasSubstr(r.reason));
}

// The body starts on line 9 of the module (3 header lines, 4 for the signature, "{").
INSTANTIATE_TEST_SUITE_P(
    Cases, PtxParserRefuses,
    ::testing::Values(
        Refusal{"UnknownInstruction", ".reg .b32 %r<2>;\nbrev.b32 %r1, %r1;\n", 10,
                "unsupported instruction 'brev.b32'"},
        Refusal{"UndeclaredRegister", ".reg .b32 %r<2>;\nmov.u32 %r5, 1;\n", 10,
                "undeclared register '%r5'"},
        Refusal{"UnknownLabel", "bra NOWHERE;\n", 9, "unknown label 'NOWHERE'"},
        Refusal{"DirectedRoundingOutsideSubset",
                ".reg .f64 %fd<3>;\nadd.rz.f64 %fd1, %fd1, %fd2;\n", 10,
                "rounding .rz/.rm/.rp is supported on f32"},
        Refusal{"HalfPrecisionArithmetic", ".reg .f16 %h<3>;\nadd.rn.f16 %h1, %h1, %h2;\n", 10,
                "f16/bf16 arithmetic is not supported"},
        Refusal{"DivWithoutRounding", ".reg .f32 %f<3>;\ndiv.f32 %f1, %f1, %f2;\n", 10,
                "needs .rn or .approx"},
        Refusal{"TypeMismatch", ".reg .f32 %f<3>;\n.reg .b64 %rd<2>;\nadd.f32 %f1, %rd1, %f2;\n",
                11, "register %rd1 is .b64"},
        Refusal{"MissingSemicolon", ".reg .b32 %r<2>;\nmov.u32 %r1, 1\n}\n", 10, "missing ';'"},
        Refusal{"LocalMemory", ".local .align 4 .b8 stack[16];\n", 9, "not supported"},
        Refusal{"ShflWithoutSync", ".reg .b32 %r<3>;\nshfl.down.b32 %r1, %r2, 1, 31;\n", 10,
                "shfl without .sync"},
        Refusal{"UnknownParameter", ".reg .b64 %rd<2>;\nld.param.u64 %rd1, [nope];\n", 10,
                "unknown parameter 'nope'"},
        Refusal{"ParamOutOfRange", ".reg .b64 %rd<2>;\nld.param.u64 %rd1, [n];\n", 10,
                "outside parameter 'n'"},
        Refusal{"WrongOperandCount", ".reg .b32 %r<3>;\nadd.u32 %r1, %r2;\n", 10,
                "takes 3 operands"}),
    [](const ::testing::TestParamInfo<Refusal>& info) { return std::string(info.param.name); });

TEST(PtxParser, RefusesDeviceFunctionsAndBadHeaders) {
  absl::StatusOr<Module> f = ParsePtx(absl::StrCat(kHeader, ".func foo()\n{\nret;\n}\n"));
  ASSERT_FALSE(f.ok());
  EXPECT_THAT(std::string(f.status().message()), HasSubstr("line 4: device functions"));

  absl::StatusOr<Module> addr32 = ParsePtx(".version 7.8\n.target sm_90\n.address_size 32\n");
  ASSERT_FALSE(addr32.ok());
  EXPECT_THAT(std::string(addr32.status().message()), HasSubstr("line 3: .address_size 32"));

  absl::StatusOr<Module> empty = ParsePtx(kHeader);
  ASSERT_FALSE(empty.ok());
  EXPECT_THAT(std::string(empty.status().message()), HasSubstr("no .entry"));

  absl::StatusOr<Module> garbage = ParsePtx(".version 7.8\n.target sm_90\n#include <x>\n");
  ASSERT_FALSE(garbage.ok());
  EXPECT_THAT(std::string(garbage.status().message()),
              HasSubstr("line 3: unexpected character '#'"));
}

// `directive` between the parameter list and the body, as ptxas and the kernels write it.
std::string ModuleWith(absl::string_view directive) {
  return absl::StrCat(kHeader, ".visible .entry k(\n  .param .u64 out\n)\n", directive,
                      "\n{\nret;\n}\n");
}

TEST(PtxParser, ReadsMaxntidAsTheProductOfItsExtents) {
  const auto limit = [](absl::string_view directive) -> uint32_t {
    absl::StatusOr<Module> m = ParsePtx(ModuleWith(directive));
    EXPECT_TRUE(m.ok()) << directive << ": " << m.status();
    return m.ok() ? m->entries[0].max_threads_per_block : 0;
  };
  EXPECT_EQ(limit(""), 0u);  // undeclared: only the device's 1024 applies
  EXPECT_EQ(limit(".maxntid 256, 1, 1"), 256u);
  EXPECT_EQ(limit(".maxntid 32"), 32u);
  EXPECT_EQ(limit(".maxntid 16, 2"), 32u);
  EXPECT_EQ(limit(".reqntid 8, 8, 2"), 128u);
  EXPECT_EQ(limit(".maxntid 512, 1, 1\n.minnctapersm 1"), 512u);
  // Saturates instead of wrapping to 0 ("undeclared").
  EXPECT_EQ(limit(".maxntid 65536, 65536, 65536"), UINT32_MAX);

  // ptxas: "Positive non-zero value expected for maxntid".
  for (absl::string_view bad : {".maxntid 0, 1, 1", ".maxntid 64, 0", ".maxntid x"}) {
    absl::StatusOr<Module> m = ParsePtx(ModuleWith(bad));
    ASSERT_FALSE(m.ok()) << bad;
    EXPECT_THAT(std::string(m.status().message()), HasSubstr("line 7: bad .maxntid value")) << bad;
  }
}

TEST(PtxParser, ReadsTargetsWithSuffixAndNulTerminatedImages) {
  std::string ptx =
      ".version 8.0\n.target sm_90a\n.address_size 64\n.visible .entry e()\n{\nret;\n}\n";
  ptx.push_back('\0');
  absl::StatusOr<Module> module = ParsePtx(ptx);
  ASSERT_TRUE(module.ok()) << module.status();
  EXPECT_EQ(module->target_sm, 90);
  EXPECT_EQ(module->entries[0].params.size(), 0u);
}

}  // namespace
}  // namespace normgrad::ptxsim
