"""What both HTTP faces share: the engine, JSON replies, and request bodies parsed into models.

`operation` declares a route's body model, replies and summary once: the view gets its body
validated (a BadRequest with one readable text otherwise) and app/apidoc.py reads the same
declaration to write /openapi.json.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field

from flask import current_app, jsonify, request
from pydantic import BaseModel, ValidationError

from app import tenancy
from app.engine import Engine
from app.fields import MAX_JSON_DEPTH, explain
from app.replies import Error, Reply
from poolcore import failures

_SURROGATE = re.compile(r"[\ud800-\udfff]")


class BadRequest(ValueError):
    """Client error: answered 400 with this message."""


def engine() -> Engine:
    return current_app.extensions["termpool"]


# ---- replies ------------------------------------------------------------------------------------
def ok(reply: Reply | None = None, status: int = 200):
    """A successful reply: `"ok": true`, then the fields the view set (in the model's order)."""
    fields = reply.model_dump(mode="json", exclude_unset=True, exclude={"ok"}) if reply else {}
    return jsonify({"ok": True, **fields}), status


def fail(code: str, error: str, status: int, headers=None):
    """A refusal: `ok: false`, the text, the failure code and whether retrying helps."""
    body = jsonify(Error(error=error, **failures.fields(code)).model_dump(mode="json"))
    return (body, status, headers) if headers else (body, status)


def fail_on(status_of):
    """The `fail` of one face, whose status comes from the code (app/error_codes.py)."""

    def fail_with_code(code: str, error: str):
        return fail(code, error, status_of(code) or 500)

    return fail_with_code


# ---- request bodies -----------------------------------------------------------------------------
@dataclass
class Operation:
    """What /openapi.json says about one route; `body` is also what the view receives."""

    summary: str
    replies: dict = field(default_factory=dict)  # status -> (description, model) or an error's description
    body: type[BaseModel] | None = None
    root: str = ""  # the body's name in error texts ("tool_call.name ...")
    tag: str = "pool"
    query: dict = field(default_factory=dict)  # name -> (description, type)
    headers: dict = field(default_factory=dict)  # request headers it reads: name -> (description, type)
    raw_body: str = ""  # a body that is not JSON (an archive): what it is; the view reads it itself


def operation(summary: str, replies: dict, body: type[BaseModel] | None = None, **more):
    """Declare a route (see Operation); with a body model, the view is called with `body=`."""
    op = Operation(summary, replies, body, **more)

    def declare(view):
        @functools.wraps(view)
        def validated(**kwargs):
            if body is not None:
                kwargs["body"] = parse(body, op.root)
            return view(**kwargs)

        validated.operation = op
        return validated

    return declare


def parse(model: type[BaseModel], root: str = ""):
    """The request's body validated by `model`, with the settings as context (paths resolve)."""
    try:
        return model.model_validate(json_body(), context={"cfg": engine().cfg})
    except ValidationError as exc:
        raise BadRequest(explain(exc, root)) from None


def json_body() -> dict:
    """The request's JSON object; anything else (no body, not JSON, a list) counts as {}.

    Refused with a 400 instead: a body that is not UTF-8, holds a lone surrogate or a number
    that is not finite, or nests deeper than MAX_JSON_DEPTH. The parser's own recursion
    limit is caught, so a deeper body never reaches code that recurses.
    """
    raw = request.get_data(cache=True)  # over MAX_CONTENT_LENGTH: werkzeug raises the 413
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadRequest(f"the request body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise BadRequest(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except BadRequest:
        raise
    except ValueError:
        return {}
    check_json_tree(body)
    return tenancy.disguise_body(body) if isinstance(body, dict) else {}  # another tenant's lease


def _no_constant(name: str):
    raise BadRequest(f"{name} is not a JSON number")


def _fits_double(number: int | float) -> bool:
    """False for 1e400 (parsed as inf) and for integers beyond any float, like 10**400."""
    try:
        return math.isfinite(float(number))
    except OverflowError:
        return False


def check_json_tree(value) -> None:
    """Depth, valid Unicode and numbers that fit a double everywhere in a parsed body, without recursion."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                raise BadRequest("the request body holds a lone surrogate (\\ud800-\\udfff): not valid Unicode")
        elif isinstance(item, (int, float)) and not isinstance(item, bool):
            if not _fits_double(item):
                raise BadRequest("the request body holds a number too large for a 64-bit float")
        elif isinstance(item, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise BadRequest(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
            children = item if isinstance(item, list) else [*item.keys(), *item.values()]
            stack.extend((child, depth + 1) for child in children)
