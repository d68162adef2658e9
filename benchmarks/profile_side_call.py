"""Where a side call's time goes in `ftchat serve`'s engine thread.

Drives the server's EngineWorker in this process (no HTTP): a main turn of about --history
tokens is prefilled into row 0 and decodes; then short side calls join row 1 one after the
other, as `serve_latency.py`'s do. Every engine-thread operation is timed with the device
synchronized around it: a decode step with the main row alone, a side call's admission
(checkpoint lookup and restore), each of its prefill chunks split into the forward and the
checkpoint copy, the decode steps with both rows. Two arms alternate: `merged` prefills as the
server does (a split below worker.CHECKPOINT_MIN_TOKENS makes no checkpoint), `split` cuts the
prompt at every split (the system prefix, the history) with a checkpoint at each, one prefill
call per piece. Every side call starts with the prefix cache empty. The last side call runs
again (by the server's plan) under torch.profiler; its top operations go to --trace (a text
table).

    python benchmarks/profile_side_call.py [MODEL] --slots 96 --parallel 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from ftchat.resolve import resolve_model
from ftchat.sampling import Sampling
from ftchat.server.metrics import Metrics
from ftchat.server.prompt import ChatRenderer
from ftchat.server.worker import EngineWorker, Job, plan_prefill
from ftchat.settings import Settings
from ftchat.sizes import PREFILL_CHUNK

WORDS = ("the engine keeps each conversation's state so that a second turn prefills only the "
         "tokens it adds while short side calls join the decode batch").split()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, *args):
    sync()
    t = time.perf_counter()
    out = fn(*args)
    sync()
    return out, time.perf_counter() - t


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--slots", type=int, default=96)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--history", type=int, default=2800, help="main turn's prompt, in words")
    p.add_argument("--sides", type=int, default=8, help="side calls, one after the other")
    p.add_argument("--side-steps", type=int, default=16)
    p.add_argument("--json", default=None)
    p.add_argument("--trace", default=None, help="profiler table of the last side call")
    a = p.parse_args()

    settings = Settings(slots=a.slots, batch_size=a.parallel, context=a.context, quiet=True)
    logs: list[str] = []
    w = EngineWorker(resolve_model(a.model, os.environ), settings, 8, a.parallel, 2 << 30,
                     Metrics(), logs.append, log_requests=False)
    _, load_s = timed(w._load)
    render = ChatRenderer(w.session.tokenizer)
    events: list = []

    def job(name: str, text: str, system: str, limit: int) -> Job:
        pr = render.prompt([{"role": "system", "content": system},
                            {"role": "user", "content": text}], [], {})
        return Job(name, pr.ids, limit, (), Sampling(), pr.splits, events.append,
                   ignore_eos=True)  # the main turn decodes throughout

    history = " ".join(WORDS[i % len(WORDS)] for i in range(a.history))
    main_job = job("main", history, "You are a coding agent.", 10**6)
    room = w.max_len - len(main_job.ids) - 32 - 2 * a.sides * (a.side_steps + 1)
    if room < 0:
        sys.exit(f"--history {a.history}: {len(main_job.ids)} tokens leave no room for the "
                 f"decode steps in the context of {w.max_len}")
    (_, admit_s) = timed(w._admit, 0, main_job)
    t = time.perf_counter()
    while w.rows[0].pieces:
        w._prefill_chunk(0)
    sync()
    main_prefill_s = time.perf_counter() - t
    alone = [timed(w._step)[1] for _ in range(32)]

    # the pieces of _prefill_chunk, timed apart: the forward and the checkpoint copy
    forward_s, checkpoint_s = [], []
    real_prefill, real_add = w.dec.prefill, w.cache.add

    def prefill(*args, **kw):
        out, s = timed(real_prefill, *args, **kw)
        forward_s.append(s)
        return out

    def add(*args):
        _, s = timed(real_add, *args)
        checkpoint_s.append(s)

    w.dec.prefill, w.cache.add = prefill, add
    sides = []
    def ask(k: int) -> Job:
        return job(f"side{k}", f"question {k}: name one file " + "x " * (k % 5),
                   "Answer in one line.", a.side_steps)

    for k in range(2 * a.sides):
        arm = ("merged", "split")[k % 2]
        forward_s.clear(), checkpoint_s.clear()
        # no side call restores another's checkpoint: each arm prefills its whole prompt by
        # its own plan (the split arm's system-prefix checkpoint would serve the next call)
        w.cache.items.clear()
        assert w.rows[0] is not None, "the main turn ended"
        side = ask(k)
        _, s_admit = timed(w._admit, 1, side)
        if arm == "split":
            r = w.rows[1]
            r.pieces = plan_prefill(r.cached, len(side.ids), side.splits,
                                    w.dec.prefill_chunk or PREFILL_CHUNK, least=1)
        chunks = []
        while w.rows[1] is not None and w.rows[1].pieces:
            chunks.append(timed(w._prefill_chunk, 1)[1])
        both = []
        while w.rows[1] is not None:
            both.append(timed(w._step)[1])
        sides.append({"arm": arm, "tokens": len(side.ids), "splits": list(side.splits),
                      "admit_s": round(s_admit, 5), "chunk_s": [round(c, 5) for c in chunks],
                      "forward_s": [round(c, 5) for c in forward_s],
                      "checkpoint_s": [round(c, 5) for c in checkpoint_s],
                      "step_both_ms_median": round(1e3 * statistics.median(both), 3)
                      if both else None, "steps": len(both)})
        print(json.dumps(sides[-1]), flush=True)

    # the last side call again, by the server's plan, under the profiler
    w.dec.prefill, w.cache.add = real_prefill, real_add
    w.cache.items.clear()
    side = ask(2 * a.sides - 1)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        w._admit(1, side)
        while w.rows[1] is not None and w.rows[1].pieces:
            w._prefill_chunk(1)
        sync()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    if torch.cuda.is_available():
        table += "\n\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
    if a.trace:
        with open(a.trace, "w") as f:
            f.write(table)
    while w.rows[1] is not None:
        w._step()

    out = {"model": w.resolved.name, "device": torch.cuda.get_device_name()
           if torch.cuda.is_available() else "cpu", "describe": w.session.describe(),
           "load_s": round(load_s, 2), "main_tokens": len(main_job.ids),
           "main_prefill_s": round(main_prefill_s + admit_s, 4),
           "step_alone_ms_median": round(1e3 * statistics.median(alone), 3),
           "sides": sides}
    for arm in ("merged", "split"):
        mine = [x for x in sides[2:] if x["arm"] == arm]  # the first two: compiles, warm-up
        out[f"{arm}_prefill_s_median"] = round(statistics.median(sum(x["chunk_s"])
                                                                 for x in mine), 5)
    print(json.dumps({k: v for k, v in out.items() if k != "sides"}), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
