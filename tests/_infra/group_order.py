"""The longest groups first, so that two workers finish together (loaded by the root ``conftest.py``).

With ``-n N`` the session runs under ``--dist loadgroup``: each test file, and all that uses the
Ray cluster, is one group, run whole by one worker, and a worker takes the next group when it is
nearly done with its last. Handed out in collection order, a long group that comes late (the Ray
tests, a notebook) runs alone at the end while the other worker waits. Handed out longest first,
the short groups fill in around the long ones.

How long a group takes is the sum of its tests' seconds in the last run that ran each (under
xdist, with the ids ``loadgroup`` gives them), kept in pytest's cache (``.pytest_cache``,
ignored by git). A fresh clone (CI) has no cache: there a test takes its share of its group's
seconds in ``group_seconds.json`` beside this file (committed; a group is named by its file's
basename, unique across ``tests/``, so that moving a file keeps its figure; refresh it with
``python tests/_infra/group_order.py`` after a run of the whole suite). A test of a group neither
knows is estimated from its lane marks (a test in a Ray cluster, a Jupyter kernel, a
multi-process run or marked slow costs more than a unit test). The order only decides which
worker runs what, and when: tests must not depend on it, and nothing else changes with it.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

import pytest

__all__ = ["CACHE_KEY", "GroupOrder", "TABLE", "estimate", "group_of", "group_seconds", "table_key"]

#: Where pytest's cache keeps each group's seconds (setup, call and teardown of its tests).
CACHE_KEY = "nbtools/group-seconds"
#: Seconds a test is estimated to take by its lane marks (the first that applies), for a test
#: no run has timed yet: about the mean of such tests over a run of the whole suite on two cores.
_NOTEBOOK_SECONDS = 50.0
_MARK_SECONDS = (
    ("cluster", 25.0),
    ("kernel", 12.0),
    ("integration", 10.0),
    ("slow", 7.0),
)
_UNMARKED_SECONDS = 0.3
#: Each group's seconds in a run of the whole suite (``python tests/_infra/group_order.py``).
TABLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "group_seconds.json")


def table_key(group: str) -> str:
    """A group's name in :data:`TABLE`: its file's basename (``ray`` stays ``ray``)."""
    return os.path.basename(group)


def group_seconds(path: str = TABLE) -> dict[str, float]:
    """The committed seconds of each group by :func:`table_key`; empty where there is no table."""
    try:
        with open(path, encoding="utf-8") as fh:
            table = json.load(fh)
    except (OSError, ValueError):
        return {}
    return {str(k): float(v) for k, v in table.items()} if isinstance(table, dict) else {}


def group_of(item: pytest.Item) -> str:
    """The xdist group the item runs in, as ``--dist loadgroup`` names it, else its file."""
    names = sorted(
        {
            str(m.args[0] if m.args else m.kwargs.get("name", "default"))
            for m in item.iter_markers("xdist_group")
        }
    )
    return "_".join(names) if names else item.nodeid.split("::", 1)[0]


def estimate(item: pytest.Item) -> float:
    """Seconds the item is expected to take: a whole notebook (``--nbmake``), else by its lane
    marks."""
    if item.nodeid.split("::", 1)[0].endswith(".ipynb"):
        return _NOTEBOOK_SECONDS
    for mark, seconds in _MARK_SECONDS:
        if item.get_closest_marker(mark) is not None:
            return seconds
    return _UNMARKED_SECONDS


class GroupOrder:
    """Orders the collected groups longest first and keeps how long each test took."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.timed: dict[str, float] = defaultdict(float)

    def _cached(self) -> dict[str, float]:
        cache = getattr(self.config, "cache", None)
        known = cache.get(CACHE_KEY, {}) if cache is not None else {}
        return known if isinstance(known, dict) else {}

    def _known(self) -> dict[str, float]:
        """Seconds per test id: the controller's read of the cache, which every worker gets
        (workers reading it themselves could see another session's write in between, and
        order their collections differently)."""
        workerinput = getattr(self.config, "workerinput", None)
        if workerinput is not None:
            return dict(workerinput.get(CACHE_KEY, {}))
        return self._cached()

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node) -> None:  # xdist's WorkerController
        """Hand each xdist worker the seconds the controller read."""
        node.workerinput[CACHE_KEY] = self._cached()

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(
        self, config: pytest.Config, items: list[pytest.Item]
    ) -> None:
        """In an xdist worker of a ``loadgroup`` session, stable-sort the items by their
        group's expected seconds, longest first (a session without xdist keeps file order)."""
        if not getattr(config.option, "loadgroup", False):
            return
        known = self._known()
        table = group_seconds()
        cost: dict[str, float] = defaultdict(float)
        groups = [group_of(item) for item in items]
        sizes: dict[str, int] = defaultdict(int)
        for group in groups:
            sizes[group] += 1
        for item, group in zip(items, groups, strict=True):
            if item.nodeid in known:
                cost[group] += float(known[item.nodeid])
            elif table_key(group) in table:
                cost[group] += table[table_key(group)] / sizes[group]
            else:
                cost[group] += estimate(item)
        first = {g: i for i, g in reversed(list(enumerate(groups)))}
        order = sorted(range(len(items)), key=lambda i: (-cost[groups[i]], first[groups[i]], i))
        items[:] = [items[i] for i in order]

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """In the controller of a ``loadgroup`` session, add up each test's seconds."""
        if getattr(self.config, "workerinput", None) is not None:
            return
        if getattr(self.config.option, "dist", "no") != "loadgroup":
            return
        self.timed[report.nodeid] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        """Keep the seconds of the tests this run timed, beside those of earlier runs."""
        cache = getattr(self.config, "cache", None)
        if cache is None or not self.timed:
            return
        known = self._cached()
        known.update({test: round(s, 2) for test, s in self.timed.items()})
        cache.set(CACHE_KEY, known)


def _write_table(cache_file: str, path: str = TABLE) -> dict[str, float]:
    """Sum the cached seconds (``nodeid@group``) per group into :data:`TABLE`."""
    with open(cache_file, encoding="utf-8") as fh:
        cached = json.load(fh)
    # A file that moved is in the cache under both paths: each test counts once, by its
    # file's basename and its name.
    tests: dict[tuple[str, str], float] = {}
    for test, seconds in cached.items():
        nodeid, _, group = test.rpartition("@")
        file, _, name = nodeid.partition("::")
        key = (table_key(group or file), f"{os.path.basename(file)}::{name}")
        tests[key] = max(tests.get(key, 0.0), float(seconds))
    table: dict[str, float] = defaultdict(float)
    for (group, _), seconds in tests.items():
        table[group] += seconds
    out = {k: round(v, 1) for k, v in sorted(table.items())}
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(out, fh, indent=0, sort_keys=True)
        fh.write("\n")
    return out


if __name__ == "__main__":
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cache = os.path.join(root, ".pytest_cache", "v", *CACHE_KEY.split("/"))
    written = _write_table(sys.argv[1] if len(sys.argv) > 1 else cache)
    print(f"{len(written)} groups, {sum(written.values()):.0f} s in all, in {TABLE}")
