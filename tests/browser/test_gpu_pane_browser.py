"""The GPU pane in a real JupyterLab, in headless Chromium (Debian's), driven by Playwright.

Starts JupyterLab on loopback with a token in a temporary directory, runs a
notebook that shows ``GPUPane(backend=SimulatedBackend(num_gpus=4))``, checks
4 lines per panel and that Refresh moves the last-sample time, saves a
screenshot (to ``assets/gpu_pane.png`` when ``NBTOOLS_UPDATE_ASSETS=1``, else to
the test's temporary directory), and stops JupyterLab and the browser.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

CHROMIUM = "/usr/bin/chromium"
ASSET = Path(__file__).resolve().parents[2] / "assets" / "gpu_pane.png"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not os.access(CHROMIUM, os.X_OK), reason=f"needs Debian's chromium at {CHROMIUM}"),
    pytest.mark.skipif(importlib.util.find_spec("playwright") is None, reason="needs playwright"),
    pytest.mark.skipif(importlib.util.find_spec("jupyterlab") is None, reason="needs jupyterlab"),
    pytest.mark.skipif(importlib.util.find_spec("anywidget") is None, reason="needs anywidget"),
]

NOTEBOOK = {
    "nbformat": 4,
    "nbformat_minor": 5,
    "metadata": {
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
    },
    "cells": [
        {
            "cell_type": "code", "id": "pane", "metadata": {}, "outputs": [], "execution_count": None,
            "source": "from nbtools.monitor import GPUPane, SimulatedBackend\n"
                      "pane = GPUPane(interval=0.5, backend=SimulatedBackend(num_gpus=4, speed=90))",
        }
    ],
}


def _free_port() -> int:
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


def test_pane_renders_and_refreshes_in_jupyterlab(tmp_path):
    from playwright.sync_api import sync_playwright

    shot = ASSET if os.environ.get("NBTOOLS_UPDATE_ASSETS") == "1" else tmp_path / "gpu_pane.png"
    root = tmp_path / "root"
    root.mkdir()
    (root / "pane.ipynb").write_text(json.dumps(NOTEBOOK))
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ)
    env.update(
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
        IPYTHONDIR=str(tmp_path / "ipython"),
        JUPYTER_PLATFORM_DIRS="1",
        PYTHONUNBUFFERED="1",
    )
    log = open(tmp_path / "lab.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "jupyterlab", "--no-browser",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
            f"--LabApp.workspaces_dir={tmp_path / 'workspaces'}",
            "--LabApp.expose_app_in_browser=True", "--LabServerApp.open_browser=False",
            "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            "--ServerApp.terminals_enabled=False",
            *(["--allow-root"] if os.geteuid() == 0 else []),
        ],
        cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(f"{base}/api/status?token={token}", proc, time.monotonic() + 60, tmp_path / "lab.log")
        with sync_playwright() as pw:
            browser = pw.chromium.launch(
                executable_path=CHROMIUM,
                args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking"],
            )
            try:
                page = browser.new_page(viewport={"width": 1100, "height": 1000})
                page.goto(f"{base}/lab/tree/pane.ipynb?token={token}")
                page.wait_for_function(
                    "() => window.jupyterapp && document.querySelector('.jp-Notebook')"
                    " && window.jupyterapp.shell.currentWidget"
                    " && window.jupyterapp.shell.currentWidget.sessionContext"
                    " && window.jupyterapp.shell.currentWidget.sessionContext.session"
                    " && window.jupyterapp.shell.currentWidget.sessionContext.session.kernel",
                    timeout=60_000,
                )
                page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
                pane = page.locator(".nbtools-gpu")
                pane.wait_for(timeout=60_000)
                page.wait_for_function(
                    "() => document.querySelectorAll('.nbtools-gpu-plot .trace.scatter').length >= 12",
                    timeout=30_000,
                )
                # Lines actually drawn (an SVG path per trace) in each of the three panels.
                per_panel = page.evaluate(
                    "() => Array.from(document.querySelectorAll("
                    "'.nbtools-gpu-plot .cartesianlayer > .subplot')).map((s) => "
                    "s.querySelectorAll('.trace.scatter path.js-line').length)"
                )
                assert per_panel == [4, 4, 4], f"lines per panel: {per_panel}"
                assert "SIMULATED" in page.locator(".nbtools-gpu-source").inner_text()
                status = page.locator(".nbtools-gpu-status")
                assert "polling" in status.inner_text() and "simulated" in status.inner_text()
                # Let a few polls arrive through extendTraces, then keep a picture.
                page.wait_for_function(
                    "() => document.querySelector('.nbtools-gpu-plot').data[0].x.length >= 16",
                    timeout=30_000,
                )
                shot.parent.mkdir(parents=True, exist_ok=True)
                page.locator(".jp-OutputArea-output", has=pane).screenshot(path=str(shot))

                # Paused, only Refresh can move the last-sample time.
                page.locator(".widget-button", has_text="Pause").click()
                page.wait_for_function(
                    "() => document.querySelector('.nbtools-gpu-status').dataset.status === 'paused'",
                    timeout=30_000,
                )
                last = page.locator(".nbtools-gpu-last")
                before = last.get_attribute("data-time")
                assert before, "the pane shows no last-sample time"
                page.locator(".widget-button", has_text="Refresh").click()
                page.wait_for_function(
                    "(t) => document.querySelector('.nbtools-gpu-last').dataset.time !== t",
                    arg=before, timeout=30_000,
                )
                assert int(last.get_attribute("data-time")) > int(before)
                assert status.get_attribute("data-status") == "paused"
            finally:
                browser.close()
    finally:
        _stop(proc)
        log.close()
    assert shot.stat().st_size > 10_000
