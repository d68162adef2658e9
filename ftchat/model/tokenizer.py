"""Tokenizer, ChatML chat template and streaming detokenizer for a model folder.

`write_synthetic_tokenizer` writes a small byte-level BPE in the Qwen3.5 layout (tokenizer.json +
tokenizer_config.json) for synthetic checkpoints; `Tokenizer` reads any such folder, real or not.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers

from ftchat.errors import FtchatError, ModelError

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
THINK, END_THINK = "<think>", "</think>"
# Offsets from `special_base` of the real Qwen3.5+ ids (docs/model.md section 9: 248044.., 248068/9).
SPECIAL_OFFSETS = {ENDOFTEXT: 0, IM_START: 1, IM_END: 2, THINK: 24, END_THINK: 25}
# Qwen marks the think tags as plain added tokens (special=False): they survive skip_special.
NOT_SPECIAL = {THINK, END_THINK}
MODEL_MAX_LENGTH = 262144

# The Qwen pre-tokenizer split (contractions, letter runs, single digits, punctuation, spaces).
SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML with Qwen3-style thinking, written for ftchat. Earlier assistant turns lose their
# <think> block; the generation prompt opens <think> unless enable_thinking is false.
CHAT_TEMPLATE = """\
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- set ns.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Unsupported role: ' + message.role|string) }}
    {%- endif %}
    {%- if message.role == 'system' and not loop.first %}
        {{- raise_exception('The system message must come first.') }}
    {%- endif %}
    {%- if message.content is not string %}
        {{- raise_exception('Message content must be a string.') }}
    {%- endif %}
    {%- set content = message.content %}
    {%- if message.role == 'assistant' and '</think>' in content %}
        {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
        {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- if loop.index0 > ns.last_user %}
            {%- set content = '<think>\\n' + reasoning + '\\n</think>\\n\\n' + content %}
        {%- endif %}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- else %}
        {{- '<think>\\n' }}
    {%- endif %}
{%- endif %}
"""


# ===== synthetic tokenizer files =====


def write_synthetic_tokenizer(
    out_dir: Path, vocab_size: int, special_base: int | None = None
) -> dict[str, int]:
    """Write tokenizer.json and tokenizer_config.json for a synthetic checkpoint.

    Args:
        out_dir: folder to write into (created if missing).
        vocab_size: model vocab (embedding rows); every token id is below it.
        special_base: id of <|endoftext|>; the other specials follow the real Qwen offsets
            (248044 gives the real ids). None puts the five specials at the top of the range.
    Returns:
        token -> id of the five special tokens.
    """
    if special_base is None:
        special_ids = {tok: vocab_size - 5 + i for i, tok in enumerate(SPECIAL_OFFSETS)}
        num_bpe = vocab_size - 5
    else:
        special_ids = {tok: special_base + off for tok, off in SPECIAL_OFFSETS.items()}
        num_bpe = min(special_base, vocab_size)
    if num_bpe <= 256 or max(special_ids.values()) >= vocab_size:
        raise ValueError(f"vocab_size {vocab_size} / special_base {special_base} leave no room")
    backend = _build_backend(num_bpe, special_ids)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(backend.to_str(pretty=True) + "\n", encoding="utf-8")
    config = _tokenizer_config(special_ids)
    text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    (out_dir / "tokenizer_config.json").write_text(text, encoding="utf-8")
    return special_ids


def _empty_backend(model: models.Model) -> tokenizers.Tokenizer:
    # The pipeline transformers' Qwen3_5Tokenizer rebuilds, so both load the file identically.
    backend = tokenizers.Tokenizer(model)
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    return backend


def _build_backend(num_bpe: int, special_ids: dict[str, int]) -> tokenizers.Tokenizer:
    trainer = trainers.BpeTrainer(
        vocab_size=num_bpe,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    learner = _empty_backend(models.BPE())
    learner.train_from_iterator([_CORPUS], trainer)
    learned = json.loads(learner.to_str())["model"]
    # tokenizers gives an added token the id it already has in the model vocab, else the next
    # free id; so the specials go into the BPE vocab at their ids, which makes it sparse
    # (unused ids between the learned tokens and the specials) instead of padded.
    vocab = {**learned["vocab"], **special_ids}
    merges = [tuple(pair) for pair in learned["merges"]]
    model = models.BPE(
        vocab=vocab,
        merges=merges,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
        byte_fallback=False,
    )
    backend = _empty_backend(model)
    backend.add_tokens([_added_token(tok) for tok in special_ids])
    placed = {tok: backend.token_to_id(tok) for tok in special_ids}
    if placed != special_ids:  # guards the sparse-vocab trick against a tokenizers change
        raise RuntimeError(f"tokenizers placed the specials at {placed}, not {special_ids}")
    return backend


def _added_token(content: str) -> AddedToken:
    return AddedToken(content, special=content not in NOT_SPECIAL, normalized=False)


def _tokenizer_config(special_ids: dict[str, int]) -> dict:
    decoder = {}
    for tok, tid in sorted(special_ids.items(), key=lambda kv: kv[1]):
        decoder[str(tid)] = {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": tok not in NOT_SPECIAL,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen3_5Tokenizer",
        "unk_token": None,
    }


# ===== loading a folder =====


class Tokenizer:
    """A model folder's tokenizer: encode/decode, chat template, stop ids.

    Immutable after `from_folder`; safe to share between a chat loop and stream decoders.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        template: jinja2.Template,
        template_vars: dict[str, str],
        special_ids: dict[str, int],
        eos_ids: frozenset[int],
    ) -> None:
        self.backend = backend
        self.template = template
        self.template_vars = template_vars  # the set special-token strings, as transformers passes
        self.special_ids = special_ids  # every added token (content -> id), think tags included
        self.eos_ids = eos_ids  # generation stops on any of these
        self.thinking_switch = True  # the template reads enable_thinking (from_folder checks)

    @classmethod
    def from_folder(cls, folder: Path | str) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and optional generation_config.json.

        Args:
            folder: an HF model folder.
        """
        folder = Path(folder)
        tok_file = folder / "tokenizer.json"
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # tokenizers raises plain Exception for every failure
            raise ModelError(f"cannot read {tok_file}: {exc}") from exc
        config = _read_json(folder / "tokenizer_config.json")
        added = backend.get_added_tokens_decoder()  # id -> AddedToken
        special_ids = {tok.content: tid for tid, tok in sorted(added.items())}
        for required in (ENDOFTEXT, IM_START, IM_END):
            if required not in special_ids:
                raise ModelError(f"{tok_file} has no added token {required}")
        eos_ids = _stop_ids(folder, special_ids)
        template_vars = {}
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            if (value := _token_str(config.get(name))) is not None:
                template_vars[name] = value
        template, source = _compile_template(folder, config)
        tok = cls(backend, template, template_vars, special_ids, eos_ids)
        tok.thinking_switch = "enable_thinking" in source
        return tok

    def encode(self, text: str) -> list[int]:
        # Special tokens written in the text (e.g. a rendered prompt) encode as their ids; no BOS.
        check_unicode(text, "the text")
        return self.backend.encode(text, add_special_tokens=False).ids

    def check_vocab(self, vocab_size: int, folder: Path | str) -> None:
        """Refuse a tokenizer whose ids reach past the model's vocabulary (the embedding rows
        config.json's vocab_size gives): such an id would index past the table."""
        top = max(self.backend.get_vocab(with_added_tokens=True).values(), default=-1)
        if top >= vocab_size:
            raise ModelError(f"{Path(folder) / 'tokenizer.json'}: token ids go up to {top}, but "
                             f"the model's vocabulary (config.json vocab_size) has {vocab_size}: "
                             "the tokenizer does not belong to these weights")

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The UTF-8 length of the longest vocabulary entry: a text of B bytes is at least
        B / (3 x this) tokens (3: what NFC composition can shrink a text by, at most)."""
        return max((len(t.encode("utf-8", "replace")) for t in self.backend.get_vocab()),
                   default=1)

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        variables: dict | None = None,
    ) -> str:
        """Render messages with the folder's chat template (same text as transformers').

        Args:
            messages: [{"role": "system"|"user"|"assistant", "content": str}, ...].
            add_generation_prompt: end with the opening of an assistant turn.
            enable_thinking: False closes an empty think block; None leaves the template default.
            variables: more template variables (`tools`, a request's chat_template_kwargs).
        """
        extra = dict(variables or {})
        if enable_thinking is not None:
            extra["enable_thinking"] = enable_thinking
        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **{**self.template_vars, **extra},
            )
        except jinja2.TemplateError as exc:
            raise ModelError(f"chat template failed: {exc}") from exc
        except (ArithmeticError, LookupError, TypeError, ValueError, RecursionError,
                MemoryError) as exc:
            # the template's own Python fails (a range past the sandbox's bound, 1/0, "a" + 1)
            raise ModelError(f"chat template failed: {type(exc).__name__}: {exc}") from exc


def check_unicode(text: str, what: str) -> None:
    """Refuse a lone surrogate (e.g. a JSON "\\ud800", or undecodable bytes in an argument):
    no tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise FtchatError(f"{what} is not valid Unicode: it holds a lone surrogate "
                          f"U+{ord(text[e.start]):04X} at character {e.start + 1}") from None


def _stop_ids(folder: Path, special_ids: dict[str, int]) -> frozenset[int]:
    # <|im_end|> ends a turn, <|endoftext|> a document; generation_config may name more.
    stop = {special_ids[IM_END], special_ids[ENDOFTEXT]}
    gen_file = folder / "generation_config.json"
    if gen_file.exists():
        eos = _read_json(gen_file).get("eos_token_id")
        stop.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return frozenset(stop)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelError(f"{path} is not a JSON object")
    return data


def _token_str(value: object) -> str | None:
    # tokenizer_config stores a special token as a string or as an AddedToken-like dict.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _compile_template(folder: Path, config: dict) -> tuple[jinja2.Template, str]:
    # As transformers: chat_template.jinja wins over the tokenizer_config entry.
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.exists():
        source, origin = jinja_file.read_text(encoding="utf-8"), jinja_file
    else:
        source, origin = config.get("chat_template"), folder / "tokenizer_config.json"
    if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
        source = next((t.get("template") for t in source
                       if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str):
        raise ModelError(f"{origin} has no chat_template")
    if not source.strip():
        raise ModelError(f"{origin}: the chat_template is empty; restore the model's template "
                         "(it turns messages into the prompt)")
    try:
        return _jinja_env().from_string(source), source
    except jinja2.TemplateError as exc:
        raise ModelError(f"bad chat_template in {origin}: {exc}") from exc


def _jinja_env() -> ImmutableSandboxedEnvironment:
    # The environment transformers renders chat templates in (see chat_template_utils).
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        # Jinja's own tojson HTML-escapes; chat templates expect plain json.dumps.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


# ===== streaming detokenizer =====

REPLACEMENT = "\ufffd"  # what a decode shows for bytes that are not (yet) a whole UTF-8 character
CONTEXT_IDS = 4  # ids kept before the pending ones, for decoders whose output depends on context
MAX_PENDING = 32  # past this many ids still ending in U+FFFD, give up holding back (see feed)


class StreamDecoder:
    """Turn generated ids into printable text, one id at a time.

    The outputs of `feed` plus `flush` concatenate to `tokenizer.decode(all_ids)`. Text is held
    back while the decode of the recent ids ends in U+FFFD (an unfinished UTF-8 character); each
    feed decodes only a window of recent ids, so the cost per token does not grow with the
    stream.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []  # context ids, then the ids not yet fully shown
        self.shown = 0  # characters of decode(self.ids) already returned

    def feed(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids)
        if not text.endswith(REPLACEMENT):
            # The last character is whole, so the byte stream is at a character boundary here:
            # restart the window with a few ids of context.
            out = text[self.shown :]
            self.ids = self.ids[-CONTEXT_IDS:]
            self.shown = len(self.tokenizer.decode(self.ids))
            return out
        if len(self.ids) > CONTEXT_IDS + MAX_PENDING:
            # A long run of invalid bytes (or literal U+FFFD): emit all and start afresh. Exact
            # unless an unfinished character sits at the very end of such a run.
            out = text[self.shown :]
            self.ids, self.shown = [], 0
            return out
        # Everything before the trailing U+FFFD run ends on a whole character, so it is final.
        stable = len(text.rstrip(REPLACEMENT))
        out = text[self.shown : stable] if stable > self.shown else ""
        self.shown = max(self.shown, stable)
        return out

    def flush(self) -> str:
        """Return the held-back rest (U+FFFD for bytes that never became a character)."""
        out = self.tokenizer.decode(self.ids)[self.shown :]
        self.ids, self.shown = [], 0
        return out


# ===== built-in training text =====

# A few KB of English and Python for the synthetic BPE merges; edits change every synthetic vocab.
_CORPUS = '''\
The quick brown fox jumps over the lazy dog. A model reads text as a list of tokens, and each
token is a small piece of a word, a whole word, a space or a sign. When you type a question,
the tokenizer splits it into pieces, the model predicts the next piece, and the program prints
it on the screen as soon as it becomes a whole character. Short words such as the, and, of, to,
in, is, it, that, with, for, on, as, was, this, be, at, by, from, are and have appear again and
again, so they become single tokens. Longer words are built from smaller parts: token, tokens,
tokenizer, tokenize, generation, generate, generated, prompt, prompts, message, messages, system,
user, assistant, answer, question, reason, reasoning, thinking, think, expert, experts, memory,
layer, layers, attention, hidden, state, cache, model, models.

Hello! How are you today? I am fine, thank you. What would you like to talk about? Let me think
about it for a moment. First, we read the question. Then we write down what we know. Finally,
we check the answer and explain it in plain words. Numbers like 1, 2, 3, 10, 42, 100, 2024 and
3.14 are split into single digits. Dates such as 2025-01-31 and times such as 12:30 work too.

def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]


class Counter:
    def __init__(self, start: int = 0) -> None:
        self.count = start

    def increment(self, step: int = 1) -> int:
        self.count += step
        return self.count


def read_lines(path: str) -> list[str]:
    with open(path, encoding="utf-8") as handle:
        return [line.rstrip("\\n") for line in handle if line.strip()]


for index, value in enumerate(fibonacci(10)):
    if value % 2 == 0:
        print(f"{index}: {value} is even")
    else:
        print(f"{index}: {value} is odd")

import json
import os

config = {"hidden_size": 2048, "num_layers": 48, "vocab_size": 248320}
with open(os.path.join("model", "config.json"), "w") as out:
    json.dump(config, out, indent=2)

The assistant answers the user. The user asks the assistant a question, and the assistant thinks
before it answers. If the answer is not known, the assistant says so. A good answer is short,
clear and correct. The system message sets the rules for the whole conversation, and every
message has a role and a content. The end of a message is marked by a special token.

Experts live in host memory and are copied to the GPU when the router picks them. The cache
keeps the experts that were used most recently, so the next token often finds them ready. When
an expert is missing, the layer waits for the copy to finish before it can compute the output.
'''
