"""The errors the store raises, and the base of every error ragcache raises on purpose. The base lives here, in the
lowest layer, so the store needs nothing from the layers above it; `ragcache.errors` is where users import them."""


class RagCacheError(Exception):
    """Base of every error ragcache raises on purpose."""

    # what an HTTP client is told instead of the message, for a kind whose message quotes another library's error
    # (its text may name the server's memory, devices or files): the server logs the message under a ref
    public: str | None = None


class BadRequest(RagCacheError):
    """The caller sent something unusable (empty question, bad parameter)."""


class ParameterOutOfRange(BadRequest):
    """k, ratio, max_new_tokens, temperature, ... outside their valid range; `param`: the request field to blame,
    where one is (an error body's `param`, as OpenAI's clients read it)."""

    def __init__(self, *args, param: str | None = None):
        super().__init__(*args)
        self.param = param


class CodecOverflow(RagCacheError):
    """K/V outside the range of the chosen kv codec (fp16 holds at most 65504: choose bf16 or int8), or not finite at
    all (an integer codec cannot scale them)."""


class StoreError(RagCacheError):
    """A store backend failed in a way the caller must hear about (bad URL, write failure, a tier that is down)."""

    # its message names the store's folders, hosts and the file system's or Redis's own words: the operator's
    public: str | None = "the document store failed; retry shortly"


class UnknownStore(StoreError, BadRequest):
    """A store URL (or one of its tiers) of no kind the store knows, or with options it cannot read (a size of
    `20GB`): a typo, bad input before anything opens."""


class CorruptEntry(StoreError):
    """An entry failed its checksum or does not belong to the key it was read under."""


class BrokenStore(StoreError):
    """The store's files cannot be reached in a way no retry changes (a symbolic link loop on their path): not an
    outage but damage an operator must repair."""

    public = "the document store's files cannot be reached, which no retry changes: an operator must repair them"
