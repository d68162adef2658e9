"""Routing traces: the `--record-routing` JSON lines format (ftchat/debug/routing_record.py),
read back as RoutingSteps for the replay and the bench's `trace:FILE` source."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ftchat.errors import FtchatError
from ftchat.routing.calibrated import RoutingStep


def read_trace(path: str | Path) -> list[RoutingStep]:
    """Every step of a trace file. A trace carries no router logits: its steps' logits are
    None, so the `score` eviction policy cannot replay it."""
    steps = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        raise FtchatError(f"routing trace {path}: line {n} is not JSON") from None
                    steps.append(_step(rec, path, n))
    except (OSError, UnicodeDecodeError) as e:
        raise FtchatError(f"cannot read routing trace {path}: {e}") from None
    if not steps:
        raise FtchatError(f"routing trace {path} holds no steps")
    return steps


def _step(rec: dict, path, n: int) -> RoutingStep:
    try:
        routed = np.asarray(rec["routed"], dtype=np.int64)  # [L, K]
        cands = np.asarray(rec["candidates"], dtype=np.int64)  # [L-1, C]
    except (KeyError, TypeError, ValueError):
        raise FtchatError(f"routing trace {path}: line {n} lacks routed / candidates id lists") \
            from None
    if routed.ndim != 2 or cands.ndim != 2 or cands.shape[0] != routed.shape[0] - 1:
        raise FtchatError(f"routing trace {path}: line {n}: routed must be [L, K] and "
                          f"candidates [L-1, C]")
    k = routed.shape[1]
    return RoutingStep(routed=routed, weights=np.full(routed.shape, 1.0 / k, np.float32),
                       candidates=cands, logits=None)


def cycle(steps: list[RoutingStep]) -> Iterator[RoutingStep]:
    """A trace's steps over and over (a bench may decode more tokens than were recorded)."""
    while True:
        yield from steps
