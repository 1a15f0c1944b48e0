"""Which LoRA adapter each slot of the device's adapter pool holds (no JAX).

The scheduler admits a sequence with an adapter only when the adapter has a slot: the one it
already holds, or a slot no running sequence uses (an empty one first, else the least recently
used), which then loads it before the next step runs (`take_loads`). A slot is held while a
running sequence uses it; a preempted or finished sequence lets go, and so at most `max_loras`
adapters are in any one batch (vLLM's rule).
"""

import itertools


class LoraSlots:
    """The pool's slots 1..`num_slots` (0 is the base model's, never held)."""

    def __init__(self, num_slots: int):
        self.holder: list[str | None] = [None] * num_slots  # slot i + 1's adapter
        self.users = [0] * num_slots  # running sequences using slot i + 1
        self._last_used = [0] * num_slots
        self._clock = itertools.count(1)
        self._loads: list[tuple[int, str]] = []

    def can_take(self, adapter: str) -> bool:
        """Whether a sequence of `adapter` could be admitted now."""
        return adapter in self.holder or 0 in self.users

    def take(self, adapter: str) -> int:
        """A slot holding `adapter` for one more sequence (loading it into a free slot if it has
        none: an empty one, else the least recently used); call `can_take` first."""
        if adapter in self.holder:
            i = self.holder.index(adapter)
        else:
            free = [i for i, n in enumerate(self.users) if n == 0]
            i = min(free, key=lambda j: (self.holder[j] is not None, self._last_used[j]))
            self.holder[i] = adapter
            self._loads = [(s, a) for s, a in self._loads if s != i + 1] + [(i + 1, adapter)]
        self.users[i] += 1
        self._last_used[i] = next(self._clock)
        return i + 1

    def give_back(self, slot: int) -> None:
        """One sequence using `slot` stopped running (finished or preempted); 0: none held."""
        if slot:
            self.users[slot - 1] -= 1

    def take_loads(self) -> list[tuple[int, str]]:
        """The `(slot, adapter)` loads due before the next step, once each."""
        loads, self._loads = self._loads, []
        return loads

    def forget(self, adapter: str) -> bool:
        """Empties the slot holding `adapter` when no running sequence uses it (unloading an
        adapter); returns whether it was on the device and is gone (False: in use, or absent)."""
        if adapter not in self.holder:
            return False
        i = self.holder.index(adapter)
        if self.users[i]:
            return False
        self.holder[i] = None
        return True
