"""One request's meaning, checked once before any work.

The API's schemas (api/schemas.py) check shapes at the edge. `validate` and `validate_infill` check what a shape
cannot say: empty text, document references, the link and sampling parameters against the model, and a server's
limits. The engine's entry points call them once per request; nothing after them checks again.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from ragcache.store.keys import document_id, is_document_id

from .engine import Sampling
from .errors import BadRequest, EmptyInput, InvalidText, ParameterOutOfRange, PayloadTooLarge
from .infill import MODES
from .linker import LinkParams


@dataclass(frozen=True)
class Limits:
    """A server's bounds on one request (from its Settings); None: unbounded, as in the library."""

    question_chars: int | None = None  # also the system prompt's
    document_chars: int | None = None  # also an infill's prefix and suffix
    documents: int | None = None
    new_tokens: int | None = None
    stop_strings: int | None = None
    stop_chars: int | None = None


UNBOUNDED = Limits()


@dataclass
class Query:
    question: str
    docs: list  # as given: document ids and {"text": ...}
    texts: list[str]  # the raw texts among docs: stored (and compiled) on the fly
    system: str | None
    params: LinkParams
    sampling: Sampling | None  # None: link only

    @cached_property
    def doc_ids(self) -> list[str]:
        """Each document's id, a raw text's its hash: taken when the query is answered, so that a query refused for
        its texts' length never hashes them (megabytes each)."""
        return [document_id(doc["text"]) if isinstance(doc, dict) else doc for doc in self.docs]


@dataclass
class Infill:
    prefix: str
    suffix: str
    session: str | None
    mode: str
    reuse: bool
    sampling: Sampling


def validate(
    question: str,
    docs: list,
    system: str | None,
    params: LinkParams,
    sampling: Sampling | None,
    layers: int,
    limits: Limits = UNBOUNDED,
) -> Query:
    if not isinstance(question, str) or not question.strip():
        raise EmptyInput("the question is empty")
    _at_most("the question", question, limits.question_chars)
    unicode_text("the question", question)
    if system is not None:
        _at_most("the system prompt", system, limits.question_chars)
        unicode_text("the system prompt", system)
    docs = list(docs)
    _at_most_count(len(docs), limits.documents, "documents")
    texts = []
    for i, doc in enumerate(docs):
        if isinstance(doc, dict) and set(doc) == {"text"}:
            texts.append(validate_text(doc["text"], f"docs[{i}]", limits))
            docs[i] = {"text": texts[-1]}  # its id is that of the text as stored
        elif not (isinstance(doc, str) and is_document_id(doc)):  # text is never an id: a typo'd id is no document
            raise BadRequest(
                f"docs[{i}] is not a document id (32 hex characters, as compile returns); pass raw "
                'text as {"text": ...}'
            )
    params.validate(layers)
    if sampling is not None:
        validate_sampling(sampling, limits)
    return Query(question, docs, texts, system, params, sampling)


def read_text(path: Path) -> str:
    """A text file given as input; BadRequest naming it when it is no UTF-8 or cannot be read."""
    try:
        # a BOM is no part of the text (nor of its id); its line ends are (read_text would make CRLF LF: another id
        # than the same bytes sent to the API)
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"{path} is not UTF-8 text (byte {exc.start}); convert it to text first") from exc
    except OSError as exc:  # unreadable (permissions), gone since it was listed
        raise unreadable(path, exc) from exc


def unreadable(path: Path, exc: OSError) -> BadRequest:
    """An input file the file system would not give: its name and the system's words."""
    return BadRequest(f"cannot read {shown(str(path))}: {exc.strerror or exc}")


def shown(value: str, limit: int = 80) -> str:
    """A value for an error message: a long one (text passed where a path was meant) cut short."""
    return value if len(value) <= limit else f"{value[:limit]}... ({len(value)} characters)"


def glob_paths(folder: Path, glob: str, option: str = "--glob") -> list[Path]:
    """What `glob` matches under `folder`, sorted; BadRequest for a pattern pathlib cannot take (an absolute one, an
    empty one), which it refuses with NotImplementedError or ValueError."""
    if not glob or Path(glob).is_absolute():
        raise BadRequest(f"{option} {glob!r} must be relative to each folder given, a pattern such as '**/*.md'")
    try:
        return sorted(folder.glob(glob))
    except (ValueError, IndexError, NotImplementedError) as exc:
        raise BadRequest(f"{option} {glob!r} is no pattern pathlib takes ({exc or type(exc).__name__})") from None


def validate_texts(texts: list, limits: Limits = UNBOUNDED, what: str = "documents") -> list[str]:
    """Documents to compile."""
    if isinstance(texts, str | bytes | Mapping) or not isinstance(texts, Collection):
        raise BadRequest(f"{what} must be a list of texts, got {type(texts).__name__}: pass [text] for one document")
    _at_most_count(len(texts), limits.documents, what)
    return [validate_text(text, f"{what}[{i}]", limits) for i, text in enumerate(texts)]


def stored_text(text: str) -> str:
    """A document's text as stored and hashed: without a leading byte-order mark, which is no part of the text, so
    that a file's id is the same whether `compile` read it or a client sent its decoded bytes."""
    return text.removeprefix("\ufeff")


def blank(text: str) -> bool:
    """Nothing to compile: only whitespace once a byte-order mark is gone (an empty file saved with one), which the
    doors that skip empty documents skip, as `validate_text` would refuse it."""
    return not stored_text(text).strip()


def validate_text(text, name: str, limits: Limits = UNBOUNDED) -> str:
    """The document as stored (`stored_text`)."""
    if isinstance(text, str):
        text = stored_text(text)
    if not isinstance(text, str) or not text.strip():
        raise EmptyInput(f"{name}: the document is empty; every document needs some text")
    _at_most(name, text, limits.document_chars)
    unicode_text(name, text)
    return text


def unicode_text(name: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidText(
            f"{name} holds a lone surrogate ({exc.object[exc.start : exc.end]!a} at character "
            f"{exc.start}), which is not Unicode text"
        ) from None


def validate_infill(
    prefix: str,
    suffix: str,
    session: str | None,
    mode: str,
    reuse: bool,
    sampling: Sampling,
    limits: Limits = UNBOUNDED,
) -> Infill:
    if not isinstance(prefix, str) or not isinstance(suffix, str) or not (prefix or suffix):
        raise EmptyInput("infilling needs a prefix or a suffix")
    _at_most("the prefix", prefix, limits.document_chars)
    _at_most("the suffix", suffix, limits.document_chars)
    unicode_text("the prefix", prefix)
    unicode_text("the suffix", suffix)
    if mode not in MODES:
        raise BadRequest(f"unknown infill mode {mode!r}; choose one of {', '.join(MODES)}")
    validate_sampling(sampling, limits)
    return Infill(prefix, suffix, session, mode, reuse, sampling)


def validate_sampling(sampling: Sampling, limits: Limits = UNBOUNDED) -> None:
    sampling.validate()
    if _over(sampling.max_new_tokens, limits.new_tokens):
        raise ParameterOutOfRange(
            f"max_tokens is {sampling.max_new_tokens}; this server generates at most {limits.new_tokens}",
            param="max_tokens",
        )
    # each stop string is searched for after every generated token
    if _over(len(sampling.stop), limits.stop_strings) or any(_over(len(x), limits.stop_chars) for x in sampling.stop):
        raise ParameterOutOfRange(
            f"stop takes at most {limits.stop_strings} strings of at most {limits.stop_chars} characters",
            param="stop",
        )


def _over(value: int, limit: int | None) -> bool:
    return limit is not None and value > limit


def _at_most(name: str, text: str, limit: int | None) -> None:
    if limit is not None and len(text) > limit:
        raise PayloadTooLarge(f"{name} has {len(text)} characters; at most {limit}", limit, len(text))


def _at_most_count(count: int, limit: int | None, what: str) -> None:
    if limit is not None and count > limit:
        raise PayloadTooLarge(f"{count} {what}; at most {limit} per request", limit, count)
