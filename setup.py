"""`pip install --no-build-isolation .` from the repository root: the package in python/, with
normgrad._native built by CMake.

The extension is the CMake target normgrad_python_native (python/CMakeLists.txt): this runs
CMake on the repository in a build directory of its own under setuptools' build_temp (never
the developer's build/), with the tests and benchmarks off, builds that target and what it
links (the proto and the C++ client) only, and copies the module into the package.
setuptools' build files go to python/build/ so that they never mix with a developer's CMake
build/ here. NORMGRAD_CMAKE_ARGS adds CMake arguments (shell syntax);
CMAKE_BUILD_PARALLEL_LEVEL sets the compile jobs (default: the CPU count).
"""

import os
import pathlib
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

REPOSITORY = pathlib.Path(__file__).resolve().parent
TARGET = "normgrad_python_native"


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = pathlib.Path(self.build_temp).resolve() / "cmake"
        configure = ["cmake", "-S", str(REPOSITORY), "-B", str(build_dir),
                     "-DCMAKE_BUILD_TYPE=Release", "-DNORMGRAD_BUILD_TESTS=OFF",
                     "-DNORMGRAD_BUILD_BENCHMARKS=OFF", "-DNORMGRAD_BUILD_PYTHON=ON",
                     f"-DPython3_EXECUTABLE={sys.executable}"]
        if shutil.which("ninja") and not (build_dir / "CMakeCache.txt").exists():
            configure += ["-G", "Ninja"]
        configure += shlex.split(os.environ.get("NORMGRAD_CMAKE_ARGS", ""))
        jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 1)
        subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", TARGET,
                        "--parallel", jobs], check=True)
        built = build_dir / "python" / "normgrad" / pathlib.Path(self.get_ext_filename(
            ext.name)).name
        destination = pathlib.Path(self.get_ext_fullpath(ext.name))
        destination.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built, destination)


setup(ext_modules=[CMakeExtension("normgrad._native")], cmdclass={"build_ext": CMakeBuild},
      options={"build": {"build_base": "python/build"}, "egg_info": {"egg_base": "python"}})
