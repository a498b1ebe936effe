"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

ragcache's inputs travel as extra body fields, so the official client works unchanged:
    client.chat.completions.create(model=..., messages=[...],
                                   extra_body={"documents": [ids or texts], "ragcache": {"algorithm": "focus"}})
A chat is one question: an optional system (or developer) message, then one user message."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from fastapi import APIRouter, Request

from ragcache.engine import Answer
from ragcache.settings import LinkKnobs

from .answering import Context, ctx
from .body import Body, documented
from .engine_queue import EventStream
from .errors import OPENAI_WITH_BODY, ApiError, clip_repr, responses
from .native import sse_events, streamed
from .schemas import ChatMessage, ChatRequest, CompletionRequest, ModelCard, ModelList, OpenAIFields

router = APIRouter(prefix="/v1", tags=["openai"])

# OpenAI parameters ragcache cannot honour: accepted only at these (neutral) values
UNSUPPORTED = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none", "auto"),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0),
    "response_format": (None, {"type": "text"}),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    # vLLM's extra sampling fields, which its OpenAI server takes: at their neutral values only, as above
    "top_k": (None, -1, 0),
    "min_p": (None, 0),
    "repetition_penalty": (None, 1),
    "min_tokens": (None, 0),
    "ignore_eos": (None, False),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    "stop_token_ids": (None, []),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "logits_processors": (None, []),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    "guided_decoding_backend": (None,),
    "guided_whitespace_pattern": (None,),
    "structured_outputs": (None,),
    "chat_template": (None,),
    "chat_template_kwargs": (None, {}),
    "continue_final_message": (None, False),
    "add_generation_prompt": (None, True),
}


# ragcache's own fields where an OpenAI body does not take them: refused, or the answer would silently go without
# them (a default link, no documents). Other unknown fields stay allowed, as OpenAI's clients send their own.
MISPLACED = {
    **{knob: f'send link options inside "ragcache": {{"{knob}": ...}}' for knob in LinkKnobs.model_fields},
    **{name: 'document ids (or {"text": ...}) go in "documents"' for name in ("docs", "document", "document_ids")},
    "question": 'the question is the last user message (chat) or "prompt" (completions)',
}


def _neutral(value: object, neutral: tuple) -> bool:
    """One of the neutral values, a boolean only where a boolean is: `logprobs: 0` asks for the sampled tokens'
    logprobs (0 == False in Python), `n: true` is no count."""
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in neutral)


def unsupported(param: str, message: str) -> ApiError:
    return ApiError(422, "unsupported_parameter", message, param=param)


def _served(c: Context, model: str) -> None:
    """404 unless `model` names the model served here (its name, or the one in the settings)."""
    if model not in (c.rc.model_name, c.settings.model):
        raise ApiError(
            404,
            "model_not_found",
            f"model {clip_repr(model)} is not served here; this server serves {c.rc.model_name!r} (GET /v1/models)",
            param="model",
        )


def _check(c: Context, body: OpenAIFields) -> None:
    if body.model:
        _served(c, body.model)
    for name, value in (body.model_extra or {}).items():
        if name in UNSUPPORTED and not _neutral(value, UNSUPPORTED[name]):
            raise unsupported(name, f"{name}={clip_repr(value)} is not supported by ragcache")
        if name in MISPLACED or (name == "system" and isinstance(body, ChatRequest)):
            where = MISPLACED.get(name, 'a chat\'s system prompt is a message with role "system"')
            raise unsupported(name, f"{name!r} is not a field of this request: {where}")
    if body.stream_options is not None and not body.stream:
        raise unsupported("stream_options", "stream_options is only allowed when stream is true")


def usage(answer: Answer) -> dict:
    st = answer.stats
    return {
        "prompt_tokens": st.prompt_tokens,
        "completion_tokens": st.completion_tokens,
        "total_tokens": st.prompt_tokens + st.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": st.cached_tokens},
    }


def ragcache_info(answer: Answer) -> dict:
    st = answer.stats
    return {
        "algorithm": st.algorithm,
        "recomputed_tokens": st.recomputed_tokens,
        "queue_s": st.wait_s,
        "ttft_s": st.ttft_s,
        "total_s": st.total_s,
    }


@router.get("/models", response_model=ModelList, responses=responses())
def list_models(request: Request) -> ModelList:
    c = ctx(request)
    profile, adapter = c.rc.profile, c.rc.lm.adapter  # the adapter's own calibration is `profile`
    link = {
        "default_algorithm": c.rc.resolve(c.settings).algorithm,  # what a request naming none links with
        "default_k": c.rc.default_k,
        "default_focus_ratio": c.rc.default_focus_ratio,
        "calibrated": profile is not None and profile.k is not None,
        "kv_codec": c.rc.kv_codec,
        # its folder's name, not its path: a client has no business with the server's file system
        "adapter": adapter
        and {"sha256": adapter.sha256, "name": adapter.path.resolve().name, "merged": adapter.merged},
    }
    if profile is not None:
        link.update(
            target=profile.target,
            agreement_by_k=profile.agreement_by_k,
            calibration_items=profile.items,
            focus_ratio=profile.focus_ratio,
            agreement_by_focus=profile.agreement_by_focus,
            calibrated_at=profile.at,
        )
    return ModelList(data=[ModelCard(id=c.rc.model_name, created=request.app.state.created, ragcache=link)])


@router.get("/models/{model:path}", response_model=ModelCard, responses=responses(404))  # hub ids hold a "/"
def retrieve_model(request: Request, model: str) -> ModelCard:
    """The served model's card (as in GET /v1/models), under its name or the one in the settings."""
    _served(ctx(request), model)
    return list_models(request).data[0]


@router.post(
    "/completions",
    openapi_extra=documented(CompletionRequest),
    responses={**streamed("text_completion chunks"), **responses(*OPENAI_WITH_BODY, 400, 404, 429, 503)},
)
async def completions(request: Request, body: CompletionRequest = Body(CompletionRequest, answered=True)):
    """The prompt is the question; documents and link options come as extra body fields."""
    c = ctx(request)
    _check(c, body)
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise unsupported("prompt", f"one prompt per request, got a list of {len(prompt)}")
        prompt = prompt[0]
    query = await c.query(request, prompt, body.documents, body.system, body.ragcache, body)
    return await _respond(
        request,
        c,
        body,
        query,
        "cmpl",
        ("text_completion", "text_completion"),
        lambda text: {"text": text},
        lambda piece: {"text": piece or ""},
    )


def _text(message: ChatMessage, i: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts = []
    for part in message.content:
        if part.type != "text":
            raise unsupported(
                f"messages[{i}].content", f"only text content parts are supported, got {clip_repr(part.type)}"
            )
        if part.text is None:
            raise unsupported(f"messages[{i}].content", "a text content part needs its text")
        texts.append(part.text)
    return "\n".join(texts)  # parts are blocks (a context, then the question): not run into one another


def chat_question(messages: list[ChatMessage]) -> tuple[str | None, str]:
    """(system prompt, question) from [system?, user]; other conversations cannot be linked as one question."""
    rest, system = list(messages), None
    if rest and rest[0].role in ("system", "developer"):
        system = _text(rest.pop(0), 0)
    if len(rest) != 1 or rest[0].role != "user":
        roles = [m.role for m in messages]
        raise unsupported(
            "messages",
            "ragcache answers one question from documents: send an optional system (or "
            "developer) message followed by exactly one user message; got roles "
            f"{clip_repr(roles)}",
        )
    return system, _text(rest[0], len(messages) - 1)


@router.post(
    "/chat/completions",
    openapi_extra=documented(ChatRequest),
    responses={**streamed("chat.completion.chunk objects"), **responses(*OPENAI_WITH_BODY, 400, 404, 429, 503)},
)
async def chat_completions(request: Request, body: ChatRequest = Body(ChatRequest, answered=True)):
    """The last user message is the question, a leading system message the system prompt."""
    c = ctx(request)
    _check(c, body)
    system, question = chat_question(body.messages)
    # a chat request that names no max_tokens goes on as OpenAI's would, to the context's end (within the server's
    # chat_max_new_tokens); a completion's default stays the server's max_new_tokens (OpenAI's is 16)
    default = c.settings.chat_max_new_tokens or c.settings.max_new_tokens_limit
    query = await c.query(request, question, body.documents, system, body.ragcache, body, default)
    return await _respond(
        request,
        c,
        body,
        query,
        "chatcmpl",
        ("chat.completion", "chat.completion.chunk"),
        lambda text: {"message": {"role": "assistant", "content": text}},
        lambda piece: {"delta": {} if piece is None else {"content": piece}},
        opening={"delta": {"role": "assistant", "content": ""}},
    )


def _choice(text: dict, finish: str | None = None) -> dict:
    return {"index": 0, **text, "logprobs": None, "finish_reason": finish}


async def _respond(
    request: Request,
    c: Context,
    body: OpenAIFields,
    query,
    id_prefix: str,
    kinds: tuple[str, str],
    whole: Callable[[str], dict],
    piece: Callable[[str | None], dict],
    opening: dict | None = None,
):
    """The whole answer as one object (kinds[0], whole(text) in its choice), or a stream of chunks (kinds[1],
    piece(text) in theirs, piece(None) in the finishing one). Usage rides on the finishing chunk, or on a chunk of its
    own (empty choices) when the client asked for stream_options.include_usage."""
    base = {
        "id": f"{id_prefix}-{uuid.uuid4().hex}",
        "object": kinds[0],
        "created": int(time.time()),
        "model": c.rc.model_name,
    }
    if not body.stream:
        answer = await c.answer(request, query)
        return {
            **base,
            "choices": [_choice(whole(answer.text), answer.stats.finish_reason)],
            "usage": usage(answer),
            "ragcache": ragcache_info(answer),
        }
    gen, first = await c.start(request, query)
    base["object"] = kinds[1]
    separate_usage = bool(body.stream_options and body.stream_options.include_usage)

    def done(answer: Answer) -> list[dict]:
        finish = {**base, "choices": [_choice(piece(None), answer.stats.finish_reason)]}
        if separate_usage:
            return [finish, {**base, "choices": [], "usage": usage(answer)}]
        return [{**finish, "usage": usage(answer)}]

    return EventStream(
        gen,
        sse_events(
            c,
            gen,
            first,
            lambda text: {**base, "choices": [_choice(piece(text))]},
            done,
            opening and {**base, "choices": [_choice(opening)]},
        ),
    )
