"""`pip install --no-build-isolation .` (the repository root) into a fresh virtualenv (made with
--system-site-packages, offline: --no-index), from a copy of the sources: the package imports
from the virtualenv, normgrad and normgrad.torch run a backward against a real server, and
`pip uninstall -y normgrad` removes it. Prints how long the install took."""

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import unittest

from server_process import ServerProcess

REPOSITORY = pathlib.Path(__file__).resolve().parents[2]

# Run in the virtualenv: one backward by numpy and one through normgrad.torch (the default
# RMSNorm: this checks the package, not the variants), the first against a float64 reference;
# prints where normgrad was imported from.
CHECK = textwrap.dedent("""
    import sys
    import numpy as np
    import torch
    import normgrad, normgrad.torch
    client = normgrad.Client(sys.argv[1])
    rng = np.random.default_rng(0)
    x, dy = rng.standard_normal((3, 40)), rng.standard_normal((3, 40))
    rms = np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)
    g = dy * 1.5
    want = (g - x / rms * (g * x / rms).sum(-1, keepdims=True) / 40) / rms
    dx, dgamma = client.backward(x.astype(np.float32), dy.astype(np.float32),
                                 np.full(40, 1.5, np.float32))
    assert np.abs(dx - want).max() <= 1e-5 * np.abs(want).max(), np.abs(dx - want).max()
    xt = torch.tensor(x, dtype=torch.float32, requires_grad=True)
    weight = torch.ones(40, requires_grad=True)
    normgrad.torch.rms_norm(xt, weight, client=client).backward(torch.tensor(dy).float())
    assert xt.grad.shape == (3, 40) and weight.grad.shape == (40,)
    print(normgrad.__file__)
""")


def copy_sources(destination):
    """The repository's sources without build trees, pip's own outputs or version control."""
    def ignore(directory, names):
        skip = {".git", "__pycache__"}
        if pathlib.Path(directory) == REPOSITORY:
            skip |= {name for name in names if name.startswith("build")}
        if pathlib.Path(directory) == REPOSITORY / "python":
            skip |= {"build"}
        return skip | {name for name in names if name.endswith(".egg-info")}
    shutil.copytree(REPOSITORY, destination, ignore=ignore)


class PipInstallTest(unittest.TestCase):
    def test_install_import_use_uninstall(self):
        server = ServerProcess("cpu")
        self.addCleanup(server.stop)
        directory = tempfile.TemporaryDirectory(prefix="normgrad-pip-")
        self.addCleanup(directory.cleanup)
        root = pathlib.Path(directory.name)
        copy_sources(root / "src")
        # The interpreter the tests run under (the system's python3, with numpy and torch).
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", root / "venv"],
                       check=True)
        python = str(root / "venv" / "bin" / "python")
        # Nothing from the developer's build: no PYTHONPATH into build/python.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

        # From the repository root (the whole build, timed).
        where = root / "src"
        start = time.monotonic()
        install = subprocess.run(
            [python, "-m", "pip", "install", "--no-build-isolation", "--no-index", str(where)],
            env=env, capture_output=True, text=True)
        seconds = time.monotonic() - start
        self.assertEqual(install.returncode, 0, install.stdout[-4000:] + install.stderr[-4000:])
        print(f"pip install .: {seconds:.0f} s", file=sys.stderr)
        self.check_installed_then_uninstall(python, env, root, server)
        # A developer's CMake build/ at the root is not touched by the root install.
        self.assertFalse((root / "src" / "build").exists())

    def check_installed_then_uninstall(self, python, env, root, server):
        check = subprocess.run([python, "-c", CHECK, server.address], env=env,
                               capture_output=True, text=True, cwd=root)
        self.assertEqual(check.returncode, 0, check.stderr[-4000:])
        self.assertTrue(check.stdout.strip().startswith(str(root / "venv")), check.stdout)

        uninstall = subprocess.run([python, "-m", "pip", "uninstall", "-y", "normgrad"],
                                   env=env, capture_output=True, text=True)
        self.assertEqual(uninstall.returncode, 0, uninstall.stderr[-4000:])
        gone = subprocess.run([python, "-c", "import normgrad"], env=env, capture_output=True,
                              text=True, cwd=root)
        self.assertNotEqual(gone.returncode, 0)
        self.assertIn("No module named 'normgrad'", gone.stderr)
        left = [str(p) for p in (root / "venv").rglob("normgrad*")]
        self.assertEqual(left, [])


if __name__ == "__main__":
    unittest.main()
