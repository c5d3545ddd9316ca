"""Fair sharing of the one engine thread between its consumers (each training model, and sampling).

Start-time fair queueing: every consumer's virtual time grows by the engine seconds it used, and the
ready consumer with the least virtual time runs next. A consumer that was idle restarts at the virtual
time being served, so idleness earns no credit to flood with later. A training step of 1 s therefore
alternates with ~1 s of decode steps, whatever the queue lengths on either side.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


class FairShare:
    def __init__(self) -> None:
        self._virtual: dict[Hashable, float] = {}
        self._now = 0.0

    def pick(self, ready: Sequence[Hashable]) -> Hashable:
        """The ready consumer to run next (the first of equals, so pass them in round-robin order)."""
        for name in ready:
            self._virtual[name] = max(self._virtual.get(name, self._now), self._now)
        chosen = min(ready, key=self._virtual.__getitem__)
        self._now = self._virtual[chosen]
        return chosen

    def charge(self, name: Hashable, seconds: float) -> None:
        self._virtual[name] = self._virtual.get(name, self._now) + seconds

    def forget(self, name: Hashable) -> None:
        self._virtual.pop(name, None)
