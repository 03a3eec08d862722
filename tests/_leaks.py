"""Leak checks shared by the test session's ``no_leaks`` fixtures (the top level and Ray's)."""

from __future__ import annotations

import os
import sys
from collections.abc import Collection

__all__ = ["env_problems", "process_group_problems"]


def env_problems(before: dict[str, str], ignored: Collection[str]) -> list[str]:
    """Environment variables a test changed, restored; a problem line when there were any."""
    after = dict(os.environ)
    changed = sorted(
        k for k in set(before) | set(after) if k not in ignored and before.get(k) != after.get(k)
    )
    if not changed:
        return []
    os.environ.clear()
    os.environ.update(before)
    return ["environment variables changed: " + ", ".join(changed)]


def process_group_problems() -> list[str]:
    """A torch.distributed process group a test left initialised, destroyed; a problem line."""
    if "torch" not in sys.modules:
        return []
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        return ["a torch.distributed process group is still initialised"]
    return []
