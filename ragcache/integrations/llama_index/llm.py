"""RagCacheLLM: plain completions from the ragcache engine (a query with no documents), for llama-index code that
wants an LLM (Settings.llm, synthesizers, agents). The system prompt is the model's chat-template system turn."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from llama_index.core.base.llms.types import CompletionResponse, CompletionResponseGen, LLMMetadata
from llama_index.core.bridge.pydantic import Field
from llama_index.core.llms.callbacks import llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from ragcache.engine import Stream
from ragcache.front import Front
from ragcache.settings import DEFAULT_ALGORITHM

# Per-call overrides `complete(prompt, **kwargs)` accepts; anything else llama-index passes along is ignored.
_OVERRIDES = ("algorithm", "k", "ratio", "max_new_tokens", "temperature", "top_p", "stop", "seed", "system")


class RagCacheLLM(CustomLLM):
    """`complete(prompt)` is rc.query(prompt, docs=[], system=llm.system_prompt); the CompletionResponse carries the
    QueryStats (as a dict) in `raw["stats"]` (streaming: on the last response). `chat` goes through
    `messages_to_prompt`; per-call keyword arguments (max_new_tokens, temperature, stop, ...) override the fields.

    The default algorithm is the engine's (focus): with no documents it links only the cached system prefix and
    computes the prompt, which is what `full` computes too."""

    rc: Front = Field(exclude=True, description="the engine that generates")
    algorithm: str = DEFAULT_ALGORITHM
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    stop: list[str] | None = None
    seed: int | None = None

    @classmethod
    def class_name(cls) -> str:
        return "RagCacheLLM"

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(context_window=self.rc.context_length, num_output=self.max_new_tokens,
                           is_chat_model=False, model_name=self.rc.model_name)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        stream = self._stream(prompt, formatted, kwargs)
        return CompletionResponse(text="".join(stream), raw={"stats": stream.answer.stats.as_dict()})

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return _responses(self._stream(prompt, formatted, kwargs))

    def _stream(self, prompt: str, formatted: bool, kwargs: dict) -> Stream:
        # A formatted prompt (predict, chat) already carries the system prompt as text; a raw one gets it as the
        # model's system turn.
        system = None if formatted else self.system_prompt
        if not formatted:
            prompt = self.completion_to_prompt(prompt)
        args = dict(algorithm=self.algorithm, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                    top_p=self.top_p, stop=self.stop, seed=self.seed, system=system)
        args.update({key: kwargs[key] for key in _OVERRIDES if key in kwargs})
        return self.rc.stream(prompt, docs=[], **args)


def _responses(stream: Stream) -> Iterator[CompletionResponse]:
    """One response per text piece; the last one is held back until the stream ends, to carry the stats."""
    text, held = "", None
    for piece in stream:
        if held is not None:
            yield held
        text += piece
        held = CompletionResponse(text=text, delta=piece)
    last = held or CompletionResponse(text="", delta="")
    last.raw = {"stats": stream.answer.stats.as_dict()}
    yield last
