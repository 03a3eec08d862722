"""A JupyterLab server on loopback and Debian's Chromium, for the pane's browser tests.

:func:`notebook` writes a notebook's cells; :func:`jupyterlab` starts the server in a temporary directory with a token and stops it with
its kernels; :func:`chromium` launches the headless browser; :func:`open_notebook` opens a
notebook, waits for its kernel and runs every cell.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"]
#: The marks of a test that drives JupyterLab in Chromium: skipped, saying why, without them.
MARKS = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(
        not os.access(CHROMIUM, os.X_OK), reason=f"needs Debian's chromium at {CHROMIUM}"
    ),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="needs playwright"),
    pytest.mark.skipif(importlib.util.find_spec("jupyterlab") is None, reason="needs jupyterlab"),
    pytest.mark.skipif(importlib.util.find_spec("anywidget") is None, reason="needs anywidget"),
]
# The notebook's kernel is up and the page's app is exposed (expose_app_in_browser).
KERNEL_READY = (
    "() => window.jupyterapp && document.querySelector('.jp-Notebook')"
    " && window.jupyterapp.shell.currentWidget"
    " && window.jupyterapp.shell.currentWidget.sessionContext"
    " && window.jupyterapp.shell.currentWidget.sessionContext.session"
    " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel"
)


def notebook(**cells: str) -> dict:
    """A Python notebook of code cells, each named by its id, in the order given."""
    return {
        "nbformat": 4,
        "nbformat_minor": 5,
        "metadata": {
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
            "language_info": {"name": "python"},
        },
        "cells": [
            {
                "cell_type": "code",
                "id": name,
                "metadata": {},
                "outputs": [],
                "execution_count": None,
                "source": source,
            }
            for name, source in cells.items()
        ],
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_ready(url: str, proc: subprocess.Popen, deadline: float, log: Path) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise AssertionError(f"JupyterLab exited early with code {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise AssertionError("JupyterLab did not answer in time")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the server shuts its kernels down on SIGTERM
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    # Kernels run in the server's process group; make sure none outlives it.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@contextlib.contextmanager
def jupyterlab(tmp_path: Path, root: Path) -> Iterator[tuple[str, str]]:
    """JupyterLab serving ``root``: yields ``(base URL, token)``; stopped with its kernels."""
    port, token = free_port(), secrets.token_hex(16)
    env = dict(os.environ)
    env.update(
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
        IPYTHONDIR=str(tmp_path / "ipython"),
        JUPYTER_PLATFORM_DIRS="1",
        PYTHONUNBUFFERED="1",
    )
    log_path = tmp_path / "lab.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyterlab",
                "--no-browser",
                "--ServerApp.ip=127.0.0.1",
                f"--ServerApp.port={port}",
                "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={token}",
                f"--ServerApp.root_dir={root}",
                f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
                "--LabApp.expose_app_in_browser=True",
                "--LabServerApp.open_browser=False",
                "--JupyterNotebookApp.expose_app_in_browser=True",
                "--LabApp.news_url=",
                "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
                "--ServerApp.terminals_enabled=False",
                *(["--allow-root"] if os.geteuid() == 0 else []),
            ],
            cwd=root,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(f"{base}/api/status?token={token}", proc, time.monotonic() + 60, log_path)
            yield base, token
        finally:
            _stop(proc)


@contextlib.contextmanager
def chromium() -> Iterator[Any]:
    """Debian's headless Chromium through Playwright: yields the browser."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


def open_notebook(browser: Any, url: str, console: list[str] | None = None) -> Any:
    """A page showing the notebook at ``url`` once its kernel is up, every cell run.

    Args:
        console: Where to collect the page's console messages, from its first on.
    """
    page = browser.new_page(viewport={"width": 1100, "height": 1000})
    if console is not None:
        page.on("console", lambda message: console.append(message.text))
    page.goto(url)
    page.wait_for_function(KERNEL_READY, timeout=60_000)
    page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
    return page
