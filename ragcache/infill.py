"""Fill-in-the-middle prompts (PSM, SPM, EFIM) and infilling sessions that keep reusing their cache.

PSM   <PRE>{prefix}<SUF>{suffix}<MID>
SPM   <PRE><SUF>{suffix}<MID>{prefix}            (the FIM paper's SPM as StarCoder was trained on it; for comparison)
EFIM  <PRE>{prefix[:i]}<SUF>{suffix}<MID>{prefix[i:]}
      prefix[:i] is the part already cached; the increment the user typed since goes after <MID>, so the
      whole `<PRE>..<MID>` stays an exact, reusable prefix. The mirror layout, for a suffix that grows at
      its head, is <SUF>{suffix[j:]}<PRE>{prefix}<MID>{suffix[:j]}... is not served: a suffix edit starts a
      new base (see InfillSession.plan).
Each part is tokenized alone and the prompt is the concatenation, as for RAG prompts, behind the BOS the
tokenizer puts before any text (DeepSeek-Coder's; Qwen2.5-Coder and StarCoder have none).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from .chunker import lead_ids, text_ids
from .errors import BadRequest, UnsupportedModel

# sentinel spellings by model family; the first whose three tokens are all in the vocabulary wins
FIM_SENTINELS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),  # Qwen2.5-Coder
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),  # StarCoder
    # DeepSeek-Coder: fullwidth bars (U+FF5C) and the sentencepiece space (U+2581)
    ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"),
)
FIM_END_TOKENS = (
    "<|endoftext|>",
    "<|fim_pad|>",
    "<|file_sep|>",
    "<|repo_name|>",
    "<file_sep>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
)
MODES = ("psm", "spm", "efim")
# EFIM keeps a session's base while the user types on, the typed text going after <MID>; past this many characters
# the base moves up to the prefix (one cache miss). A model serving EFIM is taught increments up to this long
# (`ragcache train infill`), and a base kept forever (a session begun on an empty file) would put every character
# typed since after <MID>, where the same prefix and suffix would get another prompt than in a fresh session.
MAX_INCREMENT_CHARS = 24
# the characters every session's prefix and suffix hold, together (up to 4 bytes each in a Python str)
MAX_SESSION_CHARS = 16 << 20


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    lead: tuple[int, ...] = ()  # before <PRE>: the tokenizer's BOS, where it puts one before any text

    @classmethod
    def for_tokenizer(cls, tokenizer, spelling: tuple[str, str, str] | None = None) -> FimTokens:
        vocab = tokenizer.get_vocab()
        for candidate in [spelling] if spelling else FIM_SENTINELS:
            if all(token in vocab for token in candidate):
                prefix, suffix, middle = (vocab[token] for token in candidate)
                return cls(prefix, suffix, middle, lead_ids(tokenizer))
        raise UnsupportedModel(
            "this model's tokenizer has no fill-in-the-middle sentinels (<|fim_prefix|>, <fim_prefix>, ...); "
            "use a FIM model such as qwen2.5-coder-0.5b or pass the sentinel spelling"
        )


def end_token_ids(tokenizer) -> set[int]:
    vocab = tokenizer.get_vocab()
    return {vocab[t] for t in FIM_END_TOKENS if t in vocab}


def _ids(tokenizer, text: str) -> list[int]:
    return text_ids(tokenizer, text)["input_ids"] if text else []  # a file that spells a sentinel keeps it text


def build_prompt(
    tokenizer, fim: FimTokens, prefix: str, suffix: str, mode: str = "efim", split: int | None = None
) -> list[int]:
    """Token ids of a FIM prompt. For EFIM, `split` is the cached part's length in characters (default: all)."""
    if mode == "psm":
        return [*fim.lead, fim.prefix, *_ids(tokenizer, prefix), fim.suffix, *_ids(tokenizer, suffix), fim.middle]
    if mode == "spm":
        return [*fim.lead, fim.prefix, fim.suffix, *_ids(tokenizer, suffix), fim.middle, *_ids(tokenizer, prefix)]
    if mode == "efim":
        i = len(prefix) if split is None else split
        return [
            *fim.lead,
            fim.prefix,
            *_ids(tokenizer, prefix[:i]),
            fim.suffix,
            *_ids(tokenizer, suffix),
            fim.middle,
            *_ids(tokenizer, prefix[i:]),
        ]
    raise BadRequest(f"unknown infill mode {mode!r}; choose one of {', '.join(MODES)}")


@dataclass
class SessionState:
    base_prefix: str  # prefix[:i], the cached part of the EFIM layout
    suffix: str
    mode: str
    last_used: float


class InfillSessions:
    """Per-session EFIM base, bounded in count and in characters (a session keeps its prefix and suffix: up to two
    documents' worth), and expiring after `ttl_s` of inactivity; the least recently used go first. The KV itself
    lives in the engine's prefix cache (bounded by bytes)."""

    def __init__(self, max_sessions: int = 256, ttl_s: float = 900.0, max_chars: int = MAX_SESSION_CHARS):
        self.max_sessions, self.ttl_s, self.max_chars = max_sessions, ttl_s, max_chars
        self._states: OrderedDict[str, SessionState] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def plan(self, session: str | None, prefix: str, suffix: str, mode: str) -> int | None:
        """The EFIM split for this round: keep the session's base while the user only appends to the prefix. Nothing
        is kept until `remember`: a round refused (too long) leaves the session as it was."""
        now = time.monotonic()
        with self._lock:
            for expired in [s for s, st in self._states.items() if now - st.last_used > self.ttl_s]:
                self._drop(expired)
            state = self._states.get(session) if session else None
            keep = (
                state is not None
                and state.mode == mode == "efim"
                and state.suffix == suffix
                and prefix.startswith(state.base_prefix)
                and len(prefix) - len(state.base_prefix) <= MAX_INCREMENT_CHARS
            )
            split = len(state.base_prefix) if keep else len(prefix)
            return split if mode == "efim" else None

    def remember(self, session: str | None, prefix: str, suffix: str, mode: str, split: int | None) -> None:
        """Keep this round's base (`plan`'s split of the prefix) for the session's next round."""
        if not session:
            return
        with self._lock:
            self._drop(session)
            base = prefix[:split] if split is not None else prefix
            self._states[session] = SessionState(base, suffix, mode, time.monotonic())
            self._chars += len(base) + len(suffix)
            while len(self._states) > self.max_sessions or (self._chars > self.max_chars and len(self._states) > 1):
                self._drop(next(iter(self._states)))

    def _drop(self, session: str) -> None:
        state = self._states.pop(session, None)
        if state is not None:
            self._chars -= len(state.base_prefix) + len(state.suffix)

    def __len__(self) -> int:
        return len(self._states)
