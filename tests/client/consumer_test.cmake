# Installs the build tree into a fresh prefix, then configures, builds and runs
# tests/client/consumer against it: the client library, and normgrad_add_ptx_library() offline
# (the installed normgrad-ptx) and, when this build has normgrad-server, from a server; a rebuild
# with nothing changed must have no work, and a regenerated image with the same bytes must
# recompile nothing. Variables: BUILD_DIR, SOURCE_DIR, WORK_DIR, GENERATOR, and SANITIZE (the
# build's NORMGRAD_SANITIZE: a sanitized library needs a sanitized link).
file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
unset(ENV{NORMGRAD_TARGET})  # the first consumer build is offline
set(server_pid "")
# Runs a command; fails the test with its output unless it exits 0. Sets `out` in the caller.
function(step)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    if(server_pid)
      execute_process(COMMAND kill ${server_pid})
    endif()
    message(FATAL_ERROR "failed (${rc}): ${ARGN}\n${out}\n${err}")
  endif()
  set(out "${out}" PARENT_SCOPE)
endfunction()
function(fail)
  if(server_pid)
    execute_process(COMMAND kill ${server_pid})
  endif()
  message(FATAL_ERROR ${ARGN})
endfunction()
step(${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${WORK_DIR}/prefix)
foreach(f include/normgrad/client.h include/normgrad/v1/normgrad.pb.h
          lib/cmake/normgrad/normgradConfig.cmake include/normgrad/ptx_library.h
          lib/cmake/normgrad/NormgradPtxLibrary.cmake bin/normgrad-ptx bin/normgrad)
  if(NOT EXISTS ${WORK_DIR}/prefix/${f})
    message(FATAL_ERROR "install tree lacks ${f}")
  endif()
endforeach()
set(flags "")
if(SANITIZE)
  set(flags "-fsanitize=${SANITIZE}")
endif()
step(${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/build -G ${GENERATOR}
     -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix -DCMAKE_BUILD_TYPE=Release
     "-DCMAKE_CXX_FLAGS=${flags}" "-DCMAKE_EXE_LINKER_FLAGS=${flags}")
step(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
step(${WORK_DIR}/build/consumer)

# What the installed tools emit, to compare the embedded images with: STEM.ptx (normgrad-ptx),
# STEM.cubin (normgrad-cubin, when nvJitLink is here) and their sha256 digests.
set(prefix ${WORK_DIR}/prefix)
set(ref ${WORK_DIR}/reference)
file(MAKE_DIRECTORY ${ref})
set(cubins 0)
if(EXISTS ${prefix}/bin/normgrad-cubin)
  execute_process(COMMAND ${prefix}/bin/normgrad-cubin --check RESULT_VARIABLE rc
    OUTPUT_QUIET ERROR_QUIET)
  if(rc EQUAL 0)
    set(cubins 1)
  endif()
endif()
step(${prefix}/bin/normgrad-ptx --list)
file(WRITE ${ref}/list.txt "${out}")
set(stems "")
# The plain RMSNorm of both kernels (consumer_ptx), then the variant (consumer_ptx_variant):
# STEM_off1_llama.
foreach(config rms_norm_backward_row_resident batched_rms_norm_backward
               rms_norm_backward_row_resident:off1_llama)
  string(REPLACE ":" ";" config "${config}")
  list(GET config 0 kernel)
  set(suffix "")
  set(variant_flags "")
  list(LENGTH config parts)
  if(parts EQUAL 2)
    set(suffix _off1_llama)
    set(variant_flags --gamma-offset 1 --casting-mode llama)
  endif()
  foreach(target sm_80 sm_90)
    set(stem ${kernel}_h896_bf16_${target}${suffix})
    list(APPEND stems ${stem})
    step(${prefix}/bin/normgrad-ptx --kernel ${kernel} --hidden-dim 896 --dtype bf16
         --target ${target} ${variant_flags} -o ${ref}/${stem}.ptx)
    set(files ${stem}.ptx)
    if(cubins)
      step(${prefix}/bin/normgrad-cubin --target ${target} -o ${ref}/${stem}.cubin
           ${ref}/${stem}.ptx)
      list(APPEND files ${stem}.cubin)
    endif()
    foreach(f IN LISTS files)
      file(SHA256 ${ref}/${f} digest)
      file(WRITE ${ref}/${f}.sha256 "${digest}\n")
    endforeach()
  endforeach()
endforeach()
message(STATUS "cubins embedded: ${cubins}")

# Offline: the consumer above built them with normgrad-ptx.
step(${WORK_DIR}/build/ptx_consumer ${ref} ${cubins})
message(STATUS "offline: ${out}")

# A variant argument that is not one stops configuration, naming the argument and the value.
foreach(bad "CASTING_MODE fp8:CASTING_MODE \"fp8\" is not llama, gemma or none"
            "GAMMA_OFFSET one:GAMMA_OFFSET \"one\" is not a decimal number"
            "NO_GAMMA GAMMA_OFFSET 1:NO_GAMMA takes no GAMMA_OFFSET")
  string(REPLACE ":" ";" bad "${bad}")
  list(GET bad 0 arguments)
  list(GET bad 1 message)
  set(dir ${WORK_DIR}/bad-arguments)
  file(REMOVE_RECURSE ${dir})
  file(WRITE ${dir}/CMakeLists.txt "cmake_minimum_required(VERSION 3.25)
project(bad CXX)
find_package(normgrad CONFIG REQUIRED)
normgrad_add_ptx_library(bad KERNEL rms_norm_backward_row_resident HIDDEN_DIMS 896 DTYPES f32
  TARGETS sm_80 ${arguments})
")
  execute_process(COMMAND ${CMAKE_COMMAND} -S ${dir} -B ${dir}/build -G ${GENERATOR}
    -DCMAKE_PREFIX_PATH=${prefix} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(REGEX REPLACE "[ \n]+" " " err "${err}")
  if(rc EQUAL 0 OR NOT err MATCHES "normgrad_add_ptx_library\\(bad\\): ${message}")
    fail("${arguments}: configuration should stop with \"${message}\" (exit ${rc}):\n${err}")
  endif()
endforeach()
message(STATUS "bad variant arguments: refused when configured")

if(GENERATOR STREQUAL "Ninja")
  # Nothing changed: nothing to do.
  step(${CMAKE_COMMAND} --build ${WORK_DIR}/build -- -n -d explain)
  if(NOT out MATCHES "no work to do")
    fail("a second build of the consumer has work to do:\n${out}")
  endif()
  # One image emitted again with the same bytes: emitted and embedded, but its source is not
  # rewritten, so nothing compiles or links.
  list(GET stems 0 stem)
  file(REMOVE ${WORK_DIR}/build/consumer_ptx_ptx/${stem}.ptx)
  step(${CMAKE_COMMAND} --build ${WORK_DIR}/build)
  if(NOT out MATCHES "emitting ${stem}" OR out MATCHES "Building CXX|Linking")
    fail("after removing ${stem}.ptx the rebuild should emit it and compile nothing:\n${out}")
  endif()
  step(${CMAKE_COMMAND} --build ${WORK_DIR}/build -- -n -d explain)
  if(NOT out MATCHES "no work to do")
    fail("after re-emitting ${stem}.ptx, a further build has work to do:\n${out}")
  endif()
  message(STATUS "rebuilds: no work; ${stem} re-emitted and embedded, nothing compiled")
endif()

# From a server (when this build has one), named by NORMGRAD_TARGET when the consumer is
# configured: the same bytes as offline.
if(EXISTS ${BUILD_DIR}/bin/normgrad-server)
  # The server looks for nvJitLink where normgrad-cubin did, so both make cubins or neither.
  set(nvjitlink_flag "")
  if(DEFINED ENV{NORMGRAD_NVJITLINK})
    set(nvjitlink_flag "--nvjitlink=$ENV{NORMGRAD_NVJITLINK}")
  endif()
  execute_process(
    COMMAND sh -c "exec \"$0\" --listen=127.0.0.1:0 --metrics_listen= --backend=cpu $2 >\"$1\" 2>&1 & echo $!"
            ${BUILD_DIR}/bin/normgrad-server ${WORK_DIR}/server.log "${nvjitlink_flag}"
    OUTPUT_VARIABLE server_pid OUTPUT_STRIP_TRAILING_WHITESPACE)
  set(port "")
  foreach(attempt RANGE 600)  # its ready line, within 60 s
    file(READ ${WORK_DIR}/server.log log)
    if(log MATCHES "ready grpc=[^ ]*:([0-9]+)")
      set(port ${CMAKE_MATCH_1})
      break()
    endif()
    execute_process(COMMAND sleep 0.1)
  endforeach()
  if(NOT port)
    fail("normgrad-server printed no ready line:\n${log}")
  endif()
  step(${CMAKE_COMMAND} -E env NORMGRAD_TARGET=127.0.0.1:${port}
       ${CMAKE_COMMAND} -S ${SOURCE_DIR} -B ${WORK_DIR}/build-server -G ${GENERATOR}
       -DCMAKE_PREFIX_PATH=${prefix} -DCMAKE_BUILD_TYPE=Release
       -DNORMGRAD_PTX_CACHE_DIR=${WORK_DIR}/ptx-cache
       "-DCMAKE_CXX_FLAGS=${flags}" "-DCMAKE_EXE_LINKER_FLAGS=${flags}")
  step(${CMAKE_COMMAND} --build ${WORK_DIR}/build-server --target ptx_consumer)
  if(NOT out MATCHES "fetching [^ ]+ from 127.0.0.1:${port}")
    fail("the server build did not fetch from the server:\n${out}")
  endif()
  # Through the CLI's cache (docs/build-systems.md, Cache): one entry per configuration.
  file(GLOB entries ${WORK_DIR}/ptx-cache/ac/*)
  list(LENGTH entries num_entries)
  if(NOT num_entries EQUAL 6)
    fail("NORMGRAD_PTX_CACHE_DIR holds ${num_entries} cache entries, expected 6: ${entries}")
  endif()
  step(${WORK_DIR}/build-server/ptx_consumer ${ref} ${cubins})
  message(STATUS "from the server: ${out}")
  execute_process(COMMAND kill ${server_pid})
  set(server_pid "")
endif()
