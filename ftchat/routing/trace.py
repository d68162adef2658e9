"""Routing traces: the `--record-routing` JSON lines format (ftchat/debug/routing_record.py),
read back as RoutingSteps for the replay and the bench's `trace:FILE` source. A line's
`logits_f16` (the router logits, base64 of float16 [L, E]) is optional: traces recorded before
it existed carry none, and eviction `score` cannot replay those."""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ftchat.errors import FtchatError
from ftchat.routing.calibrated import RoutingStep


def read_trace(path: str | Path) -> list[RoutingStep]:
    """Every step of a trace file; a step's logits are None where its line has none (then
    every line must lack them: a replay cannot switch policies' inputs halfway)."""
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
    widths = {None if s.logits is None else s.logits.shape[1] for s in steps}
    if len(widths) > 1:
        raise FtchatError(f"routing trace {path}: some lines have logits_f16 and some do not, "
                          f"or their widths differ")
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
    logits = None
    if "logits_f16" in rec:
        try:
            logits = decode_logits(rec["logits_f16"], routed.shape[0])
        except (TypeError, ValueError, binascii.Error) as e:
            raise FtchatError(f"routing trace {path}: line {n}: logits_f16: {e}") from None
        if logits.shape[1] <= int(routed.max()):
            raise FtchatError(f"routing trace {path}: line {n}: {logits.shape[1]} logits a "
                              f"layer, but expert {int(routed.max())} is routed")
    k = routed.shape[1]
    return RoutingStep(routed=routed, weights=np.full(routed.shape, 1.0 / k, np.float32),
                       candidates=cands, logits=logits)


def trace_line(step: int, routed: list, candidates: list, logits: np.ndarray | None) -> str:
    """One line of a trace file: routed [L][K] and candidates [L-1][C] ids, logits [L, E] (or
    None: a line without them), newline included."""
    line = {"step": step, "routed": routed, "candidates": candidates}
    if logits is not None:
        line["logits_f16"] = encode_logits(logits)
    return json.dumps(line) + "\n"


def encode_logits(logits: np.ndarray) -> str:
    """[L, E] router logits -> base64 of the little-endian float16 array (a line's logits_f16)."""
    return base64.b64encode(np.ascontiguousarray(logits, dtype="<f2").tobytes()).decode("ascii")


def decode_logits(text: str, num_layers: int) -> np.ndarray:
    """encode_logits' inverse: [L, E] float32. ValueError (binascii.Error) on other text."""
    if not isinstance(text, str):
        raise ValueError("expected a base64 string")
    a = np.frombuffer(base64.b64decode(text, validate=True), dtype="<f2")
    if a.size == 0 or a.size % num_layers:
        raise ValueError(f"{a.size} values for {num_layers} layers")
    return a.reshape(num_layers, -1).astype(np.float32)


def cycle(steps: list[RoutingStep]) -> Iterator[RoutingStep]:
    """A trace's steps over and over (a bench may decode more tokens than were recorded)."""
    while True:
        yield from steps
