"""Settings: one frozen object, resolved once at start-up from CLI flags, then the
`FREETOKEN_MOE_*` environment variables of the seeds (and FTCHAT_VRAM_BUDGET,
FTCHAT_KV_CACHE_DTYPE, FTCHAT_PDL), then defaults (docs/design.md section 1).

Nothing else in ftchat reads these variables: the CLI passes `os.environ` in here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, get_args

from ftchat.errors import SettingsError

# torch, and every ftchat module that imports it, is imported on use (in the methods below):
# `ftchat --help` and a flag error stay instant
if TYPE_CHECKING:
    import torch

ENV_PREFETCH = "FREETOKEN_MOE_PREFETCH"
ENV_BUDGET = "FREETOKEN_MOE_PREFETCH_BUDGET"
ENV_K = "FREETOKEN_MOE_PREFETCH_K"
ENV_VERIFY = "FREETOKEN_MOE_PREFETCH_VERIFY"
ENV_AUDIT = "FREETOKEN_MOE_SLOT_AUDIT"
ENV_SLIM_COPY = "FREETOKEN_MOE_SLIM_COPY"
ENV_VRAM_BUDGET = "FTCHAT_VRAM_BUDGET"  # GiB; ftchat's own, not a seed variable
ENV_KV_CACHE_DTYPE = "FTCHAT_KV_CACHE_DTYPE"  # auto or fp8; ftchat's own
ENV_PDL = "FTCHAT_PDL"  # 1 or 0; ftchat's own

# `--prefetch auto` turns prefetch on only for expert rows of at least this size. The lookahead
# (a router GEMV, softmax and top-C a layer) cost the demo model 10.6 us a layer on an H100 and
# saves ~1.9 rows a layer there, so a row must take over ~5.6 us on the link to pay: ~270 KB
# at 48 GB/s. Measured: the demo's 36 KB rows, off 2,304 against on 1,866 tok/s; flash-next's
# 2.78 MB rows, on (--budget auto) faster than off on every link measured (docs/routing.md).
# Between the two sizes, not measured.
PREFETCH_MIN_ROW_BYTES = 256 << 10
DEFAULT_COPY_PROGRAMS = 8  # measured on the H200: 8 programs reach cudaMemcpy bandwidth

# auto: on when experts of PREFETCH_MIN_ROW_BYTES or more are offloaded on CUDA, else off;
# measure: predict and count only; on: copy
Prefetch = Literal["auto", "off", "measure", "on"]
Eviction = Literal["rule", "lru", "score"]  # see offload/policy.py
VerifyMode = Literal["meta", "bytes"]
DeviceName = Literal["auto", "cuda", "cpu"]
DtypeName = Literal["auto", "float32", "bfloat16"]
KvCacheDtype = Literal["auto", "fp8"]  # auto: the model dtype; fp8: e4m3 + scales (kv_cache.py)
Kernels = Literal["fused", "torch"]  # fused: Triton decode kernels on CUDA; torch: the reference


@dataclass(frozen=True)
class Settings:
    """Everything a run is configured with; see `resolve_settings` for sources and checks."""

    # auto: on where experts are offloaded on a GPU and their rows are large enough to pay for
    # the lookahead (PREFETCH_MIN_ROW_BYTES; measured faster than off on an H100 and an H200:
    # docs/routing.md), else off (on the CPU nothing overlaps a copy)
    prefetch: Prefetch = "auto"
    # prefetches installed before a GDN / an attention layer; None (`--budget auto`): the rows
    # the link carries under one layer's compute, measured at run time (offload/budget.py)
    budget_gdn: int | None = None
    budget_attn: int | None = None
    candidates: int = 16  # router-lookahead top-K
    slots: int | None = None  # slot-cache size; None: from expert_vram_gib or automatic
    expert_vram_gib: float | None = None
    vram_budget_gib: float | None = None  # the run's VRAM plan must fit; slots sized to fit it
    eviction: Eviction = "rule"
    overlap: bool = True  # shared expert runs while the demand copy is in flight
    graph: bool | None = None  # None: CUDA graphs on CUDA, eager on CPU
    max_new_tokens: int = 256
    batch_size: int = 1
    context: int | None = None  # KV capacity per sequence; None: model maximum, capped
    prefill_chunk: int | None = None  # tokens per prefill call; None: engine.PREFILL_CHUNK
    device: DeviceName = "auto"
    dtype: DtypeName = "auto"
    kv_cache_dtype: KvCacheDtype = "auto"  # how attention K/V are stored; fp8 changes outputs
    # ===== kernel choices (the KernelConfig is built from these) =====
    kernels: Kernels = "fused"  # fused: Triton decode kernels on CUDA; torch: the reference
    pdl: bool = True  # programmatic dependent launch where the GPU has it (Hopper and later)
    verify: VerifyMode | None = None
    audit_every: int = 0  # 0: off
    copy_programs: int = DEFAULT_COPY_PROGRAMS  # 0: cudaMemcpy-style copies
    record_routing: str | None = None
    force: bool = False  # an output file (--record-routing) may replace an existing file
    think: bool | None = None  # the chat template's thinking switch; None: the template's default
    panel: bool | None = None  # None: on when stderr is a terminal
    json: bool = False
    system: str | None = None
    prompt: str | None = None
    quiet: bool = False  # no banner, no loading bar, no timing lines
    threads: int | None = None  # torch CPU threads; None: torch's default
    stop: tuple[str, ...] = ()  # a reply ends where its text first contains one of these
    # ===== sampling: None (not given): the model's generation_config.json
    # (`with_generation_defaults`), else greedy (temperature 0, no penalty), Sampling's defaults
    temperature: float | None = None  # 0: greedy
    top_k: int | None = None  # 0: every token
    top_p: float | None = None  # 1: every token
    repeat_penalty: float | None = None  # 1: none
    min_p: float | None = None  # 0: off
    seed: int | None = None  # None: a random seed per request

    def with_generation_defaults(self, defaults: Mapping[str, float]) -> Settings:
        """These settings with the sampling fields not given (None) taken from `defaults` (a
        model's generation_defaults.py): a flag beats the model's file."""
        return dataclasses.replace(self, **{field: value for field, value in defaults.items()
                                            if getattr(self, field) is None})

    def torch_device(self) -> torch.device:
        """The resolved device: auto is cuda when available, else cpu."""
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise SettingsError("--device cuda: no CUDA device is available (use --device cpu)")
        return torch.device(self.device)

    def torch_dtype(self) -> torch.dtype:
        """The resolved dtype: auto is bfloat16 on CUDA, float32 on CPU."""
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]

    def kv_torch_dtype(self) -> torch.dtype | None:
        """The K/V cache storage dtype: None (auto: the model dtype) or float8_e4m3fn."""
        from ftchat.model.kv_cache import KV_DTYPES

        return KV_DTYPES[self.kv_cache_dtype]

    def watched(self) -> bool:
        """Whether a debug watcher (verifier, slot audit, routing recorder) is on."""
        return bool(self.verify or self.audit_every or self.record_routing)

    def check_graph(self) -> None:
        """Refuse --graph where there is no CUDA device to capture on (before loading)."""
        if self.graph and self.torch_device().type != "cuda":
            raise SettingsError("--graph: CUDA graphs need a CUDA device and this run is on the "
                                "CPU; drop --graph (the CPU decodes eagerly)")

    def prefetch_mode(self, on_cuda: bool, row_bytes: int) -> str:
        """off, measure or on: `auto` is on where the experts are offloaded on CUDA (the caller
        builds an offload backend) and a row holds at least PREFETCH_MIN_ROW_BYTES, else off."""
        if self.prefetch != "auto":
            return self.prefetch
        return "on" if on_cuda and row_bytes >= PREFETCH_MIN_ROW_BYTES else "off"

    def use_graph(self) -> bool:
        """CUDA graphs on CUDA by default; the debug modes (verify, audit, routing record) read
        Python-side step numbers, so they run eagerly."""
        if self.watched():
            return False
        return self.torch_device().type == "cuda" if self.graph is None else self.graph


# ===== value parsers: (value, where) -> parsed; `where` names the flag or variable =====

_TEXT_BOOLS = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}


def _fail(where: str, value: object, expected: str) -> SettingsError:
    shown = f" {value!r}" if where.startswith("--") else f"={value!r}"
    return SettingsError(f"{where}{shown}: expected {expected}")


def context_tokens(text: str) -> int:
    """A context given as tokens: `255k` -> 261120 (k = 1024 tokens), `4096` -> 4096 (bench's
    --context list, info's --context)."""
    t = text.strip().lower()
    try:
        n = int(float(t[:-1]) * 1024) if t.endswith("k") else int(t)
    except (ValueError, OverflowError):  # OverflowError: infk, 1e400k
        n = 0
    if n < 1:
        raise SettingsError(f"--context {text!r}: expected a token count like 4096 or 255k")
    return n


def _int(minimum: int, maximum: int | None = None) -> Callable[[object, str], int]:
    expected = {0: "a non-negative integer", 1: "a positive integer"}[minimum]
    if maximum is not None:
        expected = f"an integer from {minimum} to {maximum:,}"

    def parse(value: object, where: str) -> int:
        if isinstance(value, bool):
            raise _fail(where, value, expected)
        try:
            n = int(value.strip()) if isinstance(value, str) else int(value)
        except (TypeError, ValueError, OverflowError):
            raise _fail(where, value, expected) from None
        if n < minimum or (isinstance(value, float) and value != n) or (
                maximum is not None and n > maximum):
            raise _fail(where, value, expected)
        return n

    return parse


MAX_BATCH = 4096  # --batch-size: sequences decoded together (each holds a whole decode state)


def _choice(literal) -> Callable[[object, str], str]:
    options = get_args(literal)

    def parse(value: object, where: str) -> str:
        v = value.strip().lower() if isinstance(value, str) else value
        if v not in options:
            raise _fail(where, value, ", ".join(options[:-1]) + " or " + options[-1])
        return v

    return parse


MAX_GIB = 1 << 20  # a GiB figure past this (a PiB) is a typo, and its bytes overflow floats


def _positive_float(value: object, where: str) -> float:
    expected = f"a positive number of GiB, at most {MAX_GIB:,}"
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise _fail(where, value, expected) from None
    if not 0 < x <= MAX_GIB:  # nan and inf too
        raise _fail(where, value, expected)
    return x


def _number(low: float, high: float = float("inf"), low_open: bool = False,
            expected: str = "") -> Callable[[object, str], float]:
    """A finite number in [low, high] ((low, high] with low_open)."""
    def parse(value: object, where: str) -> float:
        if isinstance(value, bool):
            raise _fail(where, value, expected)
        try:
            x = float(value.strip()) if isinstance(value, str) else float(value)
        except (TypeError, ValueError):
            raise _fail(where, value, expected) from None
        if not (x > low if low_open else x >= low) or not x <= high or x == float("inf"):
            raise _fail(where, value, expected)
        return x

    return parse


TEMPERATURE = _number(0.0, expected="a number >= 0 (0: greedy)")
TOP_P = _number(0.0, 1.0, low_open=True, expected="a number above 0 and at most 1")
MIN_P = _number(0.0, 1.0, expected="a number from 0 to 1 (0: off)")
REPEAT_PENALTY = _number(0.0, low_open=True, expected="a positive number (1: no penalty)")
TOP_K = _int(0)

def _seed(value: object, where: str) -> int:
    n = _int(0)(value, where)
    if n >= 2**63:
        raise _fail(where, value, "an integer from 0 to 2**63 - 1")
    return n


def _stop_strings(value: object, where: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(x, str) for x in items):
        raise _fail(where, value, "text")
    if any(x == "" for x in items):
        raise _fail(where, value, "a non-empty stop string")
    for x in items:
        _unicode_text(x, where)
    return tuple(dict.fromkeys(items))


def _unicode_text(value: object, where: str) -> str:
    """Text a tokenizer will read: no lone surrogates (the bytes of an argument that are not
    UTF-8 arrive as surrogates)."""
    text = _text(value, where)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise SettingsError(f"{where}: not UTF-8 text (give the text in UTF-8)") from None
    return text


def _prompt(value: object, where: str) -> str:
    text = _unicode_text(value, where)
    if not text.strip():
        raise _fail(where, value, "a prompt with some text in it")
    return text


def _verify_env(value: object, where: str) -> str | None:
    # The seed's convention: meta checks maps, 1 also checks bytes; 0/off disable.
    v = str(value).strip().lower()
    table = {"meta": "meta", "1": "bytes", "bytes": "bytes", "0": None, "off": None}
    if v not in table:
        raise _fail(where, value, "meta, 1 (bytes) or 0")
    return table[v]


def _copy_programs_env(value: object, where: str) -> int:
    v = str(value).strip().lower()
    if v == "off":
        return 0
    if v == "on":
        return DEFAULT_COPY_PROGRAMS
    try:
        return _int(0)(v, where)
    except SettingsError:
        raise _fail(where, value, "a number of copy programs, or off") from None


def _switch_env(value: object, where: str) -> bool:
    v = str(value).strip().lower()
    if v not in _TEXT_BOOLS:
        raise _fail(where, value, "1 or 0")
    return _TEXT_BOOLS[v]


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise _fail(where, value, "text")
    return value


def _bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise _fail(where, value, "true or false")
    return value


# ===== resolution =====

# field -> (flag key in `flags`, flag as typed, parser, env variable, env parser)
_SOURCES: dict[str, tuple[str, str, Callable, str | None, Callable | None]] = {
    "prefetch": ("prefetch", "--prefetch", _choice(Prefetch), ENV_PREFETCH, _choice(Prefetch)),
    "candidates": ("candidates", "--candidates", _int(1), ENV_K, _int(1)),
    "slots": ("slots", "--slots", _int(1), None, None),
    "expert_vram_gib": ("expert_vram", "--expert-vram", _positive_float, None, None),
    "vram_budget_gib": ("vram_budget", "--vram-budget", _positive_float, ENV_VRAM_BUDGET,
                        _positive_float),
    "eviction": ("eviction", "--eviction", _choice(Eviction), None, None),
    "overlap": ("overlap", "--overlap", _bool, None, None),
    "graph": ("graph", "--graph", _bool, None, None),
    "max_new_tokens": ("max_new_tokens", "--max-new-tokens", _int(1), None, None),
    "batch_size": ("batch_size", "--batch-size", _int(1, MAX_BATCH), None, None),
    "context": ("context", "--context", _int(1), None, None),
    "prefill_chunk": ("prefill_chunk", "--prefill-chunk", _int(1), None, None),
    "device": ("device", "--device", _choice(DeviceName), None, None),
    "dtype": ("dtype", "--dtype", _choice(DtypeName), None, None),
    "kv_cache_dtype": ("kv_cache_dtype", "--kv-cache-dtype", _choice(KvCacheDtype),
                       ENV_KV_CACHE_DTYPE, _choice(KvCacheDtype)),
    "kernels": ("kernels", "--kernels", _choice(Kernels), None, None),
    "pdl": ("pdl", "--pdl", _bool, ENV_PDL, _switch_env),
    "verify": ("verify", "--verify", _choice(VerifyMode), ENV_VERIFY, _verify_env),
    "audit_every": ("audit", "--audit", _int(0), ENV_AUDIT, _int(0)),
    "copy_programs": ("copy_programs", "--copy-programs", _int(0), ENV_SLIM_COPY,
                      _copy_programs_env),
    "record_routing": ("record_routing", "--record-routing", _text, None, None),
    "force": ("force", "--force", _bool, None, None),
    "think": ("think", "--think", _bool, None, None),
    "panel": ("panel", "--panel", _bool, None, None),
    "json": ("json", "--json", _bool, None, None),
    "system": ("system", "--system", _unicode_text, None, None),
    "prompt": ("prompt", "--prompt", _prompt, None, None),
    "quiet": ("quiet", "--quiet", _bool, None, None),
    "threads": ("threads", "--threads", _int(1), None, None),
    "stop": ("stop", "--stop", _stop_strings, None, None),
    "temperature": ("temp", "--temp", TEMPERATURE, None, None),
    "top_k": ("top_k", "--top-k", _int(0), None, None),
    "top_p": ("top_p", "--top-p", TOP_P, None, None),
    "repeat_penalty": ("repeat_penalty", "--repeat-penalty", REPEAT_PENALTY, None, None),
    "min_p": ("min_p", "--min-p", MIN_P, None, None),
    "seed": ("seed", "--seed", _seed, None, None),
}

# other names of a flag key: alias -> (key, the flag as typed); an error names the one typed
_ALIASES = {"audit_every": ("audit", "--audit-every")}

KNOWN_FLAGS = ({src[0] for src in _SOURCES.values()} | {"budget", "budget_gdn", "budget_attn"}
               | set(_ALIASES))


def resolve_settings(flags: Mapping[str, object], env: Mapping[str, str]) -> Settings:
    """Settings from CLI flags (None = not given), then environment variables, then defaults.

    Args:
        flags: flag name with underscores (`budget_gdn`, `expert_vram`, ...) -> value or None.
        env: the process environment (only the FREETOKEN_MOE_* variables,
            FTCHAT_VRAM_BUDGET, FTCHAT_KV_CACHE_DTYPE and FTCHAT_PDL are read).
    Raises:
        SettingsError: one line naming the flag or variable with the bad value.
    """
    unknown = sorted(set(flags) - KNOWN_FLAGS)
    if unknown:
        raise SettingsError(f"unknown setting(s): {', '.join(unknown)}")
    flags = dict(flags)
    typed: dict[str, str] = {}  # key -> the flag as typed, where an alias gave it
    for alias, (key, flag) in _ALIASES.items():
        if flags.get(alias) is not None:
            if flags.get(key) is not None and flags[key] != flags[alias]:
                raise SettingsError(f"{flag} and its old name give different values: give one")
            flags[key], typed[key] = flags.pop(alias), flag
    values: dict[str, object] = {}
    for field, (key, flag, parse, var, parse_env) in _SOURCES.items():
        if flags.get(key) is not None:
            values[field] = parse(flags[key], typed.get(key, flag))
        elif var is not None and env.get(var, "").strip():
            values[field] = parse_env(env[var], var)
    values.update(_budgets(flags, env))
    if values.get("slots") is not None and values.get("expert_vram_gib") is not None:
        raise SettingsError("--slots and --expert-vram are exclusive: give one of them")
    return Settings(**values)


def check_sampling_flags(flags: Settings, temperature: float | None) -> None:
    """--top-k, --top-p, --min-p and --seed (`flags`: the settings before the model's defaults)
    refused where decoding is greedy: `temperature` (--temp, else the model's
    generation_config.json) 0 or none. Checked once the model's file is read: a model that
    samples by default takes them without --temp."""
    if temperature:
        return
    for field, flag, off in (("top_k", "--top-k", 0), ("top_p", "--top-p", 1.0),
                             ("min_p", "--min-p", 0.0), ("seed", "--seed", None)):
        if getattr(flags, field) not in (None, off):
            raise SettingsError(f"{flag} applies to sampling: give --temp above 0 too "
                                "(decoding is greedy by default)")


def resolve_one(field: str, flag: object, env: Mapping[str, str]) -> object:
    """One setting as `resolve_settings` gives it (the flag's value, None: not given; else the
    variable; else the default), for a command that takes a single engine setting (info)."""
    _, typed, parse, var, parse_env = _SOURCES[field]
    if flag is not None:
        return parse(flag, typed)
    if var is not None and env.get(var, "").strip():
        return parse_env(env[var], var)
    return getattr(Settings(), field)


def _budgets(flags: Mapping[str, object], env: Mapping[str, str]) -> dict[str, object]:
    # --budget-gdn / --budget-attn beat --budget, which beats the variable (it sets both);
    # `auto` (--budget or the variable, the default) is None: measured at run time
    out: dict[str, object] = {}
    if env.get(ENV_BUDGET, "").strip():
        out = _budget_value(env[ENV_BUDGET], ENV_BUDGET)
    if flags.get("budget") is not None:
        out = _budget_value(flags["budget"], "--budget")
    for field, flag in (("budget_gdn", "--budget-gdn"), ("budget_attn", "--budget-attn")):
        if flags.get(field) is not None:
            out[field] = _int(0)(flags[field], flag)
    return out


def _budget_value(value: object, source: str) -> dict[str, object]:
    """`auto` (None) or an integer >= 0, for both budgets."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return {"budget_gdn": None, "budget_attn": None}
    try:
        n = _int(0)(value, source)
    except SettingsError:
        raise _fail(source, value, "auto or a non-negative integer") from None
    return {"budget_gdn": n, "budget_attn": n}


# ===== overrides (bench arms): the same parsers, values given as text =====


def override(base: Settings, flags: Mapping[str, str]) -> Settings:
    """`base` with some flags replaced, each value text (`eviction=lru`, `overlap=0`), parsed
    and checked exactly as the flag would be; `budget` sets both budgets.

    Raises:
        SettingsError: naming the flag and the bad value.
    """
    values: dict[str, object] = {}
    by_key = {src[0]: (field, src) for field, src in _SOURCES.items()}
    for key, text in flags.items():
        if key == "budget":
            values.update(_budget_value(text, "--budget"))
            continue
        if key in ("budget_gdn", "budget_attn"):
            values[key] = _int(0)(text, "--" + key.replace("_", "-"))
            continue
        if key not in by_key:
            raise SettingsError(f"unknown setting {key!r}")
        field, (_, flag, parse, _, _) = by_key[key]
        if parse is _bool:
            if text.strip().lower() not in _TEXT_BOOLS:
                raise _fail(flag, text, "1 or 0")
            values[field] = _TEXT_BOOLS[text.strip().lower()]
        else:
            values[field] = parse(text, flag)
    return dataclasses.replace(base, **values)
