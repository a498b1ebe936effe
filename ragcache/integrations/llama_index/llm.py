"""RagCacheLLM: plain completions from the ragcache engine (a query with no documents), for llama-index code that
wants an LLM (Settings.llm, synthesizers, agents). The system prompt is the model's chat-template system turn."""

from __future__ import annotations

import asyncio
import collections.abc
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any

from llama_index.core.base.llms.generic_utils import (
    astream_completion_response_to_chat_response,
    completion_response_to_chat_response,
)
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
)
from llama_index.core.bridge.pydantic import ConfigDict, Field
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from ragcache.engine import Sequence, apieces
from ragcache.errors import BadRequest
from ragcache.front import Front, answer_of
from ragcache.linker import LinkOptions
from ragcache.settings import LinkKnobs

# Per-call overrides `complete(prompt, **kwargs)` accepts; anything else is refused (llama-index passes a plain
# LLM only what its caller gave as llm_kwargs: `max_tokens` for max_new_tokens would be ignored)
_OVERRIDES = (*LinkKnobs.model_fields, "max_new_tokens", "temperature", "top_p", "stop", "seed", "system")


class RagCacheLLM(CustomLLM, LinkOptions):
    """`complete(prompt)` is rc.query(prompt, docs=[], system=llm.system_prompt); the CompletionResponse carries the
    QueryStats (as a dict) in `raw["stats"]` (streaming: on a last response with an empty delta). `chat` goes through
    `messages_to_prompt`; per-call keyword arguments (max_new_tokens, temperature, stop, ...) override the fields.
    The async methods keep the event loop free while the engine works, and a caller that stops reading a stream
    (or cancels its task) stops the generation.

    The default algorithm is the engine's (focus): with no documents it links only the cached system prefix and
    computes the prompt, which is what `full` computes too."""

    model_config = ConfigDict(extra="forbid")  # a misspelt field is an error, not ignored

    rc: Front = Field(exclude=True, description="the engine that generates")
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
        # llama-index packs a prompt's text up to context_window - num_output tokens: the window is what the chat
        # template, its system turn and the question's framing leave of the model's context. Its synthesizers send
        # formatted prompts, which get the template's own system turn (system=None), longer than a short one's
        around = max(
            (self.rc.prompt_parts("", [], system=system) for system in {None, self.system_prompt}),
            key=lambda parts: len(parts.prefix_ids) + len(parts.question_ids),
        )
        return LLMMetadata(
            context_window=self.rc.context_length - len(around.prefix_ids) - len(around.question_ids),
            num_output=self.max_new_tokens,
            is_chat_model=False,
            model_name=self.rc.model_name,
        )

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        stream = self._stream(prompt, formatted, kwargs)
        return CompletionResponse(text="".join(stream), raw={"stats": answer_of(stream).stats.as_dict()})

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        return _responses(self._stream(prompt, formatted, kwargs))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        stream = await asyncio.to_thread(self._stream, prompt, formatted, kwargs)
        text = "".join([piece async for piece in apieces(stream)])
        return CompletionResponse(text=text, raw={"stats": answer_of(stream).stats.as_dict()})

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        stream = await asyncio.to_thread(self._stream, prompt, formatted, kwargs)
        return _aresponses(stream)

    @llm_chat_callback()
    async def achat(self, messages: collections.abc.Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        completion = await self.acomplete(self.messages_to_prompt(messages), formatted=True, **kwargs)
        return completion_response_to_chat_response(completion)

    @llm_chat_callback()
    async def astream_chat(
        self, messages: collections.abc.Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        completions = await self.astream_complete(self.messages_to_prompt(messages), formatted=True, **kwargs)
        return astream_completion_response_to_chat_response(completions)

    def _stream(self, prompt: str, formatted: bool, kwargs: dict) -> Sequence:
        # A formatted prompt (predict, chat) already carries the system prompt as text; a raw one gets it as the
        # model's system turn.
        unknown = sorted(set(kwargs) - set(_OVERRIDES))
        if unknown:
            raise BadRequest(
                f"RagCacheLLM got unknown argument(s) {', '.join(unknown)}; it takes {', '.join(_OVERRIDES)}"
            )
        system = None if formatted else self.system_prompt
        if not formatted:
            prompt = self.completion_to_prompt(prompt)
        args = dict(
            **self.knobs(),
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stop=self.stop,
            seed=self.seed,
            system=system,
        )
        args.update({key: kwargs[key] for key in _OVERRIDES if key in kwargs})
        return self.rc.stream(prompt, docs=[], **args)


def _responses(stream: Sequence) -> Iterator[CompletionResponse]:
    """One response per text piece as it comes, then one with an empty delta that carries the stats."""
    text = ""
    for piece in stream:
        text += piece
        yield CompletionResponse(text=text, delta=piece)
    yield CompletionResponse(text=text, delta="", raw={"stats": answer_of(stream).stats.as_dict()})


async def _aresponses(stream: Sequence) -> AsyncIterator[CompletionResponse]:
    """`_responses` for asyncio code; closed early, it cancels the request at once (not when the collector runs)."""
    text = ""
    async with aclosing(apieces(stream)) as pieces:
        async for piece in pieces:
            text += piece
            yield CompletionResponse(text=text, delta=piece)
    yield CompletionResponse(text=text, delta="", raw={"stats": answer_of(stream).stats.as_dict()})
