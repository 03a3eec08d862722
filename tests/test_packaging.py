"""The distribution as users get it: sdist and wheel built, checked, installed, used.

Every other test imports nbtools from the checkout (an editable install or ``PYTHONPATH``),
so only this one notices package data missing from the wheel. The wheel goes into a fresh
virtual environment that sees the packages of the interpreter running the tests (a virtual
environment's own, not its base interpreter's) for torch and the other dependencies, but
nbtools itself comes from the wheel: the test checks where it was imported from, with
``PYTHONPATH`` cleared.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import tarfile
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
_NOT_SOURCES = shutil.ignore_patterns(
    ".git",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".nox",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    "_build",
    "nbtools-demo",
    "mlflow.db*",
    "mlruns",
    "mlartifacts",
)

SMOKE = textwrap.dedent(
    """
    import json, os, sys
    from importlib import resources

    import nbtools
    from nbtools import distributed


    @distributed(processes=2)
    def total(value):
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(value + dist.get_rank())])
        dist.all_reduce(t)
        return t.item()


    if __name__ == "__main__":
        widget = resources.files("nbtools.monitor")
        print(json.dumps({
            "file": nbtools.__file__,
            "version": nbtools.__version__,
            "js": widget.joinpath("_chart.js").is_file(),
            "css": widget.joinpath("_chart.css").is_file(),
            "typed": resources.files("nbtools").joinpath("py.typed").is_file(),
            "results": total.distributed(1),
        }))
    """
)


def _run(*args: object, **kwargs: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    assert proc.returncode == 0, f"{args}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """The sdist and the wheel, built from a copy of the checkout (nothing is written into it)."""
    pytest.importorskip("build")
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_NOT_SOURCES)
    out = tmp / "dist"
    # No isolation: the build backend of this environment, so the test needs no network.
    _run(
        sys.executable,
        "-m",
        "build",
        "--no-isolation",
        "--sdist",
        "--wheel",
        "--outdir",
        out,
        src,
        timeout=600,
    )
    return out


def _one(dist: Path, pattern: str) -> Path:
    (found,) = dist.glob(pattern)
    return found


def test_sdist_and_wheel_pass_twine_check_and_carry_license_and_widget_files(dist):
    pytest.importorskip("twine")
    wheel, sdist = _one(dist, "*.whl"), _one(dist, "*.tar.gz")
    _run(sys.executable, "-m", "twine", "check", "--strict", wheel, sdist, timeout=300)
    import nbtools

    assert wheel.name.startswith(f"nbtools_train-{nbtools.__version__}-")
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("nbtools/monitor/_chart.js", "nbtools/monitor/_chart.css", "nbtools/py.typed"):
        assert needed in names, f"{needed} is missing from {wheel.name}"
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), sorted(names)[-10:]
    with tarfile.open(sdist) as tar:
        members = {m.name.split("/", 1)[1] for m in tar.getmembers() if "/" in m.name}
    assert {"LICENSE", "pyproject.toml", "nbtools/monitor/_chart.js"} <= members


def _site_packages_here() -> list[str]:
    """The site-packages directories of the interpreter running the tests, as it sees them:
    a virtual environment's own (and its base's only when it was made to inherit them)."""
    found = list(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        found.append(site.getusersitepackages())
    return [d for d in dict.fromkeys(found) if os.path.isdir(d)]


def _venv_inheriting_these_packages(env_dir: Path) -> Path:
    """A virtual environment whose interpreter sees this one's packages after its own.

    ``system_site_packages=True`` would give it the *base* interpreter's packages, which
    inside a virtual environment are not the ones the tests run with. A ``.pth`` file naming
    this interpreter's site-packages appends them to ``sys.path`` instead; their own ``.pth``
    files (this checkout's editable install among them) are not run, so ``nbtools`` can come
    only from what is installed into the new environment.
    """
    # Without a pip of its own: ensurepip's older setuptools would shadow the machine's.
    venv.EnvBuilder(system_site_packages=False, with_pip=False, symlinks=True).create(env_dir)
    purelib = sysconfig.get_path(
        "purelib", "posix_prefix", vars={"base": str(env_dir), "platbase": str(env_dir)}
    )
    Path(purelib, "_nbtools_tests_inherited.pth").write_text(
        "".join(f"{d}\n" for d in _site_packages_here())
    )
    return env_dir / "bin" / "python"


def test_the_installed_wheel_imports_finds_its_widget_and_runs_two_ranks(dist, tmp_path):
    env_dir = tmp_path / "venv"
    python = _venv_inheriting_these_packages(env_dir)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1")
    # --no-index: every dependency must already be met by the packages inherited.
    _run(
        sys.executable,
        "-m",
        "pip",
        "--python",
        python,
        "install",
        "--no-index",
        "--no-cache-dir",
        _one(dist, "*.whl"),
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    script = tmp_path / "smoke.py"
    script.write_text(SMOKE)
    proc = _run(python, script, env=env, cwd=tmp_path, timeout=300)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    site = Path(report["file"]).resolve()
    assert env_dir.resolve() in site.parents, f"nbtools came from {site}, not the wheel"
    assert report["js"] and report["css"] and report["typed"], report
    assert report["results"] == [3.0, 3.0], report
