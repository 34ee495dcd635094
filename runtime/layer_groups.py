"""Layer groups over one page pool: sliding-window layers that keep only their window's pages beside global
layers that keep the whole context (docs/design.md §5).  No torch here.

The layers split into groups of ``size`` layers each (the gcd of the global and the sliding layer counts;
Gemma 3 270M: 3 global + 15 sliding → six groups of 3), global groups first.  Layer ``j`` of every group
stores into plane slot ``j`` (the cache allocates ``size`` planes, not one per layer), so a page id costs the
same ``size`` layer-pages in every group and one allocator serves them all.  Each sequence holds one page list
per group (the same logical length in every group); a sliding group's pages below its window go back to the
allocator and their entries become the scratch page (``runtime/scheduler.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

__all__ = ["LayerGroups", "plan_layer_groups"]


@dataclass(frozen=True)
class LayerGroups:
    group_of: tuple  # per layer: its group (0 .. num_groups - 1; global groups first)
    slot_of: tuple  # per layer: its plane slot (0 .. size - 1)
    windows: tuple  # per group: its sliding window, None for a global group
    size: int  # layers per group

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def pages_per_seq(self, context_len: int, page_size: int, chunk: int = 1) -> int:
        """Page ids one sequence of ``context_len`` tokens holds, over all groups, while a step of ``chunk``
        new tokens runs (1: decoding)."""
        full = -(-context_len // page_size)
        return sum(full if w is None else min(full, -(-(w + chunk - 1) // page_size) + 1) for w in self.windows)

    def longest_context(self, num_pages: int, page_size: int) -> int:
        """The longest context one sequence can hold in ``num_pages`` page ids (decoding), 0 if none."""
        lo, hi = 0, max(num_pages, 0) * page_size
        while lo < hi:  # the largest L with pages_per_seq(L) <= num_pages (monotonic in L)
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.pages_per_seq(mid, page_size) <= num_pages else (lo, mid - 1)
        return lo


def plan_layer_groups(windows: Sequence[Optional[int]], formats: Optional[Sequence[str]] = None) -> Optional[LayerGroups]:
    """The groups of a model with both global and sliding-window layers (one window size), or None where
    grouping does not apply: every layer global or every layer sliding (one page list serves), several
    window sizes, or per-layer formats that differ between layers sharing a plane slot."""
    full = [i for i, w in enumerate(windows) if w is None]
    sliding = [i for i, w in enumerate(windows) if w is not None]
    if not full or not sliding or len({windows[i] for i in sliding}) != 1:
        return None
    size = math.gcd(len(full), len(sliding))
    group_of, slot_of = [0] * len(windows), [0] * len(windows)
    for g, start in enumerate(range(0, len(full), size)):
        for j, i in enumerate(full[start:start + size]):
            group_of[i], slot_of[i] = g, j
    nf = len(full) // size
    for g, start in enumerate(range(0, len(sliding), size)):
        for j, i in enumerate(sliding[start:start + size]):
            group_of[i], slot_of[i] = nf + g, j
    if formats is not None:
        slot_fmt: dict[int, str] = {}
        for i, f in enumerate(formats):
            if slot_fmt.setdefault(slot_of[i], f) != f:
                return None
    w = int(windows[sliding[0]])
    return LayerGroups(tuple(group_of), tuple(slot_of), (None,) * nf + (w,) * (len(sliding) // size), size)
