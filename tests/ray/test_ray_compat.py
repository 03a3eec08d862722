"""One test per private Ray name nbtools uses, and none used outside the boundary module."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import nbtools

ROOT = Path(nbtools.__file__).parent


def test_session_dir_names_this_node_s_session_directory(ray_cluster):
    # Asked in this process, the cluster's driver on a node of its own (no task, no worker
    # to start); the rank actors ask it too (test_ray_launch.py's first test).
    from nbtools.launch._ray import _ray_compat as compat

    path = compat.session_dir()
    assert path is not None and os.path.isdir(path)
    assert "session" in os.path.basename(path)


def test_session_dir_without_ray_running_is_none():
    # In a process that is no Ray worker Ray has no node to ask: the fallback, not an error.
    # A process of its own: this one is the test cluster's driver once a Ray test ran here.
    code = (
        "import ray\n"
        "from nbtools.launch._ray import _ray_compat\n"
        "assert not ray.is_initialized()\n"
        "print(repr(_ray_compat.session_dir()))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "None"


def test_private_ray_names_only_in_the_boundary_module():
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        if path.name == "_ray_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ray."):
                if any(part.startswith("_") for part in node.module.split(".")):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            elif isinstance(node, ast.Import):
                offenders += [
                    f"{path.relative_to(ROOT)}:{node.lineno}"
                    for a in node.names
                    if a.name.startswith("ray.")
                    and any(p.startswith("_") for p in a.name.split("."))
                ]
            elif (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                inner = node.value
                while isinstance(inner, ast.Attribute):
                    inner = inner.value
                if isinstance(inner, ast.Name) and inner.id == "ray":
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == [], "private Ray names outside nbtools/launch/_ray/_ray_compat.py"
