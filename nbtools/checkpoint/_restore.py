"""One restore policy over the checkpoint tiers: the newest step, from the fastest tier holding it.

A tier is a place that holds the run's state: node-local shared memory
(``_memory``: each rank's snapshots, and the replicas its peers hold) and the
volume (``_volume_tier``: the checkpoints under the root). Each implements
:class:`Tier`. :class:`Restorer` asks them fastest first:

1. the tier **offers** the newest step every rank can get from it (agreed by
   the ranks, its bytes fetched and checked), unless the tier below it holds a
   newer one (the tier below's :meth:`Tier.newest`, which the tier consults only
   when its own records cannot tell);
2. the first tier with an offer **loads** it into the objects; a tier without an
   offer, or whose load fails on some rank, has said why in one line, and the
   next tier is asked;
3. every tier above the one that loaded learns the newest step on the volume
   (:meth:`Tier.note_volume`), and the restore is reported once (log and
   ``checkpoint_restored`` event).

The answer is one :class:`Restored`, whatever tier gave it.

A third tier (node-local disk, a peer's memory over the network) is one more
implementation of :class:`Tier`, in a module or sub-room of its own beside
``_volume_tier`` and ``_memory``, placed in the list of tiers the manager makes
(``CheckpointManager.__init__``) between memory and the volume, fastest first:
nothing in this module changes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import torch.distributed as dist

from nbtools import events, runtime
from nbtools.checkpoint import _objects

__all__ = ["Known", "Newest", "Offer", "Restored", "Restorer", "Tier"]


class Offer(NamedTuple):
    """What a tier can load on every rank.

    Attributes:
        tier: The tier's name (``"memory"``, ``"volume"``).
        step: The step every rank gets from it; None: the newest one that
            verifies, found as the tier loads (the volume).
        volume: The newest complete step on the volume, when the tier learned it
            while making the offer (None otherwise, or when the volume holds none).
        held: What the tier keeps to load the offer (the memory tier: the slots
            it fetched and checked).
    """

    tier: str
    step: int | None
    volume: int | None = None
    held: Any = None


@dataclass
class Restored:
    """What a restore loaded into the objects.

    Attributes:
        step: The step restored; None when no tier holds one.
        tier: Where this rank's state came from: ``"memory"`` (its own snapshot),
            ``"replica"`` (a peer's copy of it) or ``"volume"``; None with no step.
        blob: This rank's per-rank state (RNG streams, stateful objects,
            ``extra``, ``mlflow_run_id``).
        skipped: ``(url, reason)`` of each newer checkpoint passed over because
            its data did not verify.
        mlflow_run_id: The MLflow run id recorded with the step, or None.
        saved_step: The newest complete checkpoint on the volume, which the next
            save follows (the step itself for a restore from the volume).
        where: What was restored, for the report (a checkpoint's URL, a step from memory).
        from_replicas: Whether some rank's state came from a peer's replica (the
            report's tier is then ``"replica"``).
    """

    step: int | None = None
    tier: str | None = None
    blob: dict[str, Any] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    mlflow_run_id: str | None = None
    saved_step: int | None = None
    where: str = ""
    from_replicas: bool = False


class Newest(Protocol):
    """A tier's newest step, looked up once: :meth:`start` may begin the lookup in the
    background; calling it is a collective that gives every rank the same answer. Used
    as a context manager, leaving joins a lookup in progress."""

    def start(self) -> None: ...

    def __call__(self) -> int | None: ...

    def __enter__(self) -> Newest: ...

    def __exit__(self, *exc: object) -> None: ...


class Known:
    """A :class:`Newest` computed when first asked (by ``look``, a collective), or a
    value known beforehand (below the last tier there is nothing: ``Known()``)."""

    def __init__(self, look: Callable[[], int | None] | None = None) -> None:
        self._look = look
        self._value: int | None = None

    def start(self) -> None:
        """Nothing to begin: the lookup is made when the value is asked for."""

    def __call__(self) -> int | None:
        if self._look is not None:
            self._value, self._look = self._look(), None
        return self._value

    def __enter__(self) -> Known:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


class Tier(Protocol):
    """A place that holds checkpoints of the run's state (see the module docstring).

    ``offers``, ``load`` and ``newest``'s answer are collectives over ``pg``:
    every rank calls them, in the same order.
    """

    name: str

    def offers(self, pg: dist.ProcessGroup | None, below: Newest) -> Offer | None:
        """The step every rank can load from this tier, when ``below`` (the next
        tier's newest step) is not newer; None (after one line saying why) to fall back."""
        ...

    def load(
        self,
        pg: dist.ProcessGroup | None,
        offer: Offer,
        kinds: _objects.Objects,
        planner: Any,
    ) -> Restored | None:
        """Put ``offer`` into the objects on every rank; None when some rank failed (said
        why, the objects unchanged) and the next tier is to be asked."""
        ...

    def newest(self, pg: dist.ProcessGroup | None) -> Newest:
        """This tier's newest step, for the tier above it."""
        ...

    def note_volume(self, step: int | None) -> None:
        """The volume holds no checkpoint of this job newer than ``step``."""
        ...

    def snapshot(
        self, step: int, objs: dict[str, Any], extra: dict[str, Any] | None, run_id: str | None
    ) -> bool:
        """Keep ``objs``' state of ``step`` (with ``extra`` and the MLflow run ``run_id``)
        in this tier; whether a snapshot was started."""
        ...

    def close(self, keep: bool) -> None:
        """Release what the tier holds for this manager (``keep``: after an error)."""
        ...


class Restorer:
    """Restores from the fastest tier that holds the newest step (see the module docstring).

    Args:
        tiers: The tiers, fastest first; the last one (the volume) answers always.
        pg: The process group of the ranks (None: one process).
    """

    def __init__(self, tiers: Sequence[Tier], pg: dist.ProcessGroup | None) -> None:
        self.tiers = list(tiers)
        self.pg = pg

    def restore(self, kinds: _objects.Objects, planner: Any = None) -> Restored:
        """Load the newest step any tier can give every rank into ``kinds``' objects; a
        :class:`Restored` whose ``step`` is None when there is none."""
        started = time.perf_counter()
        restored = Restored()
        for i, tier in enumerate(self.tiers):
            below = self.tiers[i + 1].newest(self.pg) if i + 1 < len(self.tiers) else Known()
            with below:
                offer = tier.offers(self.pg, below)
                got = tier.load(self.pg, offer, kinds, planner) if offer is not None else None
            if got is not None:
                restored = got
                tier.note_volume(restored.saved_step)
                break
        for tier in self.tiers[:i]:  # those that fell back: nothing newer is on the volume
            tier.note_volume(restored.saved_step)
        if restored.step is not None and runtime.get_rank() == 0:
            events.emit(
                "checkpoint_restored",
                message=f"restored {restored.where}",
                step=restored.step,
                seconds=round(time.perf_counter() - started, 4),
                tier="replica" if restored.from_replicas else restored.tier,
            )
        return restored
