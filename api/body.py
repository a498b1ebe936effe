"""Request bodies read, shape-checked and validated in a worker thread, within a budget of work.

FastAPI would parse a declared body on the event loop (json.loads, then pydantic over every item), and pydantic
reports every error: a 16 MiB body of a million unknown keys is a million errors and an 88 MiB error body. A route
that takes `Body(Model)` instead gets its bytes (bounded in size by app.Guard, gathered without copying the whole)
handled off the loop: read as bytes by api/shape.py, which refuses the body at the first value past a limit (unknown
top-level keys of a strict model, the `documents` count, keys per object, items per array, depth, values in all,
the length of one string: Settings' max_body_*, max_documents and the longest text a field takes), then validated
by pydantic, of whose errors the first `REPORTED` are kept with the count of all.
"""

from __future__ import annotations

from functools import cache
from itertools import groupby, islice
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, Request
from pydantic import AliasChoices, BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from . import shape
from .errors import REPORTED, Refused
from .shape import BodyLimits

if TYPE_CHECKING:
    from ragcache.length import ContextTexts
    from ragcache.request import Limits


def Body(model: type[BaseModel], answered: bool = False) -> Any:  # used like FastAPI's Body
    """A route parameter: the body as `model`, read, checked and validated off the event loop (see above).
    `answered`: the body's raw texts (`documents[i].text`) go into the model's context, so the read stops at the
    first text past what the context can hold (413)."""

    async def read(request: Request) -> BaseModel:
        raw = await received(request)
        ctx = request.app.state.ctx
        texts = ctx.rc.context_texts() if answered else None
        content_type = request.headers.get("content-type", "")
        return await run_in_threadpool(parse, raw, content_type, model, BodyLimits.of(ctx.settings), texts)

    return Depends(read)


async def received(request: Request) -> bytearray:
    """The body, grown in place as its pieces arrive (a large bytearray's realloc remaps its pages, no copy).
    Starlette's request.body() joins the pieces at the end: for a body at the size limit that is one copy of tens of
    MiB, on the event loop, holding the GIL for tens of milliseconds."""
    raw = bytearray()
    async for piece in request.stream():
        raw += piece
    return raw


def parse(
    raw: bytes | bytearray,
    content_type: str,
    model: type[BaseModel],
    limits: BodyLimits,
    texts: ContextTexts | None = None,
) -> BaseModel:
    if not _is_json(content_type):  # as FastAPI does (strict_content_type): a body of another type is not JSON
        why = f"a body of type {content_type!r} is not read" if content_type else "a body without a Content-Type"
        msg = f"send JSON with Content-Type: application/json ({why})"
        raise Refused([{"type": "model_attributes_type", "loc": ("body",), "msg": msg}])
    strict = model.model_config.get("extra") == "forbid"
    data = shape.read(raw, limits, field_names(model) if strict else None, texts)  # read as bytes: api/shape.py
    try:  # Python's JSON scanner keeps lone surrogates: the schema's own check (schemas.Text) names the field
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e["loc"])} for e in islice(exc.errors(include_url=False), REPORTED)]
        raise Refused(errors, total=exc.error_count()) from None


@cache  # one per route model
def field_names(model: type[BaseModel]) -> frozenset[str]:
    """The top-level keys `model` takes: its fields' names and their aliases."""
    names = set()
    for name, field in model.model_fields.items():
        alias = field.validation_alias
        names.update([name, *(alias.choices if isinstance(alias, AliasChoices) else [alias or field.alias or name])])
    return frozenset(n for n in names if isinstance(n, str))


def _is_json(content_type: str) -> bool:
    """Whether a body is JSON by its type. One with none is not: a browser sends a body without a type (fetch() of a
    Blob) from any page to a server on localhost without a CORS preflight, and such a page would then upload,
    query and delete on a server with no API key."""
    kind = content_type.split(";", 1)[0].strip().lower()
    return kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def documented(model: type[BaseModel]) -> dict:
    """The route's `openapi_extra`: the body is not a FastAPI parameter, so its schema is declared here."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def document(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Put the body models' schemas (and those they refer to) into the app's OpenAPI components, with every bound the
    server enforces on them (`bounds`): a client that follows the schema is refused for none of them."""
    build = app.openapi

    def with_bodies() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        openapi = build()  # kept as app.openapi_schema, so the bodies go in once
        schemas = openapi.setdefault("components", {}).setdefault("schemas", {})
        ctx = app.state.ctx
        shape_limits = BodyLimits.of(ctx.settings)
        for model in models:
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            parts = {**schema.pop("$defs", {}), model.__name__: schema}
            for part in parts.values():
                shaped_schema(part, shape_limits)
            schemas.update(parts)
            schema["description"] = f"{schema.get('description', '')}\n\n{whole_body(shape_limits)}".strip()
        for name, props in bounds(ctx.limits, ctx.rc.layers).items():
            if name in schemas:
                bounded_schema(schemas[name], props)
        for name, rule in WHOLE_BODY_RULES.items():
            if name in schemas:
                schemas[name].update(rule)
        return openapi

    app.openapi = with_bodies  # type: ignore[method-assign]  # FastAPI's documented way to extend its schema


def bounds(limits: Limits, layers: int) -> dict[str, dict[str, dict[str, dict]]]:
    """{model: {property: {JSON type: keywords}}}: what ragcache.request checks (the server's Limits, a text with
    no character but whitespace, the model's layers for check_layer), said in each model's schema where a property
    of that type appears."""
    link = {"check_layer": {"integer": {"maximum": layers - 1}}}
    question: dict[str, Any] = {"string": {"maxLength": limits.question_chars, "pattern": NONBLANK}}
    text: dict[str, Any] = {"string": {"maxLength": limits.document_chars, "pattern": NONBLANK}}
    one = {"type": "string", "maxLength": limits.stop_chars}
    refs = {"anyOf": [{"type": "string", "pattern": DOCUMENT_ID}, {"$ref": "#/components/schemas/TextDocument"}]}
    sampling: dict[str, Any] = {
        "documents": {"array": {"maxItems": limits.documents, "items": refs}},
        "max_tokens": {"integer": {"maximum": limits.new_tokens}},
        "stop": {"string": {"maxLength": limits.stop_chars}, "array": {"maxItems": limits.stop_strings, "items": one}},
        "system": {"string": {"maxLength": limits.question_chars}},
    }
    prompt: dict[str, Any] = {
        **question,
        "array": {"minItems": 1, "maxItems": 1, "items": {"type": "string", **question["string"]}},
    }
    return {
        "CompileRequest": {"documents": {"array": {"maxItems": limits.documents}}, "text": text},
        "DocumentIn": {"text": text},
        "TextDocument": {"text": text},
        "LinkOptions": link,
        "QueryRequest": {**sampling, **link, "question": question},
        "CompletionRequest": {**sampling, "prompt": prompt},
        "ChatRequest": {**sampling, "messages": {"array": conversation(limits)}},
        "InfillRequest": {
            **sampling,
            "prefix": {"string": {"maxLength": limits.document_chars}},
            "suffix": {"string": {"maxLength": limits.document_chars}},
        },
    }


def conversation(limits: Limits) -> dict:
    """The chat's messages as api/openai_compat.chat_question takes them: one user message, after an optional system
    (or developer) one; as text, the user's not blank, each within the question's length (text parts are joined
    first, so only their type is said)."""
    text_part = {
        "allOf": [{"$ref": "#/components/schemas/TextPart"}],
        "properties": {"type": {"enum": ["text"]}, "text": {"type": "string"}},
        "required": ["type", "text"],
    }  # _text: a part of another type, or one without its text, is refused
    parts = {"type": "array", "items": text_part}
    user = {"anyOf": [{"type": "string", "maxLength": limits.question_chars, "pattern": NONBLANK}, parts]}
    system = {"anyOf": [{"type": "string", "maxLength": limits.question_chars}, parts, {"type": "null"}]}

    def message(roles: list[str], content: dict) -> dict:
        ref = {"$ref": "#/components/schemas/ChatMessage"}
        return {"allOf": [ref], "properties": {"role": {"enum": roles}, "content": content}, "required": ["content"]}

    leading = message(["system", "developer"], system)
    return {
        "minItems": 1,
        "maxItems": 2,
        "oneOf": [
            {"prefixItems": [message(["user"], user)], "maxItems": 1},
            {"prefixItems": [{**leading, "required": []}, message(["user"], user)], "minItems": 2},
        ],
    }


DOCUMENT_ID = "^[0-9a-f]{32}$"  # ragcache.store.keys.is_document_id: what POST /v1/documents returns

# rules over a whole body, by model: an infill needs text on one side of the hole at least
# (ragcache.request.validate_infill); an upload is a list of documents or one text, with its metadata inside each
# document of a list (CompileRequest.one_shape)
WHOLE_BODY_RULES = {
    "InfillRequest": {
        "anyOf": [
            {"required": [side], "properties": {side: {"type": "string", "minLength": 1}}}
            for side in ("prefix", "suffix")
        ]
    },
    "CompileRequest": {
        "oneOf": [
            {
                "required": ["documents"],
                "properties": {"documents": {"type": "array"}, "metadata": {"maxProperties": 0}},
            },
            {"required": ["text"], "properties": {"text": {"type": "string"}}},
        ]
    },
}


def shaped_schema(node: Any, limits: BodyLimits) -> None:
    """Every object and array of a request body's schema bounded as api/shape.py reads them (keys per object, items
    per array), where the schema sets no tighter bound of its own; `documents` is bounded by its own rule."""
    if isinstance(node, list):
        for item in node:
            shaped_schema(item, limits)
        return
    if not isinstance(node, dict):
        return
    if node.get("type") == "object":
        node["maxProperties"] = min(node.get("maxProperties", limits.keys), limits.keys)
    if node.get("type") == "array":
        node["maxItems"] = min(node.get("maxItems", limits.items), limits.items)
    for value in node.values():
        shaped_schema(value, limits)


def whole_body(limits: BodyLimits) -> str:
    """What api/shape.py holds a whole body to and no JSON Schema keyword can say."""
    return (
        f"The body as a whole: at most {limits.values:,} JSON values (objects, arrays, strings, numbers, literals), "
        f"objects and arrays nested at most {limits.depth} deep, and no string longer than {limits.scalar_bytes:,} "
        "bytes as sent (413 past a count, 422 past the depth)."
    )


def bounded_schema(schema: dict, bounds: dict[str, dict[str, dict]]) -> dict:
    """`schema` with each named property's variants of the given JSON types updated: {name: {type: keywords}}."""
    for name, by_type in bounds.items():
        prop = schema.get("properties", {}).get(name, {})
        for variant in [prop, *prop.get("anyOf", [])]:
            variant.update(by_type.get(variant.get("type"), {}))
    return schema


def _nonblank() -> str:
    """A character class of every character that str.strip() keeps: a string matches (anywhere) exactly when it
    is not empty and not all whitespace, as ragcache.request decides; built from str.isspace, so the two agree."""
    spaces = [c for c in range(0x10000) if chr(c).isspace()]  # every one is below U+10000
    runs = [[c for _, c in run] for _, run in groupby(enumerate(spaces), lambda ic: ic[1] - ic[0])]
    return "[^" + "".join(f"\\u{r[0]:04x}" + (f"-\\u{r[-1]:04x}" if len(r) > 1 else "") for r in runs) + "]"


NONBLANK = _nonblank()
