"""The rows being decoded and every per-slot component, kept in step.

Live rows sit in slots 0..n-1. Admitting rows, and retiring a finished row (the last live row moves
into its slot), must happen to the target's cache, the drafter and the controller alike: a component
that misses one move decodes another row's state. This class is the only place that does either.
"""
from __future__ import annotations

from workers.engine.cached_lm import CachedLM
from workers.engine.controller import Controller
from workers.engine.drafter import Drafter, Row


class LiveBatch:
    def __init__(self, target: CachedLM, drafter: Drafter, controller: Controller):
        self.target, self.drafter, self.controller = target, drafter, controller
        self.indexes: list[int] = []   # per slot: the request's index in the generate() call
        self.rows: list[Row] = []

    def __len__(self) -> int:
        return len(self.rows)

    def admit(self, admitted: list[tuple[int, Row]]) -> None:
        """Prefill the new rows into the next free slots. Rows that share a prompt prefix with a cached row
        copy it (prefix_sharing), unless the drafter reads every prompt state; otherwise shortest first
        (prefill groups neighbours by length)."""
        start = len(self.rows)
        if self.drafter.reads_prompt_states:
            admitted, plan = sorted(admitted, key=lambda item: len(item[1].tokens)), None
        else:
            plan = self.target.plan([row.tokens for _, row in admitted], start)
            admitted = [admitted[i] for i in plan.order]
        rows = [row for _, row in admitted]
        hidden = self.target.prefill([r.tokens for r in rows], start, plan)
        self.drafter.admit(rows, start, hidden)
        self.controller.admit(start, len(rows))
        self.indexes.extend(index for index, _ in admitted)
        self.rows.extend(rows)

    def retire(self, slots: list[int]) -> None:
        """Remove finished rows; the last live row fills each freed slot."""
        for slot in sorted(slots, reverse=True):
            self.drafter.retire(self.rows[slot])
            last = len(self.rows) - 1
            if slot != last:
                for part in (self.target, self.drafter, self.controller):
                    part.move(last, slot)
                self.rows[slot], self.indexes[slot] = self.rows[last], self.indexes[last]
            self.rows.pop()
            self.indexes.pop()
