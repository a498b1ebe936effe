"""Request bodies parsed and validated in a worker thread, with the document count enforced while parsing.

FastAPI parses a declared body on the event loop (json.loads, then pydantic over every item): a body of millions of
tiny documents, under the size limit, held every other request, /health included, for seconds before the count
check refused it. A route that takes `Body(Model)` instead gets the bytes (bounded in size by app.Guard) validated
off the loop by pydantic's own JSON parser, with every `documents` list capped at the server's limit: pydantic
compares the array's length with the cap before it builds one item, so an oversized list costs a parse, not a
model per document.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Annotated, Any, get_args, get_origin

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field, ValidationError, create_model
from starlette.concurrency import run_in_threadpool

from .errors import ApiError


def Body(model: type[BaseModel]) -> Any:  # noqa: N802 - used like FastAPI's Body
    """A route parameter: the body as `model`, read off the event loop with its documents capped (see above)."""
    async def read(request: Request) -> BaseModel:
        raw = await request.body()
        limit = request.app.state.ctx.settings.max_documents
        return await run_in_threadpool(parse, raw, request.headers.get("content-type", ""), bounded(model, limit))
    return Depends(read)


def parse(raw: bytes, content_type: str, model: type[BaseModel]) -> BaseModel:
    if not _is_json(content_type):  # as FastAPI does: a body of another type is not read as JSON
        raise RequestValidationError([{"type": "model_attributes_type", "loc": ("body",),
                                       "msg": "Input should be a JSON object"}])
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        if not _lone_surrogate(exc):
            raise _refusal(exc) from None
        refused = exc
    try:  # Python's parser keeps lone surrogates, so the field holding one is named by the schema's own check
        return model.model_validate(json.loads(raw))
    except ValidationError as exc:
        raise _refusal(exc) from None
    except (ValueError, RecursionError):  # malformed in another way too: the first refusal says where
        raise _refusal(refused) from None


def _lone_surrogate(exc: ValidationError) -> bool:
    (first, *_) = exc.errors(include_url=False)
    reason = str((first.get("ctx") or {}).get("error", ""))
    return first["type"] == "json_invalid" and ("surrogate" in reason or "hex escape" in reason)


def _refusal(exc: ValidationError) -> Exception:
    errors = exc.errors(include_url=False)
    over = next((e for e in errors if e["type"] == "too_long" and e["loc"] == ("documents",)), None)
    if over is not None:
        limit, got = over["ctx"]["max_length"], over["ctx"]["actual_length"]
        return ApiError(413, "payload_too_large", f"{got} documents in one request; at most {limit}", limit=limit, got=got)
    return RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors])


def _is_json(content_type: str) -> bool:
    kind = content_type.split(";", 1)[0].strip().lower()
    return not kind or kind == "application/json" or (kind.startswith("application/") and kind.endswith("+json"))


@lru_cache(maxsize=None)  # one per (route model, limit): a handful per server
def bounded(model: type[BaseModel], max_documents: int) -> type[BaseModel]:
    """`model` with its `documents` list (if it has one) holding at most `max_documents` items."""
    field = model.model_fields.get("documents")
    if field is None:
        return model
    optional = type(None) in get_args(field.annotation)  # `list[X] | None`, or `list[X]`
    items = next(a for a in get_args(field.annotation) if get_origin(a) is list) if optional else field.annotation
    capped = Annotated[items, Field(max_length=max_documents)]
    return create_model(model.__name__, __base__=model, documents=(capped | None if optional else capped, field))


def documented(model: type[BaseModel]) -> dict:
    """The route's `openapi_extra`: the body is not a FastAPI parameter, so its schema is declared here."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def document(app: FastAPI, models: list[type[BaseModel]]) -> None:
    """Put the body models' schemas (and those they refer to) into the app's OpenAPI components."""
    build = app.openapi

    def with_bodies() -> dict:
        if app.openapi_schema is None:
            schemas = build().setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
        return app.openapi_schema

    app.openapi = with_bodies
