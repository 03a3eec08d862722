"""What one check found, and the report of all of them (one screen, or one JSON object)."""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Sequence
from typing import Any

__all__ = ["Finding", "Status", "exit_status", "to_json", "to_text"]


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


def to_text(findings: Sequence[Finding]) -> str:
    """One line per check, then the advice of each problem under it."""
    width = max((len(f.name) for f in findings), default=0)
    lines = []
    for finding in findings:
        lines.append(f"[{_MARKS[finding.status]}] {finding.name:<{width}}  {finding.summary}")
        if finding.advice and finding.status in (Status.WARN, Status.FAIL):
            lines.append(f"       {'':<{width}}  -> {finding.advice}")
    failed = [f.name for f in findings if f.status is Status.FAIL]
    warned = sum(f.status is Status.WARN for f in findings)
    if failed:
        lines.append(f"\nTraining cannot run here: {', '.join(failed)} failed (exit status 1).")
    else:
        lines.append(f"\nTraining can run here ({warned} warning{'s' * (warned != 1)}).")
    return "\n".join(lines)


def to_json(findings: Sequence[Finding]) -> str:
    """One JSON object: ``ok``, ``exit_status`` and the ``checks`` in order."""
    status = exit_status(findings)
    return json.dumps(
        {"ok": status == 0, "exit_status": status, "checks": [f.to_dict() for f in findings]}
    )
