"""The request body reader (api/body.py, api/shape.py) on its own: a body is gathered without a copy of the whole,
walked as bytes (never decoded whole), a scalar longer than any field takes is refused before it is decoded, and a
refusal carries none of what the walk built. No test asserts a duration (research/hostile_body_health.py and
docs/BENCHMARKS.md have the figures)."""

from __future__ import annotations

import asyncio
import json

import pytest

from ragcache import length
from ragcache.api import body, shape
from ragcache.api.errors import ApiError, Refused
from ragcache.api.schemas import CompileRequest, QueryRequest
from ragcache.errors import TextsTooLong
from ragcache.settings import Settings
from tests import tiny

SETTINGS = Settings.model_construct()  # defaults, whatever the environment of the machine running the tests
LIMITS = shape.BodyLimits.of(SETTINGS)


def test_the_bound_on_one_scalar_is_the_longest_text_a_field_takes_escaped():
    longest = max(SETTINGS.max_document_chars, SETTINGS.max_question_chars, shape.MAX_METADATA_CHARS)
    assert LIMITS.scalar_bytes == shape.ESCAPED * longest + 2
    text = "\U0001f600" * 100  # a character that takes the most bytes escaped: a surrogate pair of \uXXXX
    assert len(json.dumps(text)) == shape.ESCAPED * len(text) + 2


@pytest.mark.parametrize("where", ["value", "key", "number"])
def test_a_scalar_longer_than_any_field_takes_is_413_before_it_is_decoded(where):
    bound = LIMITS.scalar_bytes
    long = b"a" * bound + b"\xff"  # not UTF-8 past the bound: read whole, this would be a 422
    raw = {
        "value": b'{"question": "' + long + b'"}',
        "key": b'{"' + long + b'": 1}',
        "number": b'{"question": "q", "max_tokens": ' + b"1" * (bound + 1) + b"}",
    }[where]
    with pytest.raises(ApiError) as refused:
        shape.read(raw, LIMITS)
    assert refused.value.status == 413 and refused.value.details["limit"] == bound, refused.value.message
    assert "longer than any field takes" in refused.value.message


def test_a_string_as_long_as_a_field_takes_is_read():
    text = "\U0001f600" * 1000 + "é" * 1000
    limits = shape.BodyLimits(**{**LIMITS.__dict__, "scalar_bytes": len(json.dumps(text))})
    assert shape.read(json.dumps({"question": text}).encode(), limits) == {"question": text}


@pytest.mark.parametrize("text", [
    "plain", "", 'a "quoted" word', "back\\slash", "\\", 'ends in a backslash\\', "tab\there", "\u00e9\U0001f600",
    "\u2028 line separator", '\\"', "a" * 5000 + '"' + "b",
])
def test_strings_with_and_without_escapes_read_as_the_json_module_reads_them(text):
    """A string without a backslash ends at its first quote (found with memchr); one with escapes is stepped through
    by the regex. Both give what json.loads gives, and the value after the string is read from the right offset."""
    raw = json.dumps({"question": text, "stop": [text, "x"], "max_tokens": 3}).encode()
    assert shape.read(raw, LIMITS) == json.loads(raw)
    raw = json.dumps({"question": text}, ensure_ascii=False).encode()
    assert shape.read(raw, LIMITS) == json.loads(raw)


def test_a_raw_control_character_or_an_unclosed_string_is_malformed_either_way():
    for raw in (b'{"question": "a\nb\tc\x01"}', b'{"question": "a\x01"}', b'{"question": "unclosed',
                b'{"question": "esc\\"aped'):
        with pytest.raises(Refused) as refused:
            shape.read(raw, LIMITS)
        assert refused.value.errors()[0]["type"] == "json_invalid", raw
        with pytest.raises(json.JSONDecodeError):
            json.loads(raw)


def test_the_counts_are_checked_before_the_body_is_decoded():
    """Bytes that are not UTF-8 after the value past max_body_values: the 413 comes first, the body is never
    decoded whole."""
    over = b"[" + b",".join([b"1"] * (LIMITS.values + 1)) + b"]"
    raw = b'{"question": "q", "stop": ' + over + b', "x": "\xff"}'
    with pytest.raises(ApiError) as refused:
        body.parse(raw, "application/json", QueryRequest, LIMITS)
    assert refused.value.status == 413 and "JSON values" in refused.value.message


def test_not_utf8_inside_a_string_is_malformed_json_at_its_byte_offset():
    raw = '{"question": "é'.encode() + b'\xff"}'
    with pytest.raises(Refused) as refused:
        body.parse(raw, "application/json", QueryRequest, LIMITS)
    [error] = refused.value.errors()
    assert error["ctx"] == {"error": "not UTF-8 text"} and error["loc"] == ("body", raw.index(b"\xff"))


def test_whitespace_longer_than_one_step_is_skipped():
    gap = b" " * (2 * shape.STEP) + b"\n" * shape.STEP
    assert shape.read(b"{" + gap + b'"a"' + gap + b":" + gap + b"[1," + gap + b"2]" + gap + b"}" + gap, LIMITS) == {
        "a": [1, 2]
    }


def test_a_refusal_does_not_carry_the_frames_of_the_walk():
    """What the walk built (here 100,000 small objects) goes with its frames in the worker thread, not with the error
    on the event loop."""
    docs = b",".join([b'{"text": "d"}'] * (LIMITS.values // 2 + 1))
    with pytest.raises(ApiError) as refused:
        shape.read(b'{"question": "q", "documents": [' + docs + b"]}", LIMITS)
    frames, tb = [], refused.value.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    assert not {"walk", "value", "object", "array"} & set(frames), frames
    assert refused.value.__context__ is None


def test_the_body_is_gathered_in_one_growing_buffer():
    pieces = [b'{"question": ', b'"q"', b"}"]

    class Request:  # what `received` reads of Starlette's request
        async def stream(self):
            for piece in pieces:
                yield piece

    raw = asyncio.run(body.received(Request()))  # type: ignore[arg-type]  # a stand-in for a Starlette Request
    assert isinstance(raw, bytearray) and raw == b"".join(pieces)


def context_texts(context: int = 512) -> length.ContextTexts:
    return length.ContextTexts(length.TokenBound(tiny.tokenizer()), context)


def test_an_answered_body_is_refused_at_the_first_text_past_the_context_and_read_no_further():
    """Two texts that hold at least 300 tokens each by their bytes, then bytes that are not JSON: the second text
    passes the 512-token context, so the 413 comes before the malformed rest is reached."""
    texts = context_texts()
    over = "w" * (texts.bound.longest * 300)
    head = json.dumps({"question": "q", "documents": [{"text": over}, {"text": over}]})[:-2]
    raw = (head + ', {"text": "unclosed \xff').encode()
    with pytest.raises(TextsTooLong) as refused:
        body.parse(raw, "application/json", QueryRequest, LIMITS, texts)
    assert refused.value.prompt_tokens == 600 and refused.value.context == 512
    assert "the first 2" in str(refused.value) and refused.value.__context__ is None
    with pytest.raises(Refused):  # the same body read without the bound is read to its malformed end
        body.parse(raw, "application/json", QueryRequest, LIMITS)


def test_texts_within_the_context_and_a_compile_bodys_texts_are_read_whole():
    """The bound counts only `documents[i].text` of an answered body: a question or a stop string as long is not
    a raw text, and texts that may fit are left to the exact checks after the read."""
    texts = context_texts()
    fits = "w" * (texts.bound.longest * 250)  # 250 tokens at least: two fit the 512-token context
    raw = json.dumps({"question": fits, "documents": [{"text": fits}, {"text": fits}], "stop": fits}).encode()
    assert body.parse(raw, "application/json", QueryRequest, LIMITS, texts).documents[1].text == fits
    assert texts.tokens == 500
    raw = json.dumps({"documents": [{"text": fits}] * 3}).encode()
    assert len(body.parse(raw, "application/json", CompileRequest, LIMITS).documents) == 3


def test_a_text_with_a_lone_surrogate_is_left_to_validation_which_names_it():
    raw = b'{"question": "q", "documents": [{"text": "a\\udfff"}]}'
    with pytest.raises(Refused) as refused:
        body.parse(raw, "application/json", QueryRequest, LIMITS, context_texts())
    assert refused.value.errors()[0]["loc"][:3] == ("body", "documents", 0), refused.value.errors()
