"""The release as a user gets it: an sdist, a wheel built from that sdist (as `python -m build` does), the wheel
installed into a fresh virtual environment and imported there.

Built by setuptools' PEP 517 hooks in this environment (what `python -m build --no-isolation` calls): no download
and a few seconds, where `build` would first be installed and its isolated environment would fetch setuptools.
The venv sees this environment's packages (--system-site-packages: torch is not installed again) and the wheel is
installed with --no-deps --no-index, so only the wheel itself is tested: its modules, its package data (py.typed)
and nothing from tests/."""

import contextlib
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from setuptools import build_meta

ROOT = Path(__file__).resolve().parent.parent


def fail(message: str) -> None:
    sys.exit(f".ci/package.py: {message}")


@contextlib.contextmanager
def quiet():
    """setuptools' log of every file it copies, shown only when the build fails."""
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            yield
    except BaseException:
        sys.stderr.write(log.getvalue())
        raise


def main() -> None:
    version = re.search(r'^__version__ = "([^"]+)"', (ROOT / "loader" / "__init__.py").read_text(), re.M).group(1)
    if f"## {version}" not in (ROOT / "CHANGELOG.md").read_text():
        fail(f"CHANGELOG.md has no section '## {version}' for loader.__version__")
    with tempfile.TemporaryDirectory(prefix="loader-dist-") as out:
        check(Path(out), version)


def check(out: Path, version: str) -> None:
    with quiet():
        os.chdir(ROOT)
        sdist = out / build_meta.build_sdist(str(out))
        with tarfile.open(sdist) as tar:
            tar.extractall(out / "src", filter="data")
        os.chdir(out / "src" / f"loader-{version}")  # the wheel from the sdist: a file the sdist lacks fails here
        wheel = out / build_meta.build_wheel(str(out))
    names = zipfile.ZipFile(wheel).namelist()
    if "loader/py.typed" not in names:
        fail(f"{wheel.name} has no loader/py.typed")
    strays = [n for n in names if not n.startswith(("loader/", f"loader-{version}.dist-info/"))]
    if strays:
        fail(f"{wheel.name} holds files outside the package (tests?): {strays[:5]}")
    venv = out / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--ignore-installed", str(wheel)], check=True
    )
    check = (
        "import pathlib, sys, loader; here = pathlib.Path(loader.__file__).parent; "
        "assert here.is_relative_to(sys.prefix), here; assert (here / 'py.typed').is_file(); "
        "print(loader.__version__)"
    )
    found = subprocess.run(
        [python, "-I", "-c", check], check=True, capture_output=True, text=True, cwd=out
    ).stdout.strip()
    if found != version:
        fail(f"the installed wheel's loader.__version__ is {found!r}, not {version!r}")
    print(f"{sdist.name} and {wheel.name} ({len(names)} files): installed in a fresh venv, loader {found} imports")


if __name__ == "__main__":
    main()
