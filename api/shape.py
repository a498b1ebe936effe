"""A JSON reader that holds a request body to its limits while it reads it, so that no body costs more than a
bounded amount of work before it is refused.

`json.loads` builds the whole body in one call of C that holds the GIL: a body of a million keys would hold every
thread, the event loop's included, for about a second before its keys could be counted. Here objects and arrays are
walked in Python, one value at a time, and only scalars (strings, numbers, literals) are read by the json module's C
scanner. Every value counts against `BodyLimits.values` and every level against the depth, so the read ends at the
first value past either; a container's count is checked as it closes (the error then says how many it held, and the
values budget bounds the counting). The walk yields the GIL between values, so the event loop answers others while
a large body is read.

A strict model's unknown top-level keys are not stored: the first `REPORTED` are kept for the error, the rest counted.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from json.decoder import JSONDecodeError, scanstring  # type: ignore[attr-defined]  # scanstring: not in typeshed
from json.scanner import make_scanner
from typing import Any, cast

from ragcache.settings import Settings

from .errors import REPORTED, ApiError, Refused

WHITESPACE = re.compile(r"[ \t\n\r]*")  # JSON's own, as the json module skips it
# one scalar (or a whole container, which `Reader` never asks it for); typeshed wants a make_scanner as the context,
# where the scanner reads only the decoder's hooks (its stub's TODO)
SCAN = make_scanner(cast(make_scanner, json.JSONDecoder()))


@dataclass(frozen=True)
class BodyLimits:
    """The shape every JSON body of the API is held to (Settings: max_body_*, max_documents)."""

    values: int  # JSON values in all (objects, arrays, strings, numbers, literals)
    keys: int  # keys in one object
    items: int  # items in one array, but `documents`
    depth: int  # objects and arrays nested in one another
    documents: int  # items of the top-level `documents` array

    @classmethod
    def of(cls, settings: Settings) -> BodyLimits:
        return cls(
            settings.max_body_values,
            settings.max_body_keys,
            settings.max_body_items,
            settings.max_body_depth,
            settings.max_documents,
        )


def read(text: str, limits: BodyLimits, known: frozenset[str] | None = None) -> Any:
    """The body's value; ApiError (413) past a count, Refused (422) past the depth, for malformed JSON, or for
    top-level keys outside `known` (None: any key)."""
    reader = Reader(text, limits, known)
    try:
        value, end = reader.value(reader.skip(0), (), 1)
        if reader.skip(end) != len(text):
            raise JSONDecodeError("Extra data", text, reader.skip(end))
    except JSONDecodeError as exc:  # FastAPI's own shape of this error
        raise malformed(exc.msg, exc.pos) from None
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
    def __init__(self, text: str, limits: BodyLimits, known: frozenset[str] | None):
        self.text, self.limits, self.known = text, limits, known
        self.values, self.unknown_count = 0, 0
        self.unknown: list[str] = []

    def skip(self, i: int) -> int:
        match = WHITESPACE.match(self.text, i)
        assert match is not None  # the pattern matches the empty string anywhere
        return match.end()

    def value(self, i: int, path: tuple, depth: int) -> tuple[Any, int]:
        self.values += 1
        if self.values > self.limits.values:
            raise ApiError(
                413,
                "payload_too_large",
                f"the body holds more than {self.limits.values} JSON values; at most {self.limits.values}",
                limit=self.limits.values,
            )
        opening = self.text[i : i + 1]
        if opening in ("{", "[") and depth > self.limits.depth:
            raise too_deep(self.limits)
        if opening == "{":
            return self.object(self.skip(i + 1), path, depth)
        if opening == "[":
            return self.array(self.skip(i + 1), path, depth)
        try:
            return SCAN(self.text, i)
        except StopIteration:
            raise JSONDecodeError("Expecting value", self.text, i) from None

    def object(self, i: int, path: tuple, depth: int) -> tuple[dict, int]:
        out: dict = {}
        if self.text[i : i + 1] == "}":
            return out, i + 1
        while True:
            if self.text[i : i + 1] != '"':
                raise JSONDecodeError("Expecting property name enclosed in double quotes", self.text, i)
            key, i = scanstring(self.text, i + 1)
            i = self.skip(i)
            if self.text[i : i + 1] != ":":
                raise JSONDecodeError("Expecting ':' delimiter", self.text, i)
            item, i = self.value(self.skip(i + 1), (*path, key), depth + 1)
            if depth == 1 and self.known is not None and key not in self.known:
                self.unknown_count += 1  # counted, not stored: the error lists the first few
                if len(self.unknown) < REPORTED:
                    self.unknown.append(key)
            else:
                out[key] = item
            i = self.skip(i)
            if self.text[i : i + 1] == "}":
                break
            if self.text[i : i + 1] != ",":
                raise JSONDecodeError("Expecting ',' delimiter", self.text, i)
            i = self.skip(i + 1)
        if len(out) > self.limits.keys:
            raise too_many(len(out), "keys in one object", path, self.limits.keys)
        return out, i + 1

    def array(self, i: int, path: tuple, depth: int) -> tuple[list, int]:
        out: list = []
        if self.text[i : i + 1] == "]":
            return out, i + 1
        while True:
            item, i = self.value(i, (*path, len(out)), depth + 1)
            out.append(item)
            i = self.skip(i)
            if self.text[i : i + 1] == "]":
                break
            if self.text[i : i + 1] != ",":
                raise JSONDecodeError("Expecting ',' delimiter", self.text, i)
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


def too_many(got: int, what: str, path: tuple, cap: int) -> ApiError:
    where = ".".join(map(str, path)) or "the body"
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
