# normgrad_add_ptx_library(): a static library embedding normgrad's PTX (and cubins) for a set of
# configurations, chosen at run time with normgrad/ptx_library.h. Included by normgradConfig.cmake;
# docs/build-systems.md describes it with a worked example.
#
#   normgrad_add_ptx_library(NAME
#     KERNEL k [KERNEL k2 ...]      kernels' names (normgrad-ptx --list)
#     HIDDEN_DIMS n [n2 ...]        every kernel x hidden_dim x dtype x target is embedded
#     DTYPES f32|bf16|f16 [...]
#     TARGETS sm_80 [sm_90 ...]
#     [GAMMA_OFFSET x] [NO_GAMMA]   the RMSNorm variant of every image (docs/api.md, Variants):
#     [CASTING_MODE llama|gemma|none]  default offset 0, a gamma, gemma (the plain RMSNorm)
#     [CUBINS AUTO|ON|OFF])         default: NORMGRAD_PTX_CUBINS, else AUTO
#
# Gives the static library NAME and its header NAME.h, which declares
# `const normgrad::PtxLibrary& normgrad::embedded::<NAME as a C identifier>()`. One variant per
# library: a program that needs several links one library for each.
#
# Where the images come from, decided when the project is configured:
#   - a server, when NORMGRAD_PTX_SERVER (CMake variable) or else $ENV{NORMGRAD_TARGET} names
#     one: the installed `normgrad emit-ptx` fetches each configuration (extra client flags, such
#     as --tls or --token-file, in the list NORMGRAD_PTX_SERVER_ARGS; NORMGRAD_PTX_CACHE_DIR, the
#     CLI's --cache-dir, else the CLI's $NORMGRAD_PTX_CACHE at build time);
#   - else offline: the installed normgrad-ptx prints the PTX and normgrad-cubin compiles cubins.
# Both emit the same bytes. Cubins: ON requires them, OFF leaves them out, AUTO embeds them when
# nvJitLink is there (the server's, as `normgrad info` reports it, or this machine's, as
# `normgrad-cubin --check` finds it).
#
# Each configuration is one custom command (its PTX and cubin files) and one that turns them into
# a C++ source; that source is rewritten only when its content changes, so a rebuild with nothing
# changed runs nothing and a regenerated but equal image compiles nothing.

set(_NORMGRAD_PTX_EMBED_SCRIPT ${CMAKE_CURRENT_LIST_DIR}/NormgradPtxEmbed.cmake)

# Whether nvJitLink makes cubins for one server (or offline): sets `out` to TRUE/FALSE. Asked once
# per build tree; the answer stays in the CMake cache.
function(_normgrad_ptx_cubins_available out server server_args)
  set(cache_var _NORMGRAD_PTX_NVJITLINK_${server})
  string(MAKE_C_IDENTIFIER "${cache_var}" cache_var)
  if(DEFINED ${cache_var})
    set(${out} ${${cache_var}} PARENT_SCOPE)
    return()
  endif()
  # execute_process does not expand generator expressions: read the imported location.
  set(available FALSE)
  if(server)
    get_target_property(cli normgrad::normgrad LOCATION)
    execute_process(COMMAND ${cli} --server ${server} ${server_args} info
      RESULT_VARIABLE rc OUTPUT_VARIABLE info ERROR_VARIABLE err)
    if(NOT rc EQUAL 0)
      message(FATAL_ERROR "normgrad_add_ptx_library: the PTX server ${server} did not answer "
        "`normgrad info` (exit ${rc}): ${err}Start it, or unset NORMGRAD_PTX_SERVER and "
        "NORMGRAD_TARGET to build offline.")
    endif()
    string(JSON nvjitlink ERROR_VARIABLE json_err GET "${info}" nvjitlink_available)
    if(nvjitlink)
      set(available TRUE)
    endif()
  elseif(TARGET normgrad::cubin)
    get_target_property(cubin_tool normgrad::cubin LOCATION)
    execute_process(COMMAND ${cubin_tool} --check RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
    if(rc EQUAL 0)
      set(available TRUE)
    endif()
  endif()
  set(${cache_var} ${available} CACHE INTERNAL "")
  set(${out} ${available} PARENT_SCOPE)
endfunction()

function(normgrad_add_ptx_library name)
  cmake_parse_arguments(PARSE_ARGV 1 arg "NO_GAMMA" "CUBINS;GAMMA_OFFSET;CASTING_MODE"
    "KERNEL;HIDDEN_DIMS;DTYPES;TARGETS")
  if(arg_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "normgrad_add_ptx_library(${name}): unknown arguments "
      "\"${arg_UNPARSED_ARGUMENTS}\" (KERNEL, HIDDEN_DIMS, DTYPES, TARGETS, GAMMA_OFFSET, "
      "NO_GAMMA, CASTING_MODE, CUBINS)")
  endif()
  foreach(field KERNEL HIDDEN_DIMS DTYPES TARGETS)
    if(NOT arg_${field})
      message(FATAL_ERROR "normgrad_add_ptx_library(${name}): ${field} needs at least one value")
    endif()
  endforeach()
  foreach(n IN LISTS arg_HIDDEN_DIMS)
    if(NOT n MATCHES "^[1-9][0-9]*$")
      message(FATAL_ERROR "normgrad_add_ptx_library(${name}): HIDDEN_DIMS \"${n}\" is not a "
        "positive integer")
    endif()
  endforeach()
  foreach(d IN LISTS arg_DTYPES)
    if(NOT d MATCHES "^(f32|bf16|f16)$")
      message(FATAL_ERROR "normgrad_add_ptx_library(${name}): DTYPES \"${d}\" is not f32, bf16 "
        "or f16")
    endif()
  endforeach()
  foreach(t IN LISTS arg_TARGETS)
    if(NOT t MATCHES "^sm_[1-9][0-9]+$")
      message(FATAL_ERROR "normgrad_add_ptx_library(${name}): TARGETS \"${t}\" is not sm_NN "
        "(sm_80, sm_90, ...)")
    endif()
  endforeach()
  # The variant: the emitters' flags, and what each image records.
  set(variant_flags "")
  set(gamma_offset 0)
  set(has_gamma true)
  set(casting_mode gemma)
  if(DEFINED arg_GAMMA_OFFSET)
    if(NOT arg_GAMMA_OFFSET MATCHES "^[-+]?([0-9]+\\.?[0-9]*|\\.[0-9]+)([eE][-+]?[0-9]+)?$")
      message(FATAL_ERROR "normgrad_add_ptx_library(${name}): GAMMA_OFFSET \"${arg_GAMMA_OFFSET}\" "
        "is not a decimal number (1, -0.5, 1e-3)")
    endif()
    if(arg_NO_GAMMA)
      message(FATAL_ERROR "normgrad_add_ptx_library(${name}): NO_GAMMA takes no GAMMA_OFFSET "
        "(an offset scales gamma)")
    endif()
    set(gamma_offset ${arg_GAMMA_OFFSET})
    list(APPEND variant_flags --gamma-offset ${arg_GAMMA_OFFSET})
  endif()
  if(arg_NO_GAMMA)
    set(has_gamma false)
    list(APPEND variant_flags --no-gamma)
  endif()
  if(DEFINED arg_CASTING_MODE)
    if(NOT arg_CASTING_MODE MATCHES "^(llama|gemma|none)$")
      message(FATAL_ERROR "normgrad_add_ptx_library(${name}): CASTING_MODE "
        "\"${arg_CASTING_MODE}\" is not llama, gemma or none")
    endif()
    set(casting_mode ${arg_CASTING_MODE})
    list(APPEND variant_flags --casting-mode ${arg_CASTING_MODE})
  endif()

  # Offline or a server, and cubins or not.
  set(server "")
  if(NORMGRAD_PTX_SERVER)
    set(server ${NORMGRAD_PTX_SERVER})
  elseif(DEFINED ENV{NORMGRAD_TARGET} AND NOT "$ENV{NORMGRAD_TARGET}" STREQUAL "")
    set(server $ENV{NORMGRAD_TARGET})
  endif()
  set(cubins ${arg_CUBINS})
  if(NOT cubins)
    set(cubins ${NORMGRAD_PTX_CUBINS})
  endif()
  if(NOT cubins)
    set(cubins AUTO)
  endif()
  string(TOUPPER "${cubins}" cubins)
  if(cubins STREQUAL "AUTO" OR cubins STREQUAL "ON")
    _normgrad_ptx_cubins_available(nvjitlink "${server}" "${NORMGRAD_PTX_SERVER_ARGS}")
    if(cubins STREQUAL "ON" AND NOT nvjitlink)
      if(server)
        message(FATAL_ERROR "normgrad_add_ptx_library(${name}): CUBINS ON, but the server "
          "${server} has no nvJitLink (`normgrad info`: nvjitlink_available false)")
      endif()
      message(FATAL_ERROR "normgrad_add_ptx_library(${name}): CUBINS ON, but nvJitLink is not "
        "available here (`normgrad-cubin --check` says why; NORMGRAD_NVJITLINK names the library)")
    endif()
    set(cubins ${nvjitlink})
  elseif(cubins STREQUAL "OFF")
    set(cubins FALSE)
  else()
    message(FATAL_ERROR "normgrad_add_ptx_library(${name}): CUBINS \"${cubins}\" is not AUTO, ON "
      "or OFF")
  endif()

  string(MAKE_C_IDENTIFIER "${name}" cname)
  set(gen ${CMAKE_CURRENT_BINARY_DIR}/${name}_ptx)
  file(MAKE_DIRECTORY ${gen})
  set(sources "")
  set(declarations "")
  set(entries "")
  foreach(kernel IN LISTS arg_KERNEL)
    foreach(hidden IN LISTS arg_HIDDEN_DIMS)
      foreach(dtype IN LISTS arg_DTYPES)
        foreach(target IN LISTS arg_TARGETS)
          set(stem ${kernel}_h${hidden}_${dtype}_${target})
          set(ptx ${gen}/${stem}.ptx)
          set(outputs ${ptx})
          set(cubin "")
          if(cubins)
            set(cubin ${gen}/${stem}.cubin)
            list(APPEND outputs ${cubin})
          endif()
          set(flags --kernel ${kernel} --hidden-dim ${hidden} --dtype ${dtype} --target ${target}
                    ${variant_flags})
          if(server)
            set(fetch_flags "")
            if(cubins)
              set(fetch_flags --cubin ${cubin})
            endif()
            if(NORMGRAD_PTX_CACHE_DIR)
              list(APPEND fetch_flags --cache-dir ${NORMGRAD_PTX_CACHE_DIR})
            endif()
            add_custom_command(OUTPUT ${outputs}
              COMMAND normgrad::normgrad emit-ptx --server ${server} ${NORMGRAD_PTX_SERVER_ARGS}
                      ${flags} -o ${ptx} ${fetch_flags}
              DEPENDS $<TARGET_FILE:normgrad::normgrad>
              COMMENT "normgrad: fetching ${stem} from ${server}" VERBATIM)
          else()
            set(cubin_command "")
            set(cubin_tool "")
            if(cubins)
              set(cubin_command COMMAND normgrad::cubin --target ${target} -o ${cubin} ${ptx})
              set(cubin_tool $<TARGET_FILE:normgrad::cubin>)
            endif()
            add_custom_command(OUTPUT ${outputs}
              COMMAND normgrad::ptx ${flags} -o ${ptx}
              ${cubin_command}
              DEPENDS $<TARGET_FILE:normgrad::ptx> ${cubin_tool}
              COMMENT "normgrad: emitting ${stem}" VERBATIM)
          endif()

          set(source ${gen}/${stem}.cc)
          set(symbol ${cname}_${stem})
          string(MAKE_C_IDENTIFIER "${symbol}" symbol)
          add_custom_command(OUTPUT ${source}
            COMMAND ${CMAKE_COMMAND} -DPTX=${ptx} -DCUBIN=${cubin} -DOUTPUT=${source}
                    -DSYMBOL=${symbol} -DKERNEL=${kernel} -DHIDDEN_DIM=${hidden} -DDTYPE=${dtype}
                    -DGAMMA_OFFSET=${gamma_offset} -DHAS_GAMMA=${has_gamma}
                    -DCASTING_MODE=${casting_mode} -P ${_NORMGRAD_PTX_EMBED_SCRIPT}
            DEPENDS ${outputs} ${_NORMGRAD_PTX_EMBED_SCRIPT}
            COMMENT "normgrad: embedding ${stem}" VERBATIM)
          list(APPEND sources ${source})
          set(count 1)
          if(cubins)
            set(count 2)
          endif()
          string(APPEND declarations "extern const PtxImage ${symbol}[${count}];\n")
          string(APPEND entries "  &${symbol}[0],\n")
          if(cubins)
            string(APPEND entries "  &${symbol}[1],\n")
          endif()
        endforeach()
      endforeach()
    endforeach()
  endforeach()

  # The index and the header are known now: written at configure time, only when they change.
  file(CONFIGURE OUTPUT ${gen}/include/${name}.h CONTENT
"// Generated by normgrad_add_ptx_library(${name}); do not edit.
#ifndef NORMGRAD_EMBEDDED_${cname}_H_
#define NORMGRAD_EMBEDDED_${cname}_H_
#include \"normgrad/ptx_library.h\"
namespace normgrad::embedded {
const PtxLibrary& ${cname}();
}  // namespace normgrad::embedded
#endif  // NORMGRAD_EMBEDDED_${cname}_H_
")
  file(CONFIGURE OUTPUT ${gen}/${name}_index.cc CONTENT
"// Generated by normgrad_add_ptx_library(${name}); do not edit.
#include \"${name}.h\"
namespace normgrad::embedded {
${declarations}
namespace {
const PtxImage* const kImages[] = {
${entries}};
constexpr PtxLibrary kLibrary(kImages, sizeof(kImages) / sizeof(kImages[0]));
}  // namespace
const PtxLibrary& ${cname}() { return kLibrary; }
}  // namespace normgrad::embedded
")

  add_library(${name} STATIC ${gen}/${name}_index.cc ${sources})
  target_include_directories(${name} PUBLIC ${gen}/include)
  target_link_libraries(${name} PUBLIC normgrad::ptx_library)
  target_compile_features(${name} PUBLIC cxx_std_17)
endfunction()
