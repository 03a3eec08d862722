"""What one check found, and the report of all of them (one screen, or one JSON object)."""

from __future__ import annotations

import dataclasses
import enum
import importlib.metadata
import json
import platform
from collections.abc import Sequence
from typing import Any

__all__ = [
    "NAME_WIDTH",
    "Finding",
    "Status",
    "exit_status",
    "finding_lines",
    "header",
    "to_json",
    "verdict",
    "versions",
]


class Status(str, enum.Enum):
    """How a check ended. Only :attr:`FAIL` stops training on this machine."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


@dataclasses.dataclass(frozen=True)
class Finding:
    """One check's outcome.

    Attributes:
        name: Short name of what was checked (``"shm"``, ``"smoke launch"``).
        status: :class:`Status`.
        summary: What was found, in one line.
        advice: What to do about it; empty when nothing is to be done.
        details: Figures behind the summary (JSON-serialisable).
    """

    name: str
    status: Status
    summary: str
    advice: str = ""
    details: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The finding as plain JSON types."""
        return {
            "name": self.name,
            "status": self.status.value,
            "summary": self.summary,
            "advice": self.advice,
            "details": self.details,
        }


def exit_status(findings: Sequence[Finding]) -> int:
    """0 when training can run here (warnings allowed), 1 when a check failed."""
    return 1 if any(f.status is Status.FAIL for f in findings) else 0


_MARKS = {Status.OK: "ok  ", Status.WARN: "WARN", Status.FAIL: "FAIL", Status.SKIP: "skip"}
#: Width of the name column: the longest check name ("smoke launch", "staging dir").
NAME_WIDTH = 12


def versions() -> dict[str, str | None]:
    """nbtools, Python and torch versions (torch's from its metadata: nothing is imported)."""
    from nbtools import __version__

    try:
        torch: str | None = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch = None
    return {"nbtools": __version__, "python": platform.python_version(), "torch": torch}


def header(found: dict[str, str | None] | None = None) -> str:
    """The report's first line: which nbtools, Python and torch are checked."""
    found = versions() if found is None else found
    torch = found["torch"] or "not installed"
    return f"nbtools {found['nbtools']} · Python {found['python']} · torch {torch}"


def finding_lines(finding: Finding, width: int = NAME_WIDTH) -> list[str]:
    """One check's line, and its advice under it when something is to be done."""
    lines = [f"[{_MARKS[finding.status]}] {finding.name:<{width}}  {finding.summary}"]
    if finding.advice and finding.status in (Status.WARN, Status.FAIL):
        lines.append(f"       {'':<{width}}  -> {finding.advice}")
    return lines


def verdict(findings: Sequence[Finding]) -> str:
    """The last line: whether training can run here, and what failed."""
    failed = [f.name for f in findings if f.status is Status.FAIL]
    warned = sum(f.status is Status.WARN for f in findings)
    if failed:
        return f"Training cannot run here: {', '.join(failed)} failed (exit status 1)."
    return f"Training can run here ({warned} warning{'s' * (warned != 1)})."


def to_json(findings: Sequence[Finding]) -> str:
    """One JSON object: ``ok``, ``exit_status``, the ``versions`` and the ``checks`` in order."""
    status = exit_status(findings)
    return json.dumps(
        {
            "ok": status == 0,
            "exit_status": status,
            "versions": versions(),
            "checks": [f.to_dict() for f in findings],
        }
    )
