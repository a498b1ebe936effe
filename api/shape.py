"""A JSON reader that holds a request body to its limits while it reads it, so that no body costs more than a
bounded amount of work before it is refused, nor holds the GIL for long in any one call.

`json.loads` builds the whole body in one call of C that holds the GIL: a body of a million keys would hold every
thread, the event loop's included, for about a second before its keys could be counted. Here objects and arrays are
walked in Python, one value at a time, and only scalars (strings, numbers, literals) are read by the json module's C
scanner. Every value counts against `BodyLimits.values` and every level against the depth, so the read ends at the
first value past either; a container's count is checked as it closes (the error then says how many it held, and the
values budget bounds the counting). The walk yields the GIL between values, so the event loop answers others while
a large body is read.

The body is read as bytes, never decoded whole: decoding 70 MiB is one call that holds the GIL for tens of
milliseconds (and a second copy of the body). JSON's structure is ASCII, which UTF-8 never uses inside a multibyte
character, so the walk finds each scalar's end in the bytes, refuses one longer than `BodyLimits.scalar_bytes`, and
decodes that scalar alone; whitespace is skipped a bounded stretch per call. Positions in errors are byte offsets.

A strict model's unknown top-level keys are not stored: the first `REPORTED` are kept for the error, the rest counted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from json.decoder import JSONDecodeError, scanstring  # type: ignore[attr-defined]  # scanstring: not in typeshed
from json.scanner import make_scanner
from typing import Any, cast

from ragcache.documents import MAX_METADATA_CHARS
from ragcache.errors import TextsTooLong
from ragcache.length import ContextTexts
from ragcache.settings import Settings

from .errors import REPORTED, ApiError, Refused, clip

WHITESPACE = re.compile(rb"[ \t\n\r]*+")  # JSON's own, as the json module skips it
STRING_REST = re.compile(rb'[^"\\]*+(?:\\.[^"\\]*+)*+"', re.DOTALL)  # a string after its opening quote
TOKEN = re.compile(rb"[-+.0-9A-Za-z]*+")  # a number or literal (true, NaN, -Infinity), or what the scanner refuses
SHORT = 64  # bytes of a number or literal read at once; one that fills them is measured first
STEP = 1 << 20  # bytes of whitespace one regex call skips at most: the GIL is yielded between calls
ESCAPED = 12  # bytes of JSON one character may take: a surrogate pair of \uXXXX escapes
# one scalar (or a whole container, which `Reader` never asks it for); typeshed wants a make_scanner as the context,
# where the scanner reads only the decoder's hooks (its stub's TODO)
SCAN = make_scanner(cast(make_scanner, json.JSONDecoder()))


class BadJSON(Exception):
    """Malformed JSON at a byte offset of the body."""

    def __init__(self, reason: str, pos: int):
        super().__init__(reason, pos)
        self.reason, self.pos = reason, pos


@dataclass(frozen=True)
class BodyLimits:
    """The shape every JSON body of the API is held to (Settings: max_body_*, max_documents; scalar_bytes from the
    longest text a field takes)."""

    values: int  # JSON values in all (objects, arrays, strings, numbers, literals)
    keys: int  # keys in one object
    items: int  # items in one array, but `documents`
    depth: int  # objects and arrays nested in one another
    documents: int  # items of the top-level `documents` array
    scalar_bytes: int  # bytes of one string (quotes included), number or literal, keys included

    @classmethod
    def of(cls, settings: Settings) -> BodyLimits:
        return cls(
            settings.max_body_values,
            settings.max_body_keys,
            settings.max_body_items,
            settings.max_body_depth,
            settings.max_documents,
            longest_scalar(settings),
        )


def longest_scalar(settings: Settings) -> int:
    """Bytes of the longest JSON string a field is there to hold (a document, a question or system prompt,
    metadata's whole JSON), every character escaped. A longer one is refused unread, whatever field it is for: those
    with no bound of their own (a model's name, a field a route ignores) are held to it too."""
    chars = max(settings.max_document_chars, settings.max_question_chars, MAX_METADATA_CHARS)
    return ESCAPED * chars + 2


def longest_body(settings: Settings) -> int:
    """Bytes of the largest body a client within every stated limit may send, every character escaped: its
    documents with their metadata, a question and a system prompt, and a mebibyte for the rest (keys, numbers)."""
    per_document = ESCAPED * (settings.max_document_chars + MAX_METADATA_CHARS)
    return settings.max_documents * per_document + ESCAPED * 2 * settings.max_question_chars + (1 << 20)


def read(
    raw: bytes | bytearray,
    limits: BodyLimits,
    known: frozenset[str] | None = None,
    texts: ContextTexts | None = None,
) -> Any:
    """The body's value; ApiError (413) past a count or for a scalar past `scalar_bytes`, Refused (422) past the
    depth, for malformed JSON (UTF-8 included), or for top-level keys outside `known` (None: any key). `texts`:
    where a body answered from the model's context adds its raw texts (`documents[i].text`) as they are read, which
    raises TextsTooLong (413) once those read cannot fit, so the rest of a hostile body is never decoded."""
    try:
        return walk(raw, limits, known, texts)
    except (ApiError, Refused, TextsTooLong) as exc:
        # the walk's frames, which the traceback holds, hold what it built (100,000 small objects, say): dropped
        # here, in this worker thread, rather than with the error on the event loop
        exc.__context__ = None
        raise exc.with_traceback(None) from None


def walk(raw: bytes | bytearray, limits: BodyLimits, known: frozenset[str] | None, texts: ContextTexts | None) -> Any:
    reader = Reader(raw, limits, known, texts)
    try:
        value, end = reader.value(reader.skip(0), (), 1)
        if reader.skip(end) != len(raw):
            raise BadJSON("Extra data", reader.skip(end))
    except BadJSON as exc:  # FastAPI's own shape of this error
        raise malformed(exc.reason, exc.pos) from None
    except ValueError as exc:  # an integer of more digits than Python converts
        raise malformed(str(exc)) from None
    except RecursionError:  # a max_body_depth set past what Python's stack allows
        raise too_deep(limits) from None
    if reader.unknown:
        raise Refused(
            [
                {"type": "extra_forbidden", "loc": ("body", key), "msg": "Extra inputs are not permitted"}
                for key in reader.unknown
            ],
            total=reader.unknown_count,
        )
    return value


class Reader:
    def __init__(
        self, raw: bytes | bytearray, limits: BodyLimits, known: frozenset[str] | None, texts: ContextTexts | None
    ):
        self.raw, self.limits, self.known, self.texts = raw, limits, known, texts
        self.values, self.unknown_count = 0, 0
        self.unknown: list[str] = []

    def skip(self, i: int) -> int:
        """The offset of the first byte at or after `i` that is not whitespace, STEP bytes a call."""
        end = WHITESPACE.match(self.raw, i, i + STEP).end()  # type: ignore[union-attr]  # matches the empty string
        while end == i + STEP:  # STEP bytes of whitespace: more may follow
            i = end
            end = WHITESPACE.match(self.raw, i, i + STEP).end()  # type: ignore[union-attr]
        return end

    def value(self, i: int, path: tuple, depth: int) -> tuple[Any, int]:
        self.values += 1
        if self.values > self.limits.values:
            raise ApiError(
                413,
                "payload_too_large",
                f"the body holds more than {self.limits.values} JSON values; at most {self.limits.values}",
                limit=self.limits.values,
            )
        opening = self.raw[i : i + 1]
        if opening in (b"{", b"[") and depth > self.limits.depth:
            raise too_deep(self.limits)
        if opening == b"{":
            return self.object(self.skip(i + 1), path, depth)
        if opening == b"[":
            return self.array(self.skip(i + 1), path, depth)
        if opening == b'"':
            text, end = self.string(i)
            if self.texts is not None and len(path) == 3 and path[0] == "documents" and path[2] == "text":
                self.texts.add(text)
            return text, end
        return self.scalar(i)

    def string(self, i: int) -> tuple[str, int]:
        """The string whose opening quote is at `i`, and the offset past it. Its end is found in the bytes within
        `scalar_bytes` (a bounded search), then it alone is decoded."""
        bound = self.limits.scalar_bytes
        quote = self.raw.find(b'"', i + 1, i + bound)
        if quote >= 0 and self.raw.find(b"\\", i + 1, quote) < 0:  # no escape: the first quote ends it (memchr)
            end = quote + 1
        else:  # the regex steps over escapes, at a fraction of memchr's speed
            match = STRING_REST.match(self.raw, i + 1, i + bound)
            if match is None:
                if len(self.raw) > i + bound:  # no closing quote within the bound
                    raise too_long(bound)
                raise BadJSON("Unterminated string starting at", i)
            end = match.end()
        text = self.decode(i, end)
        try:
            value, _ = scanstring(text, 1)
        except JSONDecodeError as exc:  # an escape or a control character: its offset in bytes
            raise BadJSON(exc.msg, i + len(text[: exc.pos].encode())) from None
        return value, end

    def scalar(self, i: int) -> tuple[Any, int]:
        """A number or literal at `i`. The scanner reads it from a short window (latin-1 maps bytes to characters
        one to one, so offsets stay byte offsets); a token that fills the window is bounded by `scalar_bytes`
        first."""
        window = self.raw[i : i + SHORT].decode("latin-1")
        try:
            value, end = SCAN(window, 0)
        except StopIteration:
            raise BadJSON("Expecting value", i) from None
        if end < SHORT:
            return value, i + end
        bound = self.limits.scalar_bytes
        end = TOKEN.match(self.raw, i, i + bound + 1).end()  # type: ignore[union-attr]  # matches the empty string
        if end - i > bound:
            raise too_long(bound)
        value, length = SCAN(self.raw[i:end].decode("ascii"), 0)
        return value, i + length

    def decode(self, i: int, j: int) -> str:
        try:
            return self.raw[i:j].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadJSON("not UTF-8 text", i + exc.start) from None

    def object(self, i: int, path: tuple, depth: int) -> tuple[dict, int]:
        out: dict = {}
        if self.raw[i : i + 1] == b"}":
            return out, i + 1
        while True:
            if self.raw[i : i + 1] != b'"':
                raise BadJSON("Expecting property name enclosed in double quotes", i)
            key, i = self.string(i)
            i = self.skip(i)
            if self.raw[i : i + 1] != b":":
                raise BadJSON("Expecting ':' delimiter", i)
            item, i = self.value(self.skip(i + 1), (*path, key), depth + 1)
            if depth == 1 and self.known is not None and key not in self.known:
                self.unknown_count += 1  # counted, not stored: the error lists the first few
                if len(self.unknown) < REPORTED:
                    self.unknown.append(key)
            else:
                out[key] = item
            i = self.skip(i)
            if self.raw[i : i + 1] == b"}":
                break
            if self.raw[i : i + 1] != b",":
                raise BadJSON("Expecting ',' delimiter", i)
            i = self.skip(i + 1)
        if len(out) > self.limits.keys:
            raise too_many(len(out), "keys in one object", path, self.limits.keys)
        return out, i + 1

    def array(self, i: int, path: tuple, depth: int) -> tuple[list, int]:
        out: list = []
        if self.raw[i : i + 1] == b"]":
            return out, i + 1
        while True:
            item, i = self.value(i, (*path, len(out)), depth + 1)
            out.append(item)
            i = self.skip(i)
            if self.raw[i : i + 1] == b"]":
                break
            if self.raw[i : i + 1] != b",":
                raise BadJSON("Expecting ',' delimiter", i)
            i = self.skip(i + 1)
        if path == ("documents",) and len(out) > self.limits.documents:
            raise ApiError(
                413,
                "payload_too_large",
                f"{len(out)} documents in one request; at most {self.limits.documents}",
                limit=self.limits.documents,
                got=len(out),
            )
        if len(out) > self.limits.items:
            raise too_many(len(out), "items in one array", path, self.limits.items)
        return out, i + 1


def too_long(bound: int) -> ApiError:
    return ApiError(
        413,
        "payload_too_large",
        f"a JSON string or number of more than {bound} bytes, longer than any field takes; at most {bound}",
        limit=bound,
    )


def too_many(got: int, what: str, path: tuple, cap: int) -> ApiError:
    where = ".".join(map(clip, path)) or "the body"  # a key may be megabytes, or hold a lone surrogate
    return ApiError(413, "payload_too_large", f"{got} {what} ({where}); at most {cap}", limit=cap, got=got)


def too_deep(limits: BodyLimits) -> Refused:
    return Refused(
        [
            {
                "type": "too_deep",
                "loc": ("body",),
                "msg": f"objects and arrays nest deeper than {limits.depth} levels; at most {limits.depth}",
            }
        ]
    )


def malformed(reason: str, at: int | None = None) -> Refused:
    return Refused(
        [
            {
                "type": "json_invalid",
                "loc": ("body",) if at is None else ("body", at),
                "msg": "JSON decode error",
                "ctx": {"error": reason},
            }
        ]
    )
