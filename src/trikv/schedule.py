"""When a compression round is due: the one home of the slack trigger.

Each row of a batch follows its own schedule, exactly as if it were generated alone: a row is due when its
live entries (mean per layer and KV head) reach base + divide_length, base being that mean right after the
row's last round (the budget before any round; it differs from the budget only for policies that keep more
or fewer, e.g. PyramidKV's layers).

Rows share one physical length P (dead slots fill the gaps: left padding, rows compressed earlier), so the
schedule keeps an `excess` = the slots by which P runs ahead of the earliest-due row's live count. Then
"some row is due" is exactly `P - excess >= budget + divide_length`, checked per forward without a scan,
and `budget + divide_length + excess` is the capacity the next round needs.

The per-row state takes torch tensors or MLX arrays (`arrays.py`): the MLX cache runs this same schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .arrays import full_like, on_device_of, where


@dataclass
class RoundSchedule:
    budget: int | None  # None: never compress
    divide_length: int
    excess: int = 0  # physical slots ahead of the earliest-due row's live entries
    base: torch.Tensor | None = None  # [b] long: live entries right after each row's last round (None: budget)
    aligned: bool = True  # every row reaches its trigger at the same step (False: rows are due one after another)

    def reset(self) -> None:
        self.excess, self.base, self.aligned = 0, None, True

    def start(self, pad_lengths: torch.Tensor | None) -> None:
        """The first forward: left-padding slots are dead from the start, so no row can be due before the
        physical length passes the trigger by the smallest padding."""
        self.excess = 0 if pad_lengths is None else int(pad_lengths.min())
        self.aligned = pad_lengths is None or bool((pad_lengths == pad_lengths[0]).all())

    def due(self, length: int) -> bool:
        """Some row has reached its trigger (length = physical slots stored)."""
        return self.budget is not None and length - self.excess >= self.budget + self.divide_length

    def live_before_due(self, length: int) -> int:
        """Live entries of the earliest-due row (what `due` compares against budget + divide_length)."""
        return length - self.excess

    def steps_until_due(self, length: int) -> int:
        """Single-token forwards before the next round runs (0: due now)."""
        return max(0, self.budget + self.divide_length - (length - self.excess))

    def capacity(self) -> int:
        """Slots the buffers need for the next round (the allocation a bounded cache keeps)."""
        return self.budget + self.divide_length + self.excess

    def rows_due(self, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[b] bool rows due now, and [b] each row's base, from the rows' live entries [b]."""
        base = full_like(live, self.budget) if self.base is None else on_device_of(self.base, live)
        return live - base >= self.divide_length, base

    def after_round(self, due: torch.Tensor, base: torch.Tensor, live_after: torch.Tensor, new_length: int) -> None:
        """Record a round: due rows restart from their live entries after it; the excess follows the earliest
        next trigger."""
        self.base = where(due, live_after, base)
        until_due = self.base + self.divide_length - live_after  # [b] tokens before each row is due
        self.excess = new_length + int(until_due.min()) - (self.budget + self.divide_length)
        self.aligned = bool((until_due == until_due[0]).all())

    def select_rows(self, index: torch.Tensor) -> None:
        if self.base is not None:
            self.base = self.base.to(index.device).index_select(0, index)
