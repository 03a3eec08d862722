"""Experiment names: MLFLOW_EXPERIMENT_NAME, then the notebook's path, then the directory."""

from __future__ import annotations

import pytest

from nbtools.tracking.naming import experiment_name, notebook_path


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path):
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    work = tmp_path / "my-project"
    work.mkdir()
    monkeypatch.chdir(work)


def test_environment_variable_wins(monkeypatch):
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "/Users/me/sweep")
    assert experiment_name({"__session__": "/home/me/train.ipynb"}) == "/Users/me/sweep"


def test_jupyterlab_session_gives_the_notebook_path():
    ns = {"__session__": "/home/me/project/train.ipynb"}
    assert notebook_path(ns) == "/home/me/project/train.ipynb"
    assert experiment_name(ns) == "/home/me/project/train"


def test_vscode_file_is_preferred_to_the_session():
    ns = {"__vsc_ipynb_file__": "/src/vs/eval.ipynb", "__session__": "/other/x.ipynb"}
    assert experiment_name(ns) == "/src/vs/eval"


def test_session_environment_variable_is_used_when_the_namespace_has_none(monkeypatch):
    monkeypatch.setenv("JPY_SESSION_NAME", "/srv/nb/finetune.ipynb")
    assert experiment_name({}) == "/srv/nb/finetune"


def test_console_sessions_and_plain_python_fall_back_to_the_directory(monkeypatch):
    # A JupyterLab console has a __session__ too, but it names no notebook file.
    monkeypatch.setenv("JPY_SESSION_NAME", "/srv/nb/console-1-3f2a")
    assert notebook_path({"__session__": "console-2-9a"}) is None
    assert experiment_name({"__session__": "console-2-9a"}) == "my-project"
    assert experiment_name({"__session__": ""}) == "my-project"
