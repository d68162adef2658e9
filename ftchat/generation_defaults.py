"""A model folder's generation defaults: its generation_config.json, read as transformers'
`generate` reads it, as the sampling settings no flag gave (`Settings.with_generation_defaults`).
"""

from __future__ import annotations

import json
from pathlib import Path

from ftchat.errors import ModelError, SettingsError
from ftchat.settings import MIN_P, REPEAT_PENALTY, TEMPERATURE, TOP_K, TOP_P

# key -> (Settings field, parser, transformers' value when "do_sample" is true and the key is
# absent); every key but repetition_penalty counts only with "do_sample": true (without it
# transformers decodes greedily and ignores them)
GENERATION_KEYS = {
    "repetition_penalty": ("repeat_penalty", REPEAT_PENALTY, None),
    "temperature": ("temperature", TEMPERATURE, 1.0),
    "top_k": ("top_k", TOP_K, 50),
    "top_p": ("top_p", TOP_P, 1.0),
    "min_p": ("min_p", MIN_P, None),
}


def generation_defaults(folder: Path) -> dict[str, float]:
    """Settings field -> value from `folder`'s generation_config.json ({} without one); a bad
    value is a ModelError naming the file and the key."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ModelError(f"cannot read {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise ModelError(f"{path} is not a JSON object")
    sampled = cfg.get("do_sample") is True
    out: dict[str, float] = {}
    for key, (field, parse, sampled_default) in GENERATION_KEYS.items():
        if key != "repetition_penalty" and not sampled:
            continue
        value = cfg.get(key, sampled_default)
        if value is not None:
            try:
                out[field] = parse(value, key)
            except SettingsError as e:
                raise ModelError(f"{path}: {e}") from None
    return out
