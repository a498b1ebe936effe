"""Request and response bodies of the REST API: the native routes (/v1/documents, /v1/query) and the
OpenAI-compatible ones (/v1/completions, /v1/chat/completions, /v1/models).

Shapes and ranges are checked here (422); what a shape cannot say, and the size limits from Settings (413), are
checked once by ragcache.request."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, AliasChoices, BaseModel, ConfigDict, Field, field_validator, model_validator

from ragcache import linker
from ragcache.linker import ALGORITHMS
from ragcache.settings import whole
from ragcache.store.keys import is_document_id


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _unicode(value: str) -> str:
    """JSON can carry lone UTF-16 surrogates ("\\ud800"), which are not text: refuse them here, naming the field,
    rather than fail deep in hashing or tokenizing."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"holds a lone UTF-16 surrogate at character {exc.start}, which is not valid Unicode text"
        ) from None
    return value


Text = Annotated[str, AfterValidator(_unicode)]


class TextDocument(Strict):
    """Raw text in place of a document id: stored and compiled on the fly (its id is the hash of the text)."""

    text: Text


DocumentRef = str | TextDocument


def check_document_refs(refs: list) -> list:
    for i, ref in enumerate(refs):
        if isinstance(ref, str) and not is_document_id(ref):
            raise ValueError(
                f"documents[{i}] is not a document id (32 hex characters, as POST /v1/documents returns);"
                ' send raw text as {"text": "..."}'
            )
    return refs


# -- documents --------------------------------------------------------------------------------------------
class DocumentIn(Strict):
    text: Text = Field(description="the document text; its id is a hash of it, so the same text is stored once")
    metadata: dict[str, Any] = Field(default_factory=dict, description="any JSON object, returned by GET")


class CompileRequest(Strict):
    """Either {"documents": [{"text", "metadata"}, ...]} or a single {"text", "metadata"}."""

    documents: list[DocumentIn] | None = None
    text: Text | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def one_shape(self) -> CompileRequest:
        if (self.documents is None) == (self.text is None):
            raise ValueError('send either "documents": [{"text": ...}, ...] or a single "text"')
        if self.documents is not None and self.metadata:
            raise ValueError('"metadata" at the top level goes with a single "text"; put it inside each document')
        return self

    def items(self) -> list[DocumentIn]:
        if self.documents is not None:
            return self.documents
        assert self.text is not None  # one_shape: a request without documents has a text
        return [DocumentIn(text=self.text, metadata=self.metadata)]


class CompiledDocument(BaseModel):
    id: str
    chunks: int
    tokens: int
    compiled_chunks: int = Field(description="chunks compiled by this request (0 when it was already stored)")


class CompileResponse(BaseModel):
    ids: list[str]
    documents: list[CompiledDocument]
    stats: dict[str, float | int] = Field(
        description="documents, skipped (every chunk stored before), repeated (the rest an earlier document of "
        "the request has), chunks, compiled_chunks, tokens, bytes, seconds"
    )


class DocumentOut(BaseModel):
    id: str
    text: str
    metadata: dict[str, Any]
    created: float | None = None
    chars: int
    chunks: int = Field(description="chunks the document was split into")
    tokens: int = Field(description="tokens over all its chunks")


class DocumentSummary(BaseModel):
    id: str
    chars: int
    metadata: dict[str, Any]
    created: float | None = None
    problem: str | None = None  # why the stored record cannot be read (it is listed, so that it can be repaired)


class DocumentPage(BaseModel):
    data: list[DocumentSummary]
    total: int
    offset: int
    limit: int


class Deleted(BaseModel):
    id: str
    deleted: bool = True


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="allow")  # details of some kinds: ids, limit and got, param, ...

    type: str
    message: str
    code: str


class ErrorResponse(BaseModel):
    """The body of every error status, OpenAI-style."""

    error: ErrorDetail


# -- generation parameters shared by every answering route --------------------------------------------
class LinkOptions(Strict, linker.LinkOptions):
    """A request's link knobs (ragcache.settings.LinkKnobs: every knob, declared there), unknown fields refused; the
    schema lists the algorithms' names."""

    model_config = ConfigDict(
        json_schema_extra=lambda schema: schema["properties"]["algorithm"].update(enum=[*ALGORITHMS, None])
    )


MAX_TOKENS_NAMES = ("max_tokens", "max_new_tokens", "max_completion_tokens")
MAX_TOKENS_PRIORITY = ("max_completion_tokens", "max_tokens", "max_new_tokens")  # of two given, the one that counts


class SamplingFields(BaseModel):
    model_config = ConfigDict(populate_by_name=True)  # max_tokens by its name too, not only by its aliases

    max_tokens: int | None = Field(
        None,
        ge=1,
        strict=True,
        validation_alias=AliasChoices(*MAX_TOKENS_NAMES),
        description="tokens to generate (default and upper limit: settings)",
    )

    @model_validator(mode="before")
    @classmethod
    def _unset_max_tokens(cls, data):
        """One value of max_tokens' names: a null is no value (the aliases take the first name present, so
        `max_tokens: null` beside `max_completion_tokens: 3` left the server's default), and of two names given the
        one that counts is OpenAI's current name, then its deprecated one, then ragcache's (as vLLM reads the first
        two); the other is dropped, where the strict native schema refused it as an unknown field."""
        if not isinstance(data, dict):
            return data
        given = [name for name in MAX_TOKENS_PRIORITY if data.get(name) is not None]
        return {k: v for k, v in data.items() if k not in MAX_TOKENS_NAMES or k in given[:1]}

    # strict: a JSON true is not a number here (lax pydantic reads it as 1)
    temperature: float = Field(
        0.0, ge=0.0, le=10.0, allow_inf_nan=False, strict=True, description="0 = greedy (the default)"
    )
    top_p: float = Field(1.0, ge=0.0, le=1.0, allow_inf_nan=False, strict=True, description="0 = greedy")
    stop: Text | list[Text] | None = Field(
        None, description="a string or up to 16 strings that end the answer (not included)"
    )
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1, strict=True)  # what torch.Generator.manual_seed takes
    stream: bool = Field(False, strict=True)  # a JSON true or false: "yes" is no boolean

    _whole_sampling = field_validator("max_tokens", "seed", mode="before")(whole)

    @field_validator("temperature", "top_p", "stream", mode="before")
    @classmethod
    def _null_is_the_default(cls, value, info):
        """OpenAI's API takes null for these as "the default", and its SDKs send null for an explicit None."""
        return cls.model_fields[info.field_name].default if value is None else value


# -- native query -----------------------------------------------------------------------------------------
class QueryRequest(SamplingFields, LinkOptions):
    question: Text
    documents: list[DocumentRef] = Field(
        default_factory=list,
        description="document ids (as POST /v1/documents "
        'returns), or {"text": ...} for raw text (compiled on the fly and stored)',
    )
    system: Text | None = Field(None, description="system prompt (an exact prefix, never recomputed)")

    _refs = field_validator("documents")(check_document_refs)


class InfillRequest(SamplingFields, Strict):
    prefix: Text = Field("", description="text before the hole")
    suffix: Text = Field("", description="text after the hole")
    session: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="infilling session id: EFIM keeps its cached prompt across rounds",
    )
    mode: Literal["efim", "psm", "spm"] = "efim"
    reuse: bool = Field(
        True, strict=True, description="reuse the longest cached prompt prefix (false: recompute everything)"
    )


class Usage(BaseModel):
    prompt_tokens: int
    cached_tokens: int
    recomputed_tokens: int
    completion_tokens: int
    repaired_tokens: int = Field(0, description="stale rows recomputed while the answer was decoded (repair)")


class Timings(BaseModel):
    queue_s: float | None = Field(
        description="handed to the engine, waiting for its first step of this request (null: the engine does not "
        "say, as vLLM with its stats off)"
    )
    ttft_s: float
    fetch_s: float
    rotate_s: float
    recompute_s: float
    decode_s: float
    total_s: float


class QueryResponse(BaseModel):
    answer: str
    usage: Usage
    timings: Timings
    algorithm: str
    finish_reason: Literal["stop", "length"]
    store: dict[str, int] = Field(
        description="chunk lookups: hits, misses, compiled, unstored (compiled but refused by the store: a later "
        "request compiles them again) and shared (missed, and taken from another request that was compiling them)"
    )


class InfillResponse(BaseModel):
    text: str
    usage: Usage = Field(description="cached_tokens: prompt tokens reused from earlier rounds")
    timings: Timings
    mode: str
    finish_reason: Literal["stop", "length"]


# -- OpenAI-compatible ------------------------------------------------------------------------------------
class StreamOptions(BaseModel):
    # an option this server does not know asks for what it does not do: refused, not ignored
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = Field(False, strict=True)
    # OpenAI's: random padding against length side channels; no chunk's content depends on it
    include_obfuscation: bool | None = Field(None, strict=True)
    # vLLM's: usage on every chunk, which this server does not send; false asks for nothing
    continuous_usage_stats: Literal[False] | None = None


class OpenAIFields(SamplingFields):
    """What the OpenAI API defines plus ragcache's extra body fields (pass them with `extra_body=`)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream_options: StreamOptions | None = None
    documents: list[DocumentRef] = Field(
        default_factory=list, description='ragcache: document ids, or {"text": ...} for raw text'
    )

    _refs = field_validator("documents")(check_document_refs)
    ragcache: LinkOptions | None = Field(None, description="ragcache: link algorithm, k, ratio")


class CompletionRequest(OpenAIFields):
    prompt: Text | list[Text] = Field(description="the question (one prompt per request)")
    system: Text | None = Field(None, description="ragcache: system prompt")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: Text | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Text | list[TextPart] | None = None
    name: str | None = None


class ChatRequest(OpenAIFields):
    messages: list[ChatMessage] = Field(min_length=1)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ragcache"
    ragcache: dict[str, Any] | None = Field(
        None,
        description="linking defaults: default_k (the calibrated k when "
        "`ragcache calibrate` has run for this model), target, agreement_by_k; "
        "adapter: the link adapter the model answers with (sha256, name: "
        "its folder's, merged), null for the base model",
    )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
