"""The suite leaves the checkout as it found it (loaded by the project's root ``conftest.py``).

The controlling pytest process (not an xdist worker) notes the checkout's state when the
session starts, and compares it when the session ends: a file that the tests created,
changed or removed in the checkout fails the session, naming the files. What git ignores
does not count (caches, builds, the notebooks' MLflow stores), and neither does what was
already uncommitted before the session, unless the session changed it again. Outside a
git checkout (an unpacked sdist) or without git, there is nothing to compare and nothing
is checked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

__all__ = ["CheckoutGuard", "CheckoutState", "changes", "snapshot"]

#: One entry per path git reports: its status letters and, for a file, (size, mtime_ns).
CheckoutState = dict[str, tuple[str, tuple[int, int] | None]]


def snapshot(root: str) -> CheckoutState | None:
    """The checkout's uncommitted, not-ignored paths with their sizes and times.

    Returns None when ``root`` is not in a git work tree or git is missing.
    """
    git = shutil.which("git")
    if git is None:
        return None
    try:
        proc = subprocess.run(
            [git, "status", "--porcelain=v1", "-z", "--untracked-files=all", "--ignore-submodules"],
            cwd=root,
            capture_output=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    state: CheckoutState = {}
    entries = proc.stdout.decode("utf-8", "surrogateescape").split("\0")
    i = 0
    while i < len(entries):
        entry = entries[i]
        i += 1
        if len(entry) < 4:
            continue
        code, path = entry[:2], entry[3:]
        if "R" in code or "C" in code:
            i += 1  # a rename's second field is its old path
        try:
            st = os.lstat(os.path.join(root, path))
            stamp: tuple[int, int] | None = (st.st_size, st.st_mtime_ns)
        except OSError:
            stamp = None
        state[path] = (code, stamp)
    return state


def changes(before: CheckoutState, after: CheckoutState) -> list[str]:
    """The paths whose state differs, each with what git now says of it."""
    out = []
    for path in sorted(set(before) | set(after)):
        if before.get(path) != after.get(path):
            code = after[path][0].strip() if path in after else "restored"
            out.append(f"{code or '?'} {path}")
    return out


class CheckoutGuard:
    """pytest plugin: note the checkout when the session starts, compare when it ends."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.before: CheckoutState | None = None

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        # Only the controlling process compares: xdist workers share its checkout.
        if not os.environ.get("PYTEST_XDIST_WORKER"):
            self.before = snapshot(self.root)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if self.before is None or os.environ.get("PYTEST_XDIST_WORKER"):
            return
        after = snapshot(self.root)
        if after is None:
            return
        changed = changes(self.before, after)
        if changed:
            session.exitstatus = 1
            sys.stderr.write(
                "\nLEAK: the test session left files in the checkout (tests write only under "
                "temporary directories):\n  " + "\n  ".join(changed) + "\n"
            )
