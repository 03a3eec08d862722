"""How a stream keeps a complete cached file it serves from eviction: its guard.

A file ahead of the consumer or handed out is protected either by a pin of
its own (``_pins``) or by the cache's gate while no eviction is wanted
(``_gate``); under the gate, a handed-out file's guard may be its bare path.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Optional

from nbtools.data._cache._pins import Pin, pin_path

__all__ = ["Guard", "State", "drop", "settled", "to_pin"]


@dataclass(frozen=True, slots=True)
class Guard:
    """How a complete cached file of a stream is kept from eviction.

    ``pin`` is the file's own pin, or None while the cache's gate protects it
    (nothing evicts then). A file that is not protected at all (a copy ahead
    that gave up) has no guard: the consumer fetches it itself.
    """

    path: str
    pin: Pin | None = None

    @classmethod
    def pinned(cls, pin: Pin) -> Guard:
        """The guard of a pinned file."""
        return cls(pin.path, pin)

    def release(self) -> None:
        """Let the file be evicted again, as far as this guard goes (idempotent)."""
        if self.pin is not None:
            self.pin.release()

    def to_pin(self) -> Guard | None:
        """This guard with a pin of its own (None when the file is gone meanwhile)."""
        if self.pin is not None:
            return self
        pin = pin_path(self.path)
        return None if pin is None else Guard(self.path, pin)


#: A file ahead of the consumer: its copy in flight, its guard, or None (not protected).
State = Optional[Future | Guard]


def drop(guard: Guard | str | None) -> None:
    """Release ``guard`` (nothing for a bare path under the gate, or None)."""
    if isinstance(guard, Guard):
        guard.release()


def to_pin(guard: Guard | str) -> Guard | None:
    """``guard`` with a pin of its own (None when the file is gone meanwhile)."""
    if isinstance(guard, Guard):
        return guard.to_pin()
    pin = pin_path(guard)
    return None if pin is None else Guard(guard, pin)


def _as_guard(pin: Pin | None) -> Guard | None:
    return None if pin is None else Guard(pin.path, pin)


def settled(state: State) -> Guard | None:
    """The guard of a finished copy (None for one that failed, was cancelled or runs on)."""
    if not isinstance(state, Future):
        return state
    if state.done() and not state.cancelled() and state.exception() is None:
        return _as_guard(state.result())
    return None
