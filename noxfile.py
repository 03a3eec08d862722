"""Developer sessions: ``nox -s tests-fast``, ``tests``, ``lint``, ``typecheck``, ``wheel``, ``docs``.

By default each session runs in the current environment (``pip install -e ".[test]"`` first),
since a fresh virtual environment per session would download torch each time. Pass
``--default-venv-backend venv`` to give each session its own, installed from this checkout.
"""

from __future__ import annotations

import nox

nox.options.default_venv_backend = "none"
nox.options.sessions = ["lint", "typecheck", "tests-fast"]

#: Unit tests only: no Jupyter kernel, Ray cluster, browser or multi-process integration run,
#: nothing marked slow (over about 5 s). Lane marks: the root conftest.py.
FAST = "not slow and not kernel and not cluster and not browser and not integration"


def _install(session: nox.Session, extra: str = "test") -> None:
    if session.venv_backend != "none":
        session.install("torch==2.13.0", "-e", f".[{extra}]")


@nox.session(name="tests-fast")
def tests_fast(session: nox.Session) -> None:
    """The fast lane: unit tests, about two minutes on two cores."""
    _install(session)
    session.run(
        "python", "-m", "pytest", "-n", "2", "-m", FAST, "--durations=25", "tests", *session.posargs
    )


@nox.session
def tests(session: nox.Session) -> None:
    """The full lane, as CI runs it: every test and every notebook."""
    _install(session)
    session.run(
        "python",
        "-m",
        "pytest",
        "-n",
        "2",
        "--nbmake",
        "--durations=25",
        "tests",
        "notebooks",
        *session.posargs,
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    _install(session)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy at the scope and baseline of pyproject.toml."""
    _install(session)
    session.run("python", "-m", "mypy")


@nox.session
def wheel(session: nox.Session) -> None:
    """Build the sdist and the wheel, twine check, install into a fresh venv, run two ranks."""
    _install(session)
    session.run(
        "python",
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "tests/test_packaging.py",
        *session.posargs,
    )


@nox.session
def docs(session: nox.Session) -> None:
    """Build the documentation site with warnings as errors (docs/_build/html)."""
    _install(session, "docs")
    session.run(
        "python",
        "-m",
        "sphinx",
        "-W",
        "--keep-going",
        "-b",
        "html",
        "docs",
        "docs/_build/html",
        *session.posargs,
    )
