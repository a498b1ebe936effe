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
from itertools import islice
from typing import Any

from fastapi import Depends, FastAPI, Request
from pydantic import AliasChoices, BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from . import shape
from .errors import REPORTED, Refused
from .shape import BodyLimits


def Body(model: type[BaseModel]) -> Any:  # used like FastAPI's Body
    """A route parameter: the body as `model`, read, checked and validated off the event loop (see above)."""

    async def read(request: Request) -> BaseModel:
        raw = await received(request)
        limits = BodyLimits.of(request.app.state.ctx.settings)
        return await run_in_threadpool(parse, raw, request.headers.get("content-type", ""), model, limits)

    return Depends(read)


async def received(request: Request) -> bytearray:
    """The body, grown in place as its pieces arrive (a large bytearray's realloc remaps its pages, no copy).
    Starlette's request.body() joins the pieces at the end: for a body at the size limit that is one copy of tens of
    MiB, on the event loop, holding the GIL for tens of milliseconds."""
    raw = bytearray()
    async for piece in request.stream():
        raw += piece
    return raw


def parse(raw: bytes | bytearray, content_type: str, model: type[BaseModel], limits: BodyLimits) -> BaseModel:
    if not _is_json(content_type):  # as FastAPI does: a body of another type is not read as JSON
        raise Refused([{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a JSON object"}])
    strict = model.model_config.get("extra") == "forbid"
    data = shape.read(raw, limits, field_names(model) if strict else None)  # read as bytes: see api/shape.py
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
    kind = content_type.split(";", 1)[0].strip().lower()
    return not kind or kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


def documented(model: type[BaseModel]) -> dict:
    """The route's `openapi_extra`: the body is not a FastAPI parameter, so its schema is declared here."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def document(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Put the body models' schemas (and those they refer to) into the app's OpenAPI components, with the server's
    own bounds on `documents` and `max_tokens`: a client that follows the schema is not refused for them."""
    build = app.openapi

    def with_bodies() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        openapi = build()  # kept as app.openapi_schema, so the bodies go in once
        schemas = openapi.setdefault("components", {}).setdefault("schemas", {})
        settings = app.state.ctx.settings
        bounds = {
            "documents": ("array", "maxItems", settings.max_documents),
            "max_tokens": ("integer", "maximum", settings.max_new_tokens_limit),
        }
        for model in models:
            schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[model.__name__] = bounded_schema(schema, bounds)
        return openapi

    app.openapi = with_bodies  # type: ignore[method-assign]  # FastAPI's documented way to extend its schema


def bounded_schema(schema: dict, bounds: dict[str, tuple[str, str, int]]) -> dict:
    """`schema` with each named property's variant of the given type bounded: {name: (type, keyword, bound)}."""
    for name, (kind, keyword, bound) in bounds.items():
        prop = schema.get("properties", {}).get(name, {})
        for variant in [prop, *prop.get("anyOf", [])]:
            if variant.get("type") == kind:
                variant[keyword] = bound
    return schema
