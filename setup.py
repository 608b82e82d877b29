"""`pip install --no-build-isolation .` from the repository root: the package in python/ (its
setup.py builds the extension with CMake), with setuptools' build files in python/build/ so
that they never mix with a developer's CMake build/ here."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "python"))
from setup import normgrad_setup  # noqa: E402  (python/setup.py)

normgrad_setup(options={"build": {"build_base": "python/build"},
                        "egg_info": {"egg_base": "python"}})
