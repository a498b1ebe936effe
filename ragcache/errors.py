"""Typed errors: one class per failure kind. They carry no HTTP status or exit code: api/errors.py maps each kind to
an HTTP status, ragcache/cli.py to an exit code, each in one table. The store's errors and the base class live in
ragcache/store/errors.py (the store imports nothing from above it); every error is imported from here."""

from ragcache.store.errors import (  # noqa: F401 - re-exported: every error is imported from here
    BadRequest,
    BrokenStore,
    CodecOverflow,
    CorruptEntry,
    ParameterOutOfRange,
    RagCacheError,
    StoreError,
    UnknownStore,
)


class EmptyInput(BadRequest):
    """An empty question or an empty document."""


class PayloadTooLarge(BadRequest):
    """A request over one of a server's limits (ragcache.request.Limits)."""

    def __init__(self, message: str, limit: int, got: int):
        self.limit, self.got = limit, got
        super().__init__(message)


class InvalidMetadata(BadRequest):
    """Document metadata that a store record cannot hold and give back: not a JSON object, nested too deep, or
    holding text that is not Unicode (a lone surrogate)."""


class InvalidText(BadRequest):
    """A question, document or prompt holding a lone surrogate (from a file name or JSON escape), which is not
    Unicode text: UTF-8 cannot hold it, so it can be neither hashed nor tokenized."""


class UnknownAlgorithm(BadRequest):
    """An algorithm name that is not one of ragcache.linker.ALGORITHMS."""


class Cancelled(RagCacheError):
    """The caller cancelled a request while it was being prepared (its documents compiled); it ends as "cancelled",
    never as an error the caller sees."""


class CompileFailed(RagCacheError):
    """A chunk the model could not compile into its entry (an error in its forward or encoding; out of device
    memory is OutOfDeviceMemory): that request fails, with its cause; what was compiled before it is stored."""

    public = "compiling this request's documents failed; what was compiled before the failure is stored"


class NonFiniteLogits(RagCacheError):
    """A sampled answer's next-token distribution held NaN or infinity (a float16 model overflowing, a broken
    adapter): that answer fails alone, the engine goes on. On a GPU, drawing from it was a device-side assert that
    ended every answer after it."""

    public = "the model's output was not finite for this request; a float16 model may overflow: try bfloat16"


class OutOfDeviceMemory(RagCacheError):
    """A model step ran out of GPU memory (a long link beside many decoding streams): the requests in it fail, the
    engine goes on with the memory given back; a retry may fit."""

    public = "the model ran out of device memory for this request; retry shortly"


class EngineDown(RagCacheError):
    """The engine answers no request until the server restarts (vLLM's engine core died): another replica may."""


class ShuttingDown(RagCacheError):
    """The engine is stopping: work it had queued and had not finished, and work sent after, is refused."""

    def __init__(self):
        super().__init__(
            "the engine is shutting down; send the request again (to another server if this one is leaving)"
        )


class EngineClosed(ShuttingDown):
    """A method of an engine after its `close`: its store would reopen underneath it, and its model thread is gone."""

    def __init__(self):
        RagCacheError.__init__(
            self,
            "the engine is closed (a server shutting down, or close() called): send it to another server or engine",
        )


class DocumentInUse(RagCacheError):
    """A delete gave up waiting for the uploads and queries using its document (a long bulk upload): new queries of
    the document wait behind a waiting delete, so it does not wait for long. Nothing was deleted; send it again."""

    def __init__(self, doc_id: str, waited_s: float, by: str = "an upload or queries"):
        super().__init__(
            f"document {doc_id} is in use by {by} that did not finish within {waited_s:g} s; "
            "nothing was deleted: delete it again later"
        )


class UnknownDocument(RagCacheError):
    """A document id that the store does not know (for this model)."""

    def __init__(self, ids: list[str]):
        self.ids = list(ids)
        super().__init__(f"unknown document id(s): {', '.join(self.ids)}; compile the text first or pass it raw")


class PromptTooLong(RagCacheError):
    """The linked prompt (plus the tokens to generate) exceeds the model's context."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, context: int, question_tokens: int | None = None):
        self.prompt_tokens, self.max_new_tokens, self.context = prompt_tokens, max_new_tokens, context
        self.question_tokens = question_tokens
        if question_tokens is not None and question_tokens + max_new_tokens > context:
            advice = f"the question alone is {question_tokens} tokens; shorten it or lower max_new_tokens"
        elif question_tokens is not None:
            advice = (
                f"the documents take {prompt_tokens - question_tokens} tokens and the question {question_tokens}; "
                "pass fewer or shorter documents, or lower max_new_tokens"
            )
        else:
            advice = "pass fewer documents, a shorter question, or lower max_new_tokens"
        super().__init__(
            f"prompt of {prompt_tokens} tokens + {max_new_tokens} new tokens exceeds the model context of "
            f"{context} tokens: {advice}"
        )


class TextsTooLong(PromptTooLong):
    """Raw texts that hold more tokens than the context has room for, found before they were tokenized whole
    (ragcache/length.py): `prompt_tokens` is a lower bound."""

    def __init__(self, at_least: int, max_new_tokens: int, context: int, how: str):
        self.prompt_tokens, self.max_new_tokens, self.context = at_least, max_new_tokens, context
        self.question_tokens = None
        if max_new_tokens:
            fit = f"with {max_new_tokens} new tokens they cannot fit the model context of {context} tokens"
            advice = "pass fewer or shorter texts, or lower max_new_tokens"
        else:  # refused before max_new_tokens was read: they are longer than the whole context
            fit, advice = f"they cannot fit the model context of {context} tokens", "pass fewer or shorter texts"
        RagCacheError.__init__(self, f"the raw texts hold at least {at_least} tokens ({how}); {fit}: {advice}")


class UnsupportedModel(RagCacheError):
    """A model ragcache cannot link for (no rotary embeddings, unsupported rope type, ...)."""


class ModelTooLarge(UnsupportedModel):
    """A model (or its merged adapter) that does not fit the device's free memory at load."""


class ModelFetchError(RagCacheError):
    """A built-in model could not be downloaded, verified or converted."""


class CorruptDocument(StoreError):
    """A stored document record fails its checks (edited or damaged in the store); `problem` names the damage,
    `advice` the repair."""

    public = None  # what is damaged and how to repair it is the client's to hear

    def __init__(self, doc_id: str, problem: str, advice: str = "add the document's text again to repair it"):
        self.doc_id, self.problem = doc_id, problem
        super().__init__(f"the stored record of document {doc_id} is damaged: {problem}; {advice}")


class BadAdapter(ModelFetchError):
    """An adapter directory that is missing, damaged, or fitted to a model of another configuration."""


class BatchInvarianceUnavailable(RagCacheError):
    """Batch invariance was asked for (the default) and this machine or model cannot give it: no GEMM row tile of
    the CPU gives a row the same bits at every place, or a norm or device ragcache has no invariant path for. Raised
    at start, so that no answer silently depends on the load."""


class CannotListen(RagCacheError):
    """The server's address cannot be listened on (another process holds the port, an address not this host's)."""


class WritesAbandoned(KeyboardInterrupt):
    """Ctrl-C again while a compile stored what it had compiled: `batches` of entries were given up (a resumed
    compile compiles them again). An interrupt, not a failure: it is no RagCacheError."""

    def __init__(self, batches: int):
        self.batches = batches
        super().__init__(f"up to {batches} compiled batch(es) not stored")
