"""The deletion test's plan, shared by the benchmarks that delete what a map ranks first (tokens of a prompt in
llm-retrieval, patches of an image in vlm-shapes): the ranking, the deletions each step asks for, read once each,
and the area under the curve."""
from __future__ import annotations

from typing import Callable, Mapping, Sequence

import torch

__all__ = ["DIRECTIONS", "STEPS", "area", "curves_of", "plan_deletions", "ranked"]

STEPS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
#: most relevant first, least relevant first
DIRECTIONS = ("morf", "lerf")


def ranked(scores: torch.Tensor, direction: str) -> torch.Tensor:
    """The indices of the 1-D ``scores``, most relevant first (``morf``) or least relevant first (``lerf``); ties in
    index order."""
    values = scores.double()
    return torch.argsort(-values if direction == "morf" else values, stable=True)


def plan_deletions(orders: Mapping[str, Callable[[int, str], torch.Tensor]], rows: int,
                   steps: Sequence[float] = STEPS) -> tuple[list[tuple[int, tuple[int, ...]]], dict[str, dict[str, list[list[int]]]]]:
    """``(deletions, plan)``: for each map name, ``orders[name](row, direction)`` is the ranking of a row's deletable
    units (``ranked`` positions); each step removes its first ``int(step * len(order))``. ``deletions`` lists each
    distinct ``(row, removed units, sorted)`` once, in first-asked order (so nothing removed comes first per row);
    ``plan[name][direction][row]`` is the index into ``deletions`` of each step."""
    deletions: list[tuple[int, tuple[int, ...]]] = []
    slot: dict[tuple[int, tuple[int, ...]], int] = {}
    plan: dict[str, dict[str, list[list[int]]]] = {}
    for name, order_of in orders.items():
        plan[name] = {direction: [] for direction in DIRECTIONS}
        for row in range(rows):
            for direction in DIRECTIONS:
                order = order_of(row, direction)
                slots = []
                for step in steps:
                    key = (row, tuple(sorted(order[:int(step * len(order))].tolist())))
                    if key not in slot:
                        slot[key] = len(deletions)
                        deletions.append(key)
                    slots.append(slot[key])
                plan[name][direction].append(slots)
    return deletions, plan


def curves_of(values: torch.Tensor, deletions: Sequence[tuple[int, tuple[int, ...]]], plan: Mapping[str, Mapping[str, list[list[int]]]],
              rows: int) -> tuple[torch.Tensor, dict[str, dict[str, torch.Tensor]]]:
    """``(clean, curves)`` from ``values`` read per deletion: each row's value with nothing removed ``(B,)`` and per
    name and direction the ``(B, steps)`` change from it."""
    index = {key: k for k, key in enumerate(deletions)}
    clean = values[[index[(row, ())] for row in range(rows)]]
    return clean, {name: {direction: values[torch.tensor(slots)] - clean[:, None] for direction, slots in by.items()}
                   for name, by in plan.items()}


def area(curves: torch.Tensor, steps: Sequence[float] = STEPS) -> torch.Tensor:
    """``(B,)`` trapezoid areas of ``(B, S)`` curves over ``steps``."""
    x = torch.tensor(steps, dtype=torch.float64)
    return ((x[1:] - x[:-1]) * (curves[:, 1:] + curves[:, :-1]) / 2).sum(1)
