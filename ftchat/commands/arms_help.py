"""`ftchat bench --help-arms`: the grammar of `--arms` and every key an arm takes, and the arms
that bench's user options (--prefetch, --budget) stand for. No torch here: the help is instant.

The key table is data (`ARM_KEYS`), so that a test can put each key's example through the arm
parser (commands/bench.py `parse_arm`): the page lists only what the parser accepts.
"""

from __future__ import annotations

import textwrap

from ftchat.errors import UsageError

WIDTH = 80  # the page's width at most, whatever the terminal
HEADS = {
    "resident": "every expert in VRAM, no offload: the ceiling",
    "off": "experts offloaded, no prefetch",
    "measure": "offloaded; the prefetch predicts and counts, copies nothing",
    "on": "offloaded, with prefetch",
}
SKIP_FAMILIES = ("hc", "gemv", "nvfp4", "routed", "router", "gdn", "qsa")  # kernels/skip.py

# (key=example, which arms take it, what it sets)
ARM_KEYS = (
    ("budget=4", "offload", "prefetch budget before every layer, or auto: measured at run "
     "time (--budget)"),
    ("budget_gdn=4", "offload", "budget before GDN layers (--budget-gdn)"),
    ("budget_attn=4", "offload", "budget before attention layers (--budget-attn)"),
    ("candidates=16", "offload", "router-lookahead candidates (--candidates)"),
    ("eviction=lru", "offload", "slot eviction: rule, lru or score (--eviction)"),
    ("overlap=0", "offload", "1 or 0: the shared expert overlaps the demand copy (--overlap)"),
    ("slots=64", "offload", "expert slots of this arm (--slots)"),
    ("copy_programs=0", "offload", "copy-kernel programs, 0: cudaMemcpy (--copy-programs)"),
    ("kv_cache_dtype=fp8", "offload", "K/V cache storage: auto or fp8 (--kv-cache-dtype)"),
    ("graph=0", "offload", "1 or 0: CUDA graph replay (--graph/--eager)"),
    ("fused=0", "any", "1 or 0; 0: the torch decode path (the before of a kernel change)"),
    ("pdl=0", "any", "1 or 0: programmatic dependent launch (--pdl/--no-pdl)"),
    ("skip=hc+gemv", "resident", "kernel families left out (F+F... or all): "
     + ", ".join(SKIP_FAMILIES) + "; the arm's time without them is their marginal cost "
     "(its tokens are not the model's)"),
)
EXAMPLES = (
    ('"off;on:budget=auto;on:budget=1"', "the default: --prefetch off,on --budget auto,1"),
    ('"resident;off;on:budget=2"', "as --prefetch resident,off,on --budget 2"),
    ('"resident;resident:fused=0"', "fused kernels against the torch path"),
    ('"off;off:eviction=lru"', "rule against LRU eviction"),
    ('"resident;resident:skip=routed"', "what the routed experts cost"),
)
_WHO = {"offload": "off, measure and on arms (a setting by its flag's name, checked as the "
                   "flag is)", "any": "every arm", "resident": "resident arms"}


def arms_help() -> str:
    """The --help-arms page, every line at most WIDTH characters."""
    out = ['Usage: ftchat bench [MODEL] --arms "ARM;ARM;..."', ""]
    out += _para("Arms in bench's own grammar, instead of --prefetch and --budget. Each arm "
                 "has its own expert backend and decode state over the same weights; every "
                 "round decodes every arm once, interleaved. Arms are separated by ';', each "
                 "named once, and an arm is HEAD or HEAD:KEY=VALUE,KEY=VALUE,...")
    out += ["", "HEAD:"] + [line for head, what in HEADS.items() for line in _item(head, what)]
    for who in _WHO:
        out += ["", *_para(f"KEY=VALUE of {_WHO[who]}:")]
        out += [line for key, w, what in ARM_KEYS if w == who for line in _item(key, what)]
    out += ["", "Examples:"]
    for arms, what in EXAMPLES:
        out += [f"  --arms {arms}", *_para(what, indent="      ")]
    return "\n".join(out) + "\n"


def _para(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent)


def _item(name: str, what: str) -> list[str]:
    """`  name   what`, the text wrapped under itself."""
    col = 22
    head = f"  {name}".ljust(col) if len(name) + 3 <= col else None
    lines = textwrap.wrap(what, WIDTH - col)
    if head is None:
        return [f"  {name}"] + [" " * col + ln for ln in lines]
    return [head + lines[0]] + [" " * col + ln for ln in lines[1:]]


def arms_of_choices(prefetch: str | None, budget: str | None) -> str:
    """The --arms string that --prefetch LIST and --budget LIST stand for: one arm per prefetch
    mode, and for each of measure and on one arm per budget (default off,on and auto,1)."""
    # an empty value given is refused as a list, not taken for the default
    modes = list_items("off,on" if prefetch is None else prefetch, "--prefetch", "off,on")
    bad = [m for m in modes if m not in HEADS]
    if bad:
        raise UsageError(f"--prefetch {bad[0]!r}: expected a list of {', '.join(HEADS)} "
                          "(e.g. off,on)")
    budgets = list_items("auto,1" if budget is None else budget, "--budget", "1,4")
    for b in budgets:
        if not (b.isdigit() or b == "auto"):
            raise UsageError(f"--budget {b!r}: expected non-negative integers or auto "
                              "(e.g. 1,4,auto)")
    if budget is not None and not {"measure", "on"} & set(modes):
        raise UsageError("--budget: only the measure and on arms have a budget; add on to "
                          "--prefetch")
    arms: list[str] = []
    for m in modes:
        arms += [f"{m}:budget={b if b == 'auto' else int(b)}" for b in budgets] \
            if m in ("measure", "on") else [m]
    return ";".join(arms)


def list_items(text: str, flag: str, example: str) -> list[str]:
    """The items of a bench list option (--prefetch, --budget, --context): comma-separated,
    none empty, none twice."""
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        raise UsageError(f"{flag} {text!r}: expected a comma-separated list (e.g. {example})")
    if len(set(items)) != len(items):
        raise UsageError(f"{flag} {text!r}: an item is given twice")
    return items
