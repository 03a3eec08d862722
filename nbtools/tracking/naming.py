"""Which MLflow experiment a notebook's runs belong to.

The name is, in order of preference:

1. ``MLFLOW_EXPERIMENT_NAME`` when set (MLflow's own convention);
2. the notebook's path without its suffix, when the front end tells the kernel
   where the notebook lives: JupyterLab and Notebook 7 through ``__session__``
   (set by ipykernel from ``JPY_SESSION_NAME``), VS Code through
   ``__vsc_ipynb_file__``;
3. the name of the working directory.

This module imports neither mlflow nor IPython; it only looks at an IPython
shell that is already running.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

__all__ = ["experiment_name", "notebook_path", "DEFAULT_EXPERIMENT_NAME"]

#: MLflow's name for the experiment that runs go to when nothing else is known.
DEFAULT_EXPERIMENT_NAME = "Default"

# Suffixes of files a Jupyter front end opens as notebooks (Jupytext pairs included).
# A console session also has a ``__session__``, but it names no file with one of these.
_NOTEBOOK_SUFFIXES = (".ipynb", ".py", ".md", ".qmd", ".Rmd")

# Where front ends put the notebook's path, most specific first.
_NAMESPACE_KEYS = ("__vsc_ipynb_file__", "__session__")


def _user_namespace() -> Mapping[str, Any]:
    """The running IPython shell's user namespace, or an empty mapping outside IPython."""
    ipython_mod = sys.modules.get("IPython")
    if ipython_mod is None:
        return {}
    shell = ipython_mod.get_ipython()
    if shell is None:
        return {}
    return getattr(shell, "user_ns", {}) or {}


def _as_notebook(value: Any) -> str | None:
    if not isinstance(value, str) or not value.strip():
        return None
    if not value.endswith(_NOTEBOOK_SUFFIXES):
        return None
    return value


def notebook_path(namespace: Mapping[str, Any] | None = None) -> str | None:
    """The path of the notebook this kernel runs, when the front end tells it.

    Args:
        namespace: Where to look for ``__vsc_ipynb_file__`` and ``__session__``;
            by default the running IPython shell's user namespace.

    Returns:
        The path as the front end gave it (usually absolute), or None when the
        kernel does not know its notebook (plain Python, ``nbclient``, a console).
    """
    ns = _user_namespace() if namespace is None else namespace
    for key in _NAMESPACE_KEYS:
        found = _as_notebook(ns.get(key))
        if found:
            return found
    return _as_notebook(os.environ.get("JPY_SESSION_NAME"))


def experiment_name(namespace: Mapping[str, Any] | None = None) -> str:
    """The MLflow experiment name for runs started here.

    Args:
        namespace: Where to look for the notebook's path (see :func:`notebook_path`).

    Returns:
        ``MLFLOW_EXPERIMENT_NAME``, else the notebook's path without its suffix
        (``/home/me/project/train`` for ``/home/me/project/train.ipynb``), else
        the working directory's name.

    Example:
        >>> import os
        >>> os.environ.get("MLFLOW_EXPERIMENT_NAME") or experiment_name({}) != ""
        True
    """
    from_env = os.environ.get("MLFLOW_EXPERIMENT_NAME", "").strip()
    if from_env:
        return from_env
    path = notebook_path(namespace)
    if path:
        pure = PurePath(path)
        return pure.with_suffix("").as_posix()
    return os.path.basename(os.path.abspath(os.getcwd())) or DEFAULT_EXPERIMENT_NAME
