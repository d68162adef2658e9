"""Leave one kernel family out of the decode step: bench's `skip=` arms, a timing diagnostic.

What a kernel family costs inside the real chain of a step (its own time, the boundaries
around it, the overlap PDL gives its neighbours) is what the step saves without it. A profile
cannot say that: with PDL a kernel's time includes its wait for the one before, and without PDL
the chain is another chain. `ftchat bench --arms 'resident;resident:skip=hc'` runs the same
step with the family's launches left out. The difference in us a layer is that family's
marginal cost.

How a family is left out: each of its wrappers is decorated with `family(name)`. When the call's
kernel configuration (its `kc` argument) carries a `Skip` naming the family, the call returns
the output of the first call that had the same argument shapes, kept in that Skip (one per
arm): real values of the right shapes and dtypes, no launch. The first such call runs the
kernels, and it must not be inside a CUDA graph capture; the decoder's capture warm-up makes it.
In-place work (the GDN and QSA state updates, the K/V cache writes) is skipped with the rest.
**A skip arm's tokens are not the model's; only its time means anything.**
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ftchat.errors import FtchatError

FAMILIES = ("hc", "gemv", "nvfp4", "routed", "router", "gdn", "qsa")


class Skip:
    """The kernel families a bench arm leaves out, and the outputs its calls return instead
    ((wrapper, argument signature) -> the first output)."""

    def __init__(self, families: frozenset[str]):
        self.families = frozenset(families)
        self.kept: dict[tuple, object] = {}


def _signature(v) -> object:
    # what makes two calls the same for skipping: tensors by shape, dtype and device, tuples
    # (SharedOut among them) item by item, the rest by value where hashable (tile choices,
    # flags), by type otherwise (weight dicts). A tuple of tensors hashes by the tensors' ids:
    # taken as a value, every step's fresh tensors would make a new key (a skip=routed arm
    # would find no kept output inside its graph capture)
    if isinstance(v, torch.Tensor):
        return ("tensor", tuple(v.shape), v.dtype, v.device)
    if isinstance(v, (tuple, list)):
        return (type(v).__name__, *map(_signature, v))
    try:
        hash(v)
    except TypeError:
        return type(v).__name__
    return v


def family(name: str) -> Callable:
    """Decorator: `fn` belongs to kernel family `name` (one of FAMILIES); it takes its kernel
    configuration as the keyword argument `kc`."""
    assert name in FAMILIES, name

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args, **kwargs):
            kc = kwargs.get("kc")
            skip = None if kc is None else kc.skip
            if skip is None or name not in skip.families:
                return fn(*args, **kwargs)
            key = (fn.__qualname__, *map(_signature, args),
                   *((k, _signature(v)) for k, v in sorted(kwargs.items()) if k != "kc"))
            if key not in skip.kept:
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise FtchatError(f"skip={name}: {fn.__qualname__} was first called inside "
                                      "a graph capture; an eager call must come first")
                skip.kept[key] = fn(*args, **kwargs)
            return skip.kept[key]

        call.family = name
        return call

    return wrap


def parse_skip(value: str) -> frozenset[str]:
    """`hc+gemv` -> the families, `all` -> every one (what is left is the step's other work);
    a name not in FAMILIES is an error naming them."""
    if value.strip() == "all":
        return frozenset(FAMILIES)
    names = frozenset(filter(None, (v.strip() for v in value.split("+"))))
    bad = sorted(names - set(FAMILIES))
    if bad or not names:
        raise FtchatError(f"skip={value!r}: expected all, or one or more of "
                          f"{', '.join(FAMILIES)} joined by +")
    return names
