"""The model every store is held to in the parity tests: the pure decision (`decide`) over
dicts that keep every value and id forever (ended windows are never read again, so keeping them
changes nothing)."""

from __future__ import annotations

from collections.abc import Sequence

from sidecar.algorithms import hyperloglog
from sidecar.algorithms.decide import Address, State, decide
from sidecar.model import Dedupe, Hit, Outcome
from sidecar.storage.base import Applied


class Model:
    """What every backend must answer: `apply` and `record` over the pure decision."""

    def __init__(self) -> None:
        self.values: dict[Address, State | hyperloglog.Registers] = {}
        self.ids: dict[bytes, set[str]] = {}

    def apply(self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, done: Applied) -> None:
        done(self._decide(hits, all_or_nothing, now_ms, force=False))

    async def record(
        self, batches: Sequence[tuple[Sequence[Hit], Dedupe]], now_ms: int
    ) -> list[list[bool]]:
        answers = []
        for hits, dedupe in batches:
            current = self.ids.setdefault(dedupe.current, set())
            previous = self.ids.get(dedupe.previous, set())
            duplicates = []
            for identifier in dedupe.ids:
                seen = identifier in current or identifier in previous
                duplicates.append(seen)
                if not seen:
                    current.add(identifier)
            fresh = [hit for hit in hits if not duplicates[hit.group]]
            self._decide(fresh, False, now_ms, force=True)
            answers.append(duplicates)
        return answers

    def force(self, hits: Sequence[Hit], now_ms: int) -> None:
        """Apply `hits` whatever the limits say (as `record` does, without its ids)."""
        self._decide(hits, False, now_ms, force=True)

    def _decide(
        self, hits: Sequence[Hit], all_or_nothing: bool, now_ms: int, force: bool
    ) -> list[Outcome]:
        outcomes, writes = decide(self.values.get, hits, now_ms, all_or_nothing, force=force)
        for write in writes:
            if write.member:
                registers = self.values.get(write.address, hyperloglog.new())
                self.values[write.address], _ = hyperloglog.add(registers, write.member)  # type: ignore[arg-type]
            elif write.state is not None:
                self.values[write.address] = write.state
            else:
                count = self.values.get(write.address, 0)
                assert isinstance(count, int)
                if write.amount < 0 and count + write.amount <= 0:
                    # A refund took it to 0: no counter, as every store keeps it.
                    self.values.pop(write.address, None)
                else:
                    self.values[write.address] = count + write.amount
        return outcomes
