"""The OpenAPI 3.1 document of both faces (docs/http-api.md), served at GET /openapi.json.

Written from what the app serves: every route's `operation` declaration (app/http.py: its
summary, body model, replies) and the JSON Schema of the request and reply models
(app/models.py, app/replies.py, ...). The failure codes' enum and `x-error-codes` come from
poolcore/failures.py via app/error_codes.py.
tests/test_fuzz_openapi.py runs schemathesis to check that the document and the code agree
on what is accepted and answered.
"""

from __future__ import annotations

from flask import Flask, current_app, jsonify
from pydantic import BaseModel, TypeAdapter
from pydantic.json_schema import GenerateJsonSchema, models_json_schema

from app import error_codes, fields, replies
from app.http import Operation, operation

JSON = "application/json"
REF = "#/components/schemas/{model}"
PATH_PARAMETERS = {"run_id": ("The run (lease) id.", fields.RunId), "job_id": ("The job id.", fields.JobId)}
# Routes served by other modules that the document describes.
OTHER_ROUTES = {
    "metrics": Operation("Prometheus metrics (text exposition format).", {200: ("Metrics", str)}, tag="meta"),
}
BAD_INPUT = (
    "Bad input (code BAD_REQUEST): a field is missing or malformed, or the body is not UTF-8, holds "
    f"a lone surrogate, or nests deeper than {fields.MAX_JSON_DEPTH}"
)
TOO_LARGE = f"The body is larger than {fields.MAX_BODY_BYTES} bytes (code PAYLOAD_TOO_LARGE)"
BACKEND_DOWN = "Redis or Docker is unreachable (code REDIS_UNAVAILABLE or BACKEND_UNAVAILABLE)"
BODY_NOTE = (
    "A body that is not a JSON object counts as {}. Strings must be valid Unicode, numbers must fit a "
    f"double, nesting is limited to {fields.MAX_JSON_DEPTH} levels and the body to "
    f"{fields.MAX_BODY_BYTES} bytes."
)
ARCHIVES = ("application/gzip", "application/x-tar", "application/octet-stream")  # POST /v1/tasks
GUARD = {
    401: "POOL_API_TOKEN is set and the bearer token is missing or wrong (code UNAUTHORIZED)",
    403: "POOL_ALLOWED_CLIENTS is set and excludes the caller (code FORBIDDEN)",
}
INFO = {
    "title": "termpool",
    "version": "1",
    "description": "A pool of terminal-bench environments. The pool API is byte-compatible with the "
    "reference pool server and blocks until each operation ends; the runs API (/v1) answers at once "
    "with ids to poll. Every reply is JSON with `ok`.",
}
TAGS = [
    {"name": "pool", "description": "The pool API (blocking)"},
    {"name": "runs", "description": "The runs API (submit and poll)"},
    {"name": "tasks", "description": "Task folders sent by the client, named by their digest"},
    {"name": "meta"},
]
SECURITY = {
    "bearer": {"type": "http", "scheme": "bearer", "description": "Only when POOL_API_TOKEN is set (docs/settings.md)."}
}


class _NoFieldTitles(GenerateJsonSchema):
    """Field titles ("Task Key") only repeat the property names."""

    def field_title_should_be_set(self, schema) -> bool:
        return False


def register(app: Flask) -> None:
    app.add_url_rule("/openapi.json", "openapi", _serve)


@operation("This document.", {200: ("OpenAPI 3.1", dict)}, tag="meta")
def _serve():
    if "openapi" not in current_app.extensions:
        current_app.extensions["openapi"] = document(current_app)
    return jsonify(current_app.extensions["openapi"])


def document(app: Flask) -> dict:
    """The document of every route `app` serves with a declared operation."""
    routes = []
    for rule in app.url_map.iter_rules():
        op = getattr(app.view_functions[rule.endpoint], "operation", None) or OTHER_ROUTES.get(rule.endpoint)
        if op is not None:
            path = rule.rule.replace("<", "{").replace(">", "}")
            routes += [
                (path, method.lower(), op, sorted(rule.arguments)) for method in rule.methods - {"HEAD", "OPTIONS"}
            ]
    refs, schemas = _schemas([op for _, _, op, _ in routes])
    paths: dict = {}
    for path, method, op, arguments in routes:
        paths.setdefault(path, {})[method] = _operation(path, op, arguments, refs)
    return {
        "openapi": "3.1.0",
        "info": INFO,
        "tags": TAGS,
        "paths": paths,
        "x-error-codes": error_codes.rows(),
        "components": {"schemas": schemas, "securitySchemes": SECURITY},
    }


def _schemas(ops: list[Operation]) -> tuple[dict, dict]:
    """Every body (validation) and reply model (serialization) as a component, with a $ref to each."""
    wanted = {(replies.Error, "serialization")}
    for op in ops:
        if op.body is not None:
            wanted.add((op.body, "validation"))
        for reply in op.replies.values():
            if isinstance(reply, tuple) and _is_model(reply[1]):
                wanted.add((reply[1], "serialization"))
    ordered = sorted(wanted, key=lambda pair: pair[0].__name__)
    refs, top = models_json_schema(ordered, ref_template=REF, schema_generator=_NoFieldTitles)
    return refs, top.get("$defs", {})


def _is_model(value) -> bool:
    return isinstance(value, type) and issubclass(value, BaseModel)


def _operation(path: str, op: Operation, arguments: list[str], refs: dict) -> dict:
    out: dict = {"summary": op.summary, "tags": [op.tag]}
    params = [_parameter(name, "path", *PATH_PARAMETERS[name]) for name in arguments]
    params += [_parameter(name, "query", *spec) for name, spec in op.query.items()]
    params += [_parameter(name, "header", *spec) for name, spec in op.headers.items()]
    if params:
        out["parameters"] = params
    responses = {str(status): _reply(reply, refs) for status, reply in op.replies.items()}
    if op.raw_body:
        binary = {"schema": {"type": "string", "format": "binary"}}
        out["requestBody"] = {"required": True, "description": op.raw_body, "content": dict.fromkeys(ARCHIVES, binary)}
    if op.body is not None:
        schema = refs[(op.body, "validation")]
        out["requestBody"] = {"required": True, "description": BODY_NOTE, "content": {JSON: {"schema": schema}}}
        responses.setdefault("400", _reply(BAD_INPUT, refs))
        responses.setdefault("413", _reply(TOO_LARGE, refs))
    if path not in ("/healthz", "/readyz"):  # the optional guard (app/__init__.py) answers everything else
        for status, text in GUARD.items():
            responses.setdefault(str(status), _reply(text, refs))
    if path not in ("/healthz", "/openapi.json"):  # everything else reads state in Redis
        responses.setdefault("503", _reply(BACKEND_DOWN, refs))
    out["responses"] = responses
    return out


def _reply(reply, refs: dict) -> dict:
    """(description, model or type or media type) or an Error's description -> an OpenAPI response."""
    description, body = reply if isinstance(reply, tuple) else (reply, replies.Error)
    if body is str:
        return {"description": description, "content": {"text/plain": {"schema": {"type": "string"}}}}
    if isinstance(body, str):  # a media type: a page the app does not write (gunicorn's own)
        return {"description": description, "content": {body: {"schema": {"type": "string"}}}}
    if body is bytes:  # a tar archive (app/archives_api.py)
        return {
            "description": description,
            "content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}},
        }
    schema = refs[(body, "serialization")] if _is_model(body) else TypeAdapter(body).json_schema()
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _parameter(name: str, where: str, description: str, kind) -> dict:
    adapter = kind if isinstance(kind, TypeAdapter) else TypeAdapter(kind)
    return {
        "name": name,
        "in": where,
        "required": where == "path",
        "description": description,
        "schema": adapter.json_schema(),
    }
