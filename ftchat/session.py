"""The engine's public session object: the one thing the UI talks to.

A Session holds the loaded model, its tokenizer, the settings, the expert backend and, for
interactive chat, the conversation's DecodeState. It turns token ids into a stream of StepRecords
(one per generated token) that carry everything the panel shows.
Legend: B batch, V vocab.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ftchat import engine
from ftchat.debug.watchers import hooks_for
from ftchat.errors import FtchatError
from ftchat.kernels.config import KernelConfig
from ftchat.model.config import check_context
from ftchat.model.expert_backend import ExpertBackend
from ftchat.model.registry import load_args
from ftchat.model.tokenizer import IM_END, StreamDecoder, Tokenizer, check_unicode
from ftchat.offload.hooks import Hooks
from ftchat.sampling import Sampler, Sampling
from ftchat.settings import Settings
from ftchat.vram.workloads import run_context

STATS_EVERY_S = 0.5  # backend stats may sync the device: read them at most this often
TURN_SEPARATOR = "\n"  # what ChatML puts between a turn's <|im_end|> and the next <|im_start|>
WARM_UP_TOKENS = 8  # the warm-up's prefill: the prompt path once (its kernels compile)


def build_experts(model: engine.LoadedModel, settings: Settings,
                  hooks: Hooks | None = None) -> ExpertBackend:
    """The backend the settings ask for (all resident when every expert fits), watched by the
    debug hooks the settings turn on (`watchers`, unless given)."""
    return engine.build_experts(model, settings, hooks or watchers(model, settings))


def watchers(model: engine.LoadedModel, settings: Settings) -> Hooks | None:
    """The debug hooks the settings turn on (None: none)."""
    return hooks_for(settings, model.args.num_hidden_layers, engine.num_slots(model, settings),
                     model.device)


@dataclass(frozen=True)
class Figures:
    """Throughput and memory of the current call (a batch, or one chat reply)."""

    prefill_tokens: int
    prefill_s: float
    decode_tokens: int  # tokens from decode steps (each reply's first token comes from prefill)
    decode_s: float
    tokens: int  # generated so far in this call, every sequence
    context: int  # tokens held by the longest sequence
    max_context: int
    vram_used: int | None = None  # bytes, CUDA only
    vram_peak: int | None = None
    offload: Mapping[str, float] = field(default_factory=dict)  # backend stats(), if it has them

    @property
    def prefill_tps(self) -> float | None:
        return self.prefill_tokens / self.prefill_s if self.prefill_tokens and self.prefill_s > 0 \
            else None

    @property
    def decode_tps(self) -> float | None:
        return self.decode_tokens / self.decode_s if self.decode_tokens and self.decode_s > 0 \
            else None


@dataclass(frozen=True)
class StepRecord:
    """One generated token of sequence `seq` (its index in the prompts; 0 in chat)."""

    seq: int
    token: int
    n: int  # tokens generated for this sequence so far, this one included
    stop: str | None  # None, or why the sequence ends here: eos | length | context | stop_string
    prompt_tokens: int
    prefill_s: float  # this sequence's prefill
    decode_s: float  # since this sequence's first token
    figures: Figures
    seed: int | None = None  # the sampling seed of this sequence (None: greedy)


class StopText:
    """Stop strings over a reply's decoded text: `feed` takes the text pieces as they decode
    and returns what is safe to show, holding back an end that may be the start of a stop
    string; once the text contains one, `hit` is that string and the text ends just before it.
    The rule on the whole text is `cut`: everything before the first stop string found."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.held = ""
        self.hit: str | None = None

    @staticmethod
    def find(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
        """(index, stop string) of the earliest stop string in `text`, if any."""
        found = [(i, s) for s in stops if (i := text.find(s)) >= 0]
        return min(found, key=lambda f: (f[0], len(f[1]))) if found else None

    @classmethod
    def cut(cls, text: str, stops: Sequence[str]) -> str:
        found = cls.find(text, stops)
        return text if found is None else text[: found[0]]

    def feed(self, piece: str) -> str:
        if self.hit is not None or not self.stops:
            return "" if self.hit is not None else piece
        self.held += piece
        found = self.find(self.held, self.stops)
        if found is not None:
            out, self.hit, self.held = self.held[: found[0]], found[1], ""
            return out
        # the longest end of the held text that starts a stop string: no longer than the held
        # text (a 1 MB stop string must not cost a million slices a token)
        keep = max((k for s in self.stops for k in range(1, min(len(s), len(self.held) + 1))
                    if self.held.endswith(s[:k])), default=0)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep:]
        return out

    def flush(self) -> str:
        out, self.held = ("" if self.hit is not None else self.held), ""
        return out


class _StopWatch:
    """Decodes one sequence's tokens to find where its text first holds a stop string."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str]):
        self.decoder, self.text = StreamDecoder(tokenizer), StopText(stops)

    def hit(self, token: int) -> bool:
        self.text.feed(self.decoder.feed(token))
        return self.text.hit is not None


class _StatsThrottle:
    """Backend stats may sync the device: read them at most every STATS_EVERY_S."""

    def __init__(self, experts: ExpertBackend):
        self.experts = experts
        self.stats: dict[str, float] = {}
        self.at = -1e9

    def __call__(self, force: bool) -> dict[str, float]:
        if force or time.perf_counter() - self.at > STATS_EVERY_S:
            self.stats, self.at = dict(self.experts.stats()), time.perf_counter()
        return self.stats


class Session:
    """A loaded model ready to generate; for chat it also keeps the conversation."""

    def __init__(self, model: engine.LoadedModel, tokenizer: Tokenizer, settings: Settings,
                 experts: ExpertBackend, hooks: Hooks | None = None):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.experts, self.hooks = experts, hooks
        a = model.args
        check_context(a, settings.context)
        self.max_len = run_context(a, settings)  # --context, else the model's up to 32K
        self.im_end = tokenizer.special_ids[IM_END]
        # ===== conversation (chat) =====
        self._chat: engine.Decoder | None = None
        self._batch: dict[int, engine.Decoder] = {}
        self.length = 0  # tokens in the conversation's state
        self._pending: list[int] = []  # tokens of the last reply not yet in the state

    @classmethod
    def open(cls, folder: str | Path, settings: Settings,
             progress: Callable[[str, int, int], None] | None = None) -> Session:
        """Load `folder` on the settings' device and dtype.

        Args:
            folder: a checkpoint folder (config.json, safetensors, tokenizer files).
            progress: called as (stage, done, total) while the weights load.
        """
        device, dtype = settings.torch_device(), settings.torch_dtype()
        tokenizer = Tokenizer.from_folder(folder)  # cheap: fails before the weights load
        tokenizer.check_vocab(load_args(folder).vocab_size, folder)
        if settings.think is not None and not tokenizer.thinking_switch:
            flag = "--think" if settings.think else "--no-think"
            raise FtchatError(f"{flag}: the chat template of {folder} has no thinking switch "
                              "(enable_thinking); drop the flag")
        model = engine.load_model(folder, str(device), dtype, progress,
                                  kernels=KernelConfig.from_settings(settings))
        hooks = watchers(model, settings)
        try:
            return cls(model, tokenizer, settings, build_experts(model, settings, hooks), hooks)
        except BaseException:  # a refused setting: the routing record's file goes too
            if hooks is not None:
                hooks.discard()
            raise

    def close(self, complete: bool = True) -> None:
        """Release what the backend holds open (debug recorders, files). A result file is
        renamed into place; not `complete` (an error or a signal stopped the run): dropped."""
        if not complete and self.hooks is not None:
            self.hooks.discard()
        self.experts.close()

    def describe(self) -> str:
        a, m = self.model.args, self.model
        n_attn = sum(a.is_attention(i) for i in range(a.num_hidden_layers))
        dtype = str(m.dtype).removeprefix("torch.")
        return (f"{a.num_hidden_layers} layers ({a.num_hidden_layers - n_attn} GDN, {n_attn} "
                f"attention), {a.num_experts} experts top-{a.num_experts_per_tok} "
                f"({m.layout.kind} rows), {m.device.type} {dtype}, context {self.max_len}"
                + (" (K/V cache fp8)" if self.settings.kv_cache_dtype == "fp8" else "")
                + f", experts: {type(self.experts).__name__}")

    def warms_up(self) -> bool:
        """Whether `warm_up` pays off: CUDA (Triton compiles, graph capture, cuBLAS and allocator
        first calls) and no debug watcher (a recorder would log the warm-up's tokens)."""
        return self.model.device.type == "cuda" and not self.settings.watched()

    def warm_up(self, rows: int | None = None) -> float:
        """Before the first prompt: make the decoder a reply will use (the chat one, or the batch
        one of `rows` rows; its CUDA graph capture runs the decode kernels once) and prefill a
        few tokens through the prompt path, then clear the state and the expert cache: replies
        are those of a cold session, and their prompt eval times the prefill alone. Seconds."""
        t = time.perf_counter()
        if rows is None:
            if self._chat is None:
                self._chat = self._new_decoder(1)
            dec = self._chat
        else:
            dec = self._decoder(rows)
        n = min(WARM_UP_TOKENS, self.max_len)
        dec.prefill(0, torch.full((n,), self.im_end, dtype=torch.long), 0)
        dec.reset()  # the state and the expert cache (and its figures)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        return time.perf_counter() - t

    # ===== prompts =====
    def encode_messages(self, messages: list[dict], what: str = "the prompt") -> list[int]:
        """Token ids of `messages` rendered with the chat template, assistant turn opened.
        A text too long for the context by its byte count alone is refused before it is
        tokenized (`what` names it in the error)."""
        text = self.tokenizer.render_chat(self._checked(messages, what),
                                          enable_thinking=self.settings.think)
        return self._encode(text, what)

    def turn_ids(self, user: str, system: str | None = None) -> list[int]:
        """Ids of the next chat turn: the whole first prompt, then only the new user turn."""
        if self.length == 0 and not self._pending:
            sys_msg = [{"role": "system", "content": system}] if system else []
            return self.encode_messages([*sys_msg, {"role": "user", "content": user}])
        user_msg = self._checked([{"role": "user", "content": user}], "the message")
        turn = self.tokenizer.render_chat(user_msg, enable_thinking=self.settings.think)
        return self._encode(TURN_SEPARATOR + turn, "the message")

    def _checked(self, messages: list[dict], what: str) -> list[dict]:
        for m in messages:
            check_unicode(m["content"], f"{what}'s {m['role']} text")
        text_bytes = sum(len(m["content"].encode("utf-8")) for m in messages)
        fewest = text_bytes // (3 * self.tokenizer.max_token_bytes)
        if fewest > self.max_len:
            raise FtchatError(f"{what} is {text_bytes:,} bytes, at least {fewest:,} tokens: more "
                              f"than the context ({self.max_len}); shorten it or raise --context")
        return messages

    def _encode(self, text: str, what: str) -> list[int]:
        ids = self.tokenizer.encode(text)
        if not ids:
            raise FtchatError(f"{what} renders to no tokens: the model's chat template wrote "
                              "nothing for it")
        return ids

    def check_prompt(self, n: int, what: str) -> None:
        """Refuse a prompt of `n` tokens that is empty or longer than the context."""
        if n == 0:
            raise FtchatError(f"{what} is empty")
        if n > self.max_len:
            raise FtchatError(f"{what} has {n} tokens, more than the context ({self.max_len}): "
                              "shorten it or raise --context")

    # ===== batch =====
    def generate_batch(self, prompts: Sequence[Sequence[int]],
                       max_new_tokens: int | Sequence[int] | None = None,
                       stop_ids: frozenset[int] | None = None,
                       stop_strings: Sequence[str] | Sequence[Sequence[str]] | None = None,
                       sampling: Sampling | Sequence[Sampling] | None = None,
                       ) -> Iterator[StepRecord]:
        """Replies to independent prompts (greedy unless `sampling` says otherwise), up to
        batch_size decoded together.

        Args:
            prompts: token ids per prompt (already chat-rendered).
            max_new_tokens: one limit, or one per prompt; None: the settings' limit.
            stop_ids: a sequence ends on any of these (default: the tokenizer's eos ids).
            stop_strings: one list of stop strings, or one per prompt (None: the settings');
                a sequence ends at the token whose text completes one (stop "stop_string").
            sampling: one Sampling, or one per prompt (None: the settings'); each sampled
                prompt draws from its own generator, seeded once (a random seed if none).
        Yields a record per token of every unfinished sequence; the last record of a sequence has
        `stop` set. Prompts go in chunks of batch_size, in order.
        """
        n = len(prompts)
        limit = self.settings.max_new_tokens if max_new_tokens is None else max_new_tokens
        limits = [limit] * n if isinstance(limit, int) else list(limit)
        if len(limits) != n or min(limits, default=1) < 1:
            raise FtchatError("max_new_tokens: need one positive limit per prompt")
        for i, p in enumerate(prompts):
            self.check_prompt(len(p), f"prompt {i + 1}")
        stops = self.tokenizer.eos_ids if stop_ids is None else frozenset(stop_ids)
        strings = self.settings.stop if stop_strings is None else stop_strings
        if not strings or isinstance(strings[0], str):
            strings = [tuple(strings)] * n
        params = self._sampling(sampling, n)
        if len(strings) != n or len(params) != n:
            raise FtchatError("stop_strings, sampling: need one per prompt")
        return self._generate(prompts, limits, stops, [tuple(x) for x in strings], params)

    def _sampling(self, sampling: Sampling | Sequence[Sampling] | None, n: int) -> list[Sampling]:
        if sampling is None:
            sampling = Sampling.from_settings(self.settings)
        params = [sampling] * n if isinstance(sampling, Sampling) else list(sampling)
        return [p.with_seed() for p in params]  # one seed per request, fixed now

    def _generate(self, prompts, limits, stops, strings, params) -> Iterator[StepRecord]:
        B = self.settings.batch_size
        for first in range(0, len(prompts), B):
            seqs = range(first, min(first + B, len(prompts)))
            yield from self._chunk(seqs, [list(prompts[s]) for s in seqs],
                                   [limits[s] for s in seqs], stops,
                                   [strings[s] for s in seqs], [params[s] for s in seqs])

    def _decode(self, dec: engine.Decoder, prompts: list[list[int]], starts: list[int],
                limits: list[int], stops: frozenset[int], params: list[Sampling],
                on_prefill: Callable[[int, int], None] | None = None):
        """engine.decode, with a Sampler when any row samples (and on_prefill when given)."""
        extra = {} if on_prefill is None else {"on_prefill": on_prefill}
        if all(p.greedy for p in params):
            return engine.decode(dec, prompts, starts, limits, stops, **extra)
        chooser = Sampler(params, prompts, self.model.device)
        return engine.decode(dec, prompts, starts, limits, stops, choose=chooser, **extra)

    def _chunk(self, seqs: range, prompts: list[list[int]], limits: list[int],
               stops: frozenset[int], strings: list[tuple[str, ...]],
               params: list[Sampling]) -> Iterator[StepRecord]:
        m, dec = self.model, self._decoder(len(prompts))
        stats = _StatsThrottle(self.experts)
        watch = [_StopWatch(self.tokenizer, s) if s else None for s in strings]
        ended = [False] * len(prompts)  # by a stop string (the engine does not know)
        steps = self._decode(dec, prompts, [0] * len(prompts), limits, stops, params)
        try:
            for step in steps:
                reasons = list(step.stops)
                for b, tok in enumerate(step.tokens):
                    if step.active[b] and not ended[b] and watch[b] is not None \
                            and reasons[b] != "eos" and watch[b].hit(tok):
                        reasons[b] = "stop_string"
                live = [a and not e for a, e in zip(step.active, ended)]
                final = all(not a or r is not None for a, r in zip(live, reasons))
                fig = Figures(sum(map(len, prompts)), sum(step.prefill_s), step.decode_tokens,
                              step.decode_s, sum(step.n), max(step.lengths), dec.state.max_len,
                              *_vram(m.device), stats(force=final))
                for b, tok in enumerate(step.tokens):
                    if live[b]:
                        ended[b] = reasons[b] is not None
                        yield StepRecord(seqs[b], tok, step.n[b], reasons[b], len(prompts[b]),
                                         step.prefill_s[b], step.decode_s, fig,
                                         params[b].seed if params[b].sampled else None)
                if final:
                    break  # every row has ended (some by a stop string): no more steps
        finally:
            steps.close()

    # ===== chat =====
    @property
    def context_used(self) -> int:
        return self.length + len(self._pending)

    def reset(self) -> None:
        """Forget the conversation."""
        if self._chat is not None:
            self._chat.state.reset(slice(0, 1), self.model.args.eos_token_id or 0)
        self.length, self._pending = 0, []

    def chat(self, ids: Sequence[int], on_prefill: Callable[[int, int], None] | None = None
             ) -> Iterator[StepRecord]:
        """The reply to a new turn `ids` (see turn_ids), continuing the conversation's state.

        Only the new turn is prefilled; `on_prefill(done, total)` follows it chunk by chunk.
        Closing the iterator early (Ctrl-C) ends the reply cleanly: the tokens shown so far
        stay in the conversation, closed by <|im_end|>.
        """
        turn = [*self._pending, *ids]
        if not ids:
            raise FtchatError("empty turn")
        if self.length + len(turn) > self.max_len:
            if self.length == 0:
                self.check_prompt(len(turn), "the prompt")
            raise FtchatError(f"the conversation is full ({self.length} of {self.max_len} tokens "
                              f"used, the new turn needs {len(turn)}): /reset to start over")
        if self._chat is None:
            self._chat = self._new_decoder(1)
        return self._reply(self._chat, turn, on_prefill)

    def _new_decoder(self, rows: int) -> engine.Decoder:
        return engine.Decoder(self.model, self.experts, rows, self.max_len,
                              graph=self.settings.use_graph(),
                              prefill_chunk=self.settings.prefill_chunk,
                              kv_dtype=self.settings.kv_torch_dtype())

    def _decoder(self, batch: int) -> engine.Decoder:
        """The batch decoder of `batch` rows (made once: a CUDA graph is captured per size)."""
        dec = self._batch.get(batch)
        if dec is None:
            dec = self._batch[batch] = self._new_decoder(batch)
        else:
            dec.reset(experts=False)  # a warm expert cache stays warm across prompt chunks
        return dec

    def _reply(self, dec: engine.Decoder, turn: list[int],
               on_prefill: Callable[[int, int], None] | None = None) -> Iterator[StepRecord]:
        m, stats = self.model, _StatsThrottle(self.experts)
        params = self._sampling(None, 1)
        watch = _StopWatch(self.tokenizer, self.settings.stop) if self.settings.stop else None
        steps = self._decode(dec, [turn], [self.length], [self.settings.max_new_tokens],
                             self.tokenizer.eos_ids, params, on_prefill)
        seed = params[0].seed if params[0].sampled else None
        tok = None  # the last token shown: the loop feeds it only if it runs on
        try:
            for step in steps:
                # the turn (and every token shown before this one) is in the state now
                self.length, self._pending = step.lengths[0], []
                tok, stop = step.tokens[0], step.stops[0]
                if watch is not None and stop != "eos" and watch.hit(tok):
                    stop = "stop_string"
                fig = Figures(len(turn), step.prefill_s[0], step.decode_tokens, step.decode_s,
                              step.n[0], self.length, self.max_len, *_vram(m.device),
                              stats(force=stop is not None))
                yield StepRecord(0, tok, step.n[0], stop, len(turn), step.prefill_s[0],
                                 step.decode_s, fig, seed)
                if stop is not None:
                    break  # a stop string: the engine would go on
        except GeneratorExit:
            pass  # closed at a yield: the state is whole, `tok` was shown but not fed
        except BaseException:
            self.reset()  # interrupted inside a step: the state is half-written
            raise
        finally:
            steps.close()
        if tok is not None:
            # The turn ends with <|im_end|> (it replaces a stop token); fed with the next turn.
            stops = self.tokenizer.eos_ids
            self._pending = [self.im_end] if tok in stops else [tok, self.im_end]


def _vram(device: torch.device) -> tuple[int | None, int | None]:
    if device.type != "cuda":
        return None, None
    return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)

