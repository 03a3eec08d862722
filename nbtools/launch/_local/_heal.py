"""The caller's side of healing in place: which deaths heal, the verdict, the line in the cell.

With ``@distributed(heal=True)`` (CPU ranks), a rank that dies without a word
(a signal, the OOM killer, ``os._exit``) no longer stops its peers.
:class:`Healer` decides, for :class:`~nbtools.launch._local._backend.LocalGroup`:

- whether the death heals (:meth:`Healer.why_not`): restarts left, no rank has
  returned yet, and the group had formed in its current generation (a
  replacement that dies while the group forms again, or a second rank that
  dies then, makes the group fail and restart whole, with one line saying why);
- the verdict every waiting rank reads (:mod:`nbtools.launch._rank._heal`):
  ``heal`` with the next generation and the attempt number, once the
  replacements have been started, or ``fail`` when every rank that has not
  returned waits and none died (the error was the user's own);
- the line in the cell once the healed group has restored (its rank 0's
  ``checkpoint_restored`` event), or once it has formed and ended without one,
  and the ``healed`` event on the pane's time axis.

Each heal counts as one restart against ``max_restarts``.

With a minimum (``min_processes``: :attr:`GroupSpec.min_world_size`) the group
may also shrink in place. A replacement must then say it has started (its
function unpickled, :func:`~nbtools.launch._rank.started_path`) before the
verdict is written; a slot whose replacement fails to start
:data:`FAILED_STARTS` times in a row is lost for good (:meth:`Healer.shrink`).
The survivors, numbered densely again, form a group of the remaining world
size in the next generation and run the function again in their processes (a
replaced rank of the same heal is started again under its new number); the
cell says so in one line and a ``shrunk`` event carries the world sizes, the
cause and the step. Fewer slots than the minimum end the call with an error
naming the lost slots. Lost slots stay lost for the rest of the call: a restart
of the whole group starts the smaller world.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from dataclasses import dataclass, field

from nbtools import events
from nbtools._internal.log import get_logger
from nbtools.errors import DistributedError
from nbtools.launch._backend import GroupSpec
from nbtools.launch._rank import (
    GENERATION_ENV,
    REPLACED_ENV,
    generation_formed_path,
    waiting_path,
    write_verdict,
)

__all__ = ["FAILED_STARTS", "START_WAIT_S", "Heal", "Healer", "live_blob_path", "live_note_path"]

_log = get_logger("launch")
# Deaths seen this close together are healed as one (two ranks killed at once).
_TOGETHER_S = 0.05
#: A slot whose replacement fails to start this many times in a row is lost for good.
FAILED_STARTS = 2
#: The longest a replacement may take to start (its function unpickled) in a group that may
#: shrink; longer counts as a failed start. Twice this stays under the ranks' verdict wait.
START_WAIT_S = 20.0


def live_note_path(run_dir: str, generation: int) -> str:
    """Where the healed group's rank 0 says which step the survivors held (``_live``)."""
    return os.path.join(run_dir, f"heal-live-g{generation}.json")


def live_blob_path(run_dir: str, rank: int) -> str:
    """Where rank ``rank`` keeps its latest per-rank state for a heal (``_live``)."""
    return os.path.join(run_dir, f"live-rank{rank}.pt")


@dataclass
class Heal:
    """One heal: the ranks replaced, how they died, and when it was seen."""

    ranks: list[int]
    how: dict[int, str]
    generation: int
    attempt: int
    seen: float  # time.time() when the death was seen
    kept: list[int] = field(default_factory=list)
    restores: bool = False  # the group restored a checkpoint before: it will again
    reported: bool = False
    #: Where the group shrank: ``{old rank: new rank}`` of the ranks that go on, the world
    #: sizes before and after, and the slots lost for good (numbered as first started).
    renumbered: dict[int, int] | None = None
    worlds: tuple[int, int] = (0, 0)
    lost: list[int] = field(default_factory=list)


class Healer:
    """Heals one group's dead ranks in place (see the module docstring)."""

    def __init__(self, spec: GroupSpec) -> None:
        self._spec = spec
        self.enabled = spec.heal and not spec.use_cuda
        self.generation = 0
        self.heals: list[Heal] = []
        self._started = time.time()
        #: The fewest ranks the group may go on with (None: it never shrinks).
        self.min_world = spec.min_world_size if self.enabled else None
        #: The slot (rank as first started) each rank of the group runs on now.
        self.slots = list(range(spec.world_size))
        #: The slots lost for good and not back yet (:mod:`._grow` tries them again).
        self.lost: list[int] = []
        #: Whether :meth:`report` says each heal (False: the caller says it in its own words).
        self.announce = True

    @property
    def spec(self) -> GroupSpec:
        """The group as it runs now (its world size after a shrink)."""
        return self._spec

    @property
    def elastic(self) -> bool:
        """Whether a slot lost for good makes the group go on with fewer ranks."""
        return self.min_world is not None and self.min_world < self._spec.world_size

    def failed_start(self, rank: int, tries: int, code: int | None) -> None:
        """Say that the replacement for rank ``rank``'s slot failed to start (try ``tries``)."""
        left = "its slot counts as lost" if tries >= FAILED_STARTS else "starting it again"
        _log.warning(
            "the replacement for slot %d failed to start (%s, try %d of %d); %s",
            self.slots[rank],
            _how(code) if code is not None else f"not started within {START_WAIT_S:.0f} s",
            tries,
            FAILED_STARTS,
            left,
        )

    def shrink(self, heal: Heal, lost: list[int]) -> dict[int, int]:
        """Go on without the ranks ``lost`` (their slots failed to start): ``{old: new}`` of
        the ranks that remain, numbered densely.

        Raises:
            DistributedError: fewer than the minimum would remain.
        """
        assert self.min_world is not None
        world = self._spec.world_size
        remaining = world - len(lost)
        slots = sorted(self.slots[r] for r in lost)
        if remaining < self.min_world:
            message = (
                f"{_slots(slots)} failed to start {_times()}: {remaining} of "
                f"{world} processes remain, under the minimum min_processes={self.min_world}. "
                f"Free what keeps the slot from starting, or allow fewer with a lower "
                f"min_processes"
            )
            events.emit("failure", message, slots=",".join(map(str, slots)))
            raise DistributedError(message)
        ranks = {old: new for new, old in enumerate(r for r in range(world) if r not in lost)}
        self.slots = [self.slots[old] for old in sorted(ranks)]
        self.lost += slots
        self._spec = dataclasses.replace(self._spec, world_size=remaining)
        heal.renumbered = ranks
        heal.worlds = (world, remaining)
        heal.lost = slots
        heal.ranks = [ranks[r] for r in heal.ranks if r in ranks]
        heal.kept = [ranks[r] for r in heal.kept]
        return ranks

    @property
    def count(self) -> int:
        """How many heals this group made (each one restart)."""
        return len(self.heals)

    def environment(self, replaced: list[int]) -> dict[str, str]:
        """What a replacement's environment adds: the generation, the ranks replaced."""
        return {
            GENERATION_ENV: str(self.generation),
            REPLACED_ENV: ",".join(str(r) for r in replaced),
            "TORCHELASTIC_RESTART_COUNT": str(self._attempt()),
        }

    def _attempt(self) -> int:
        return self._spec.restart_count + len(self.heals)

    @property
    def attempt(self) -> int:
        """The group's attempt number now (``TORCHELASTIC_RESTART_COUNT``)."""
        return self._attempt()

    def why_not(self, dead: list[int], returned: set[int]) -> str | None:
        """Why the death of ``dead`` cannot heal (one line), or None when it can."""
        left = self._spec.max_restarts - self._attempt()
        if left <= 0:
            return "no restart is left"
        if returned:
            return f"{_ranks(sorted(returned))} had already returned"
        ranks = range(self._spec.world_size)
        if all(r in dead for r in ranks):
            return "every rank died: no process is left to heal the group around"
        if not all(os.path.exists(self._formed(r)) for r in ranks if r not in dead):
            return (
                f"the group had not formed again since the last heal (generation {self.generation})"
            )
        return None

    def _formed(self, rank: int) -> str:
        return generation_formed_path(self._spec.attempt_dir, self.generation, rank)

    def together(self) -> None:
        """Let peers that die at the same moment be seen, so one heal replaces them all."""
        time.sleep(_TOGETHER_S)

    def begin(self, dead: list[int], codes: dict[int, int | None]) -> Heal:
        """Start a heal of ``dead``: the next generation (replacements start in it)."""
        self.generation += 1
        heal = Heal(
            ranks=sorted(dead),
            how={r: _how(codes.get(r)) for r in dead},
            generation=self.generation,
            attempt=self._spec.restart_count + len(self.heals) + 1,
            seen=time.time(),
            kept=[r for r in range(self._spec.world_size) if r not in dead],
            restores=self._manages(),
        )
        self.heals.append(heal)
        return heal

    def _manages(self) -> bool:
        """Whether the ranks' code saves through a ``CheckpointManager`` (its live tier leaves
        each rank's per-rank state in the launch's directory): the healed group will restore."""
        return any(name.startswith("live-rank") for name in os.listdir(self._spec.attempt_dir))

    def publish(self, heal: Heal, pids: list[int]) -> None:
        """Tell the waiting ranks to join generation ``heal.generation`` (replacements started;
        ``pids``: the processes of the ranks that kept theirs)."""
        verdict: dict = {
            "heal": True,
            "generation": heal.generation,
            "attempt": heal.attempt,
            "replaced": heal.ranks,
            "pids": pids,
        }
        if heal.renumbered is not None:
            verdict["world_size"] = heal.worlds[1]
            verdict["ranks"] = {str(old): new for old, new in heal.renumbered.items()}
        write_verdict(self._spec.attempt_dir, heal.generation - 1, verdict)
        if heal.renumbered is not None:
            return
        _log.info(
            "%s; healing in place: %s keep their processes (restart %d of %d)",
            _died(heal),
            _ranks(heal.kept),
            heal.attempt,
            self._spec.max_restarts,
        )

    def refuse_waiting(self, running: list[int]) -> bool:
        """When every rank in ``running`` waits for a verdict and none died: tell them to fail
        (the error was the user's); whether it did."""
        run_dir = self._spec.attempt_dir
        if not running or not all(
            os.path.exists(waiting_path(run_dir, self.generation, r)) for r in running
        ):
            return False
        write_verdict(run_dir, self.generation, {"heal": False})
        return True

    def refuse(self, why: str, dead: list[int]) -> None:
        """A death that does not heal: say why in one line (the group restarts whole)."""
        _log.warning("%s; not healed in place: %s", _ranks(dead) + " died", why)

    def report(self, final: bool = False) -> None:
        """Say each heal once its group restored (or formed and ended): one line, one event."""
        for heal in self.heals:
            if heal.reported:
                continue
            restored = events.log(since=heal.seen, kinds=["checkpoint_restored"])
            formed = all(
                os.path.exists(generation_formed_path(self._spec.attempt_dir, heal.generation, r))
                for r in range(self._spec.world_size)
            )
            later = heal is not self.heals[-1]
            if not restored and not (final or later or (formed and not heal.restores)):
                continue
            heal.reported = True
            if self.announce:
                self._say(heal, restored[0] if restored else None, formed)

    def _say(self, heal: Heal, restored: events.Event | None, formed: bool) -> None:
        if heal.renumbered is not None:
            self._say_shrunk(heal, restored)
            return
        took = (restored.time if restored is not None else time.time()) - heal.seen
        where = f"{_ranks(heal.kept)} kept their processes, {_ranks(heal.ranks)} replaced"
        fields: dict = {
            "rank": heal.ranks[0],
            "ranks": ",".join(str(r) for r in heal.ranks),
            "attempt": heal.attempt,
            "seconds": round(took, 3),
            "kept": ",".join(str(r) for r in heal.kept),
        }
        if restored is not None:
            note = self._live_note(heal.generation)
            live = note.get("live_step")
            tier = restored.fields.get("tier") if restored.fields else None
            step = restored.step
            again = max(0, live - step) if live is not None and step is not None else None
            text = f"resumed at step {(step or 0) + 1}"
            if again is not None:
                text += f", {again} step{'s' if again != 1 else ''} trained again"
            if tier != "live":
                text += f" (from {tier}: {note.get('why') or 'the survivors held no live state'})"
            fields.update(step=step, tier=tier, trained_again=again)
        elif formed:
            text = "the function runs again from its start"
        else:
            text = "the group did not form again"
        message = f"{_died(heal)}; healed in {took:.1f} s: {where}, {text}"
        _log.warning("%s", message)
        events.emit("healed", message, **fields)

    def grow(self, new: list[int], slots: list[int]) -> Heal:
        """Grow back: ranks ``new`` join on the lost ``slots`` in the next generation, the
        ranks that wait keep their processes and numbers (see :mod:`._grow`)."""
        world = self._spec.world_size
        target = world + len(new)
        self.generation += 1
        heal = Heal(
            ranks=list(new),
            how={},
            generation=self.generation,
            attempt=self._attempt() + 1,
            seen=time.time(),
            kept=list(range(world)),
            restores=True,
            renumbered={r: r for r in range(world)},
            worlds=(world, target),
            lost=list(slots),
        )
        self.heals.append(heal)
        self.slots += slots
        self.lost = [s for s in self.lost if s not in slots]
        self._spec = dataclasses.replace(self._spec, world_size=target)
        return heal

    def _say_shrunk(self, heal: Heal, restored: events.Event | None) -> None:
        """The line in the cell and the ``shrunk`` (or ``grew``) event of a group that went
        on with fewer ranks (or grew back)."""
        before, after = heal.worlds
        grew = after > before
        if grew:
            cause = f"{_slots(heal.lost)} started again"
            text = f"{cause}: grew from {before} to {after} processes"
        else:
            cause = f"{_died(heal)} and {_slots(heal.lost)} failed to start {_times()}"
            text = f"{cause}: continuing on {after} of {before} processes"
        step = restored.step if restored is not None else None
        tier = restored.fields.get("tier") if restored is not None and restored.fields else None
        if restored is not None:
            text += f" from step {(step or 0) + 1} ({tier})"
        else:
            text += ", the function runs again from its start"
        batch = self._live_note(heal.generation).get("batch")
        if isinstance(batch, str):
            text += f"; {batch}"
        _log.warning("%s", text)
        events.emit(
            "grew" if grew else "shrunk",
            text,
            from_world=before,
            to_world=after,
            cause=cause,
            slots=",".join(str(s) for s in heal.lost),
            step=step,
            tier=tier,
            attempt=heal.attempt,
            seconds=round((restored.time if restored is not None else time.time()) - heal.seen, 3),
        )

    def _live_note(self, generation: int) -> dict:
        try:
            with open(live_note_path(self._spec.attempt_dir, generation)) as fh:
                return dict(json.load(fh))
        except (OSError, ValueError):
            return {}


def _how(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    if code is not None:
        return f"exit code {code}"
    return "no exit code"


def _died(heal: Heal) -> str:
    parts = [f"rank {r} died ({heal.how[r]})" for r in sorted(heal.how)]
    return " and ".join(parts)


def _times() -> str:
    return "twice" if FAILED_STARTS == 2 else f"{FAILED_STARTS} times"


def _slots(slots: list[int]) -> str:
    if len(slots) == 1:
        return f"slot {slots[0]}"
    return "slots " + ", ".join(str(s) for s in slots[:-1]) + f" and {slots[-1]}"


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "no rank"
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    return "ranks " + ", ".join(str(r) for r in ranks[:-1]) + f" and {ranks[-1]}"
