"""The OpenAPI 3.1 document of both faces (docs/http-api.md), served at GET /openapi.json.

Kept as Python data next to the code rather than generated from it: the pool API's shapes
are a compatibility contract that must not drift with refactors, and the test suite checks
that every route the app serves is described here. The failure codes are the exception:
their enum and the `x-error-codes` table come from termpool/failures.py via app/error_codes.py.
The input constraints (maxLength, pattern, bounds) are app/validation.py's constants, and tests/test_fuzz_openapi.py runs schemathesis to
check that the document and the code agree on what is accepted and answered.
"""

from __future__ import annotations

import copy
import functools

from app import error_codes
from app import validation as limits
from termpool.failures import CODES

JSON = "application/json"
RUN_STATES = ["allocated", "starting", "ready", "busy", "evaluating", "evaluated", "closing", "closed", "failed"]
JOB_STATES = ["queued", "running", "succeeded", "failed"]


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _obj(required: list[str] | None = None, **props) -> dict:
    schema = {"type": "object", "properties": props}
    if required:
        schema["required"] = required
    return schema


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _body(schema: dict, required: bool = True) -> dict:
    return {"required": required, "content": {JSON: {"schema": schema}}}


def _reply(description: str, schema: dict) -> dict:
    return {"description": description, "content": {JSON: {"schema": schema}}}


def _error(description: str) -> dict:
    return _reply(description, _ref("Error"))


def _ok(**props) -> dict:
    return _obj(["ok", *props], ok={"const": True}, **props)


def _op(summary: str, responses: dict, body: dict | None = None, params: list | None = None, tag: str = "pool") -> dict:
    op = {"summary": summary, "tags": [tag], "responses": responses}
    if body is not None:
        op["requestBody"] = body
    if params:
        op["parameters"] = params
    return op


def _path_param(name: str, description: str, pattern: str) -> dict:
    return {
        "name": name,
        "in": "path",
        "required": True,
        "description": description,
        "schema": {"type": "string", "pattern": pattern},
    }


STR = {"type": "string"}
NUM = {"type": "number"}
# Input constraints, all from app/validation.py (the checks the code makes).
ID = {
    "type": "string",
    "minLength": 1,
    "maxLength": limits.MAX_ID_LENGTH,
    "pattern": limits.PRINTABLE_PATTERN,
    "description": "Printable: no control characters.",
}
SCALAR_ID = {
    "anyOf": [
        {"type": "string", "maxLength": limits.MAX_ID_LENGTH, "pattern": limits.PRINTABLE_PATTERN},
        {"type": "integer", "minimum": limits.MIN_INTEGER, "maximum": limits.MAX_INTEGER},
        {"type": "null"},
    ]
}
RUN_CTX_ID = {
    "anyOf": [
        {"type": "string", "maxLength": limits.MAX_UID_LENGTH, "pattern": limits.PRINTABLE_PATTERN},
        {"type": "integer", "minimum": limits.MIN_INTEGER, "maximum": limits.MAX_INTEGER},
        {"type": "null"},
    ]
}
PATH = {"type": "string", "minLength": 1, "maxLength": limits.MAX_PATH_LENGTH, "pattern": limits.PRINTABLE_PATTERN}
TASK_NAME = {
    "type": "string",
    "minLength": 1,
    "maxLength": limits.MAX_TASK_NAME_LENGTH,
    "pattern": limits.TASK_NAME_PATTERN,
    "description": "Names the task's Docker images and containers: letters and digits joined by '-', '.' "
    "or '_' (one or two).",
}
TOOL_NAME = {**ID, "description": "An unknown name is not an HTTP error: the observation says so."}
RUN_ID = {"type": "string", "pattern": limits.RUN_ID_PATTERN}
JOB_ID = {"type": "string", "pattern": limits.JOB_ID_PATTERN}
FLAG = {"type": ["boolean", "null"], "default": False}
LEASE_ID = {**ID, "description": "The run id from /allocate."}
LEASE = _obj(["lease_id"], lease_id=LEASE_ID)
BAD_INPUT = _error(
    "Bad input (code BAD_REQUEST): a field is missing or malformed, or the body is not UTF-8, holds "
    f"a lone surrogate, or nests deeper than {limits.MAX_JSON_DEPTH}"
)
TOO_LARGE = _error(f"The body is larger than {limits.MAX_BODY_BYTES} bytes (code PAYLOAD_TOO_LARGE)")
BACKEND_DOWN = _error("Redis or Docker is unreachable (code BACKEND_UNAVAILABLE)")
BODY_NOTE = (
    "A body that is not a JSON object counts as {}. Strings must be valid Unicode, numbers must fit a "
    f"double, nesting is limited to {limits.MAX_JSON_DEPTH} levels and the body to "
    f"{limits.MAX_BODY_BYTES} bytes."
)
GUARD = {
    "401": _error("POOL_API_TOKEN is set and the bearer token is missing or wrong (code UNAUTHORIZED)"),
    "403": _error("POOL_ALLOWED_CLIENTS is set and excludes the caller (code FORBIDDEN)"),
}
UNAVAILABLE = _error(
    "Docker or the run's worker host could not be reached (BACKEND_UNAVAILABLE, HOST_LOST, WORKERS_DOWN): retry"
)

CODE = {
    "enum": list(CODES),
    "description": "Failure code; x-error-codes lists each with its kind, retryability and status per face.",
}
RETRYABLE = {
    "type": "boolean",
    "description": "True when running the episode again can help (an "
    "infrastructure error or full capacity); false for client "
    "and task errors.",
}


def _schemas() -> dict:
    from app.runs_api import MAX_SCRIPT_BYTES, MAX_SCRIPT_STEPS  # not at import time: runs_api imports this module

    timeout = {"description": "Seconds; a value that is not a positive number is ignored."}
    return {
        "Error": _obj(["ok", "error"], ok={"const": False}, error=STR, code=CODE, retryable=RETRYABLE),
        "TaskMeta": _obj(
            ["task_name"],
            task_name=TASK_NAME,
            task_path={
                **PATH,
                "description": "Relative to DATASET_DIR (an absolute path inside it is "
                "accepted); defaults to task_name. Each component at "
                f"most {limits.MAX_PATH_PART_BYTES} bytes.",
            },
            instruction={"type": "string", "maxLength": limits.MAX_TEXT_LENGTH, "pattern": limits.TEXT_PATTERN},
        ),
        "RunCtx": _obj(
            uid=RUN_CTX_ID,
            group_index=RUN_CTX_ID,
            sample_index=RUN_CTX_ID,
            log_dir={
                "type": ["string", "null"],
                "maxLength": limits.MAX_PATH_LENGTH,
                "pattern": limits.PRINTABLE_PATTERN,
                "description": "Inside TBENCH_OUTPUT_ROOT (relative to it, or absolute); empty or "
                "null: the default. Each component at most "
                f"{limits.MAX_PATH_PART_BYTES} bytes.",
            },
        ),
        "TaskTimeouts": {
            "properties": {key: timeout for key in limits.TIMEOUT_KEYS},
            "description": "Seconds per step, overriding the settings. Not an object, other keys, "
            "and values that are not positive numbers are ignored.",
        },
        "ToolCall": _obj(
            ["name"],
            name=TOOL_NAME,
            arguments={
                "type": ["object", "null"],
                "description": "Absent or null counts as {}. Arguments the tool cannot take "
                "give a [TOOL_ERROR] observation, not an HTTP error.",
            },
        ),
        "Tests": {
            "type": "object",
            "additionalProperties": {"enum": ["passed", "failed"]},
            "description": "Test name -> outcome.",
        },
        "Run": _obj(
            ["run_id", "task_key", "state", "host", "jobs"],
            run_id=RUN_ID,
            task_key=STR,
            state={"enum": RUN_STATES},
            host=STR,
            created_at=NUM,
            last_used_at=_nullable(NUM),
            user_msg=_nullable(STR),
            tool_schemas=_nullable({"type": "array", "items": {"type": "object"}}),
            score=_nullable(NUM),
            tests=_nullable(_ref("Tests")),
            error=_nullable(STR),
            code=_nullable(CODE),
            retryable=_nullable(RETRYABLE),
            jobs={"type": "array", "items": JOB_ID, "description": "Job ids, oldest first."},
        ),
        "Job": _obj(
            ["job_id", "run_id", "kind", "state"],
            job_id=JOB_ID,
            run_id=RUN_ID,
            kind={"enum": ["start", "tool_call", "evaluation", "close"]},
            state={"enum": JOB_STATES},
            result={
                "description": "start: {user_msg, tool_schemas}; tool_call: the observation text; "
                "evaluation: {score, tests}; close: {containers_removed}."
            },
            error=_nullable(STR),
            code=_nullable(CODE),
            retryable=_nullable(RETRYABLE),
            attempts={
                "type": ["integer", "null"],
                "description": "Tries so far: 1, plus one per automatic retry after a transient Docker failure.",
            },
            queued_at=NUM,
            started_at=_nullable(NUM),
            finished_at=_nullable(NUM),
        ),
        "RunRequest": _obj(
            ["task_meta"],
            task_meta=_ref("TaskMeta"),
            run_ctx=_nullable(_ref("RunCtx")),
            task_timeouts=_ref("TaskTimeouts"),
            task_key={**SCALAR_ID, "description": "Capacity key; defaults to task_meta.task_name."},
            request_id={**SCALAR_ID, "description": "Same task_key and request_id within 300 s: same run."},
            script={
                "type": ["array", "null"],
                "maxItems": MAX_SCRIPT_STEPS,
                "items": _ref("ToolCall"),
                "description": "Tool calls run after the start, in order, each as its own job; at most "
                f"{MAX_SCRIPT_BYTES} bytes of JSON.",
            },
            evaluate={**FLAG, "description": "Run the tests after the script."},
            close={**FLAG, "description": "Close the run at the end, or on a failure."},
        ),
    }


def _pool_paths() -> dict:
    # The reference answers 500 for an unknown lease and a run that was not reset; routers expect it.
    lease_ops = {
        "/heartbeat": (
            "Mark the lease as used.",
            LEASE,
            _ok(),
            {"500": _error("Unknown run_lease_id (code UNKNOWN_LEASE)")},
        ),
        "/exec_tool": (
            "Run one tool call and wait for its observation.",
            _obj(["lease_id", "tool_call"], lease_id=LEASE_ID, tool_call=_ref("ToolCall")),
            _ok(observation=STR),
            {"500": _error("Unknown lease or run not reset; code says which"), "503": UNAVAILABLE},
        ),
        "/evaluate": (
            "Run the task's tests and wait for the score.",
            LEASE,
            _ok(score=NUM),
            {
                "500": _error(
                    "Tests timed out (TESTS_TIMEOUT), output unparsable (TESTS_UNPARSABLE), or run not reset"
                ),
                "503": UNAVAILABLE,
            },
        ),
        "/close": (
            "Release the lease; the teardown may finish after the reply.",
            LEASE,
            _ok(found={"type": "boolean", "description": "False when unknown or already closed."}),
            {},
        ),
    }
    paths = {
        "/healthz": {"get": _op("Liveness.", {"200": _reply("Alive", _ok())})},
        "/status": {
            "get": _op(
                "Capacity and live runs per task key.",
                {
                    "200": _reply(
                        "Pool status",
                        _ok(
                            pool=_obj(
                                max_tasks={"type": "integer"},
                                active_tasks={"type": "integer"},
                                max_runs_per_task={"type": "integer"},
                                total_active_runs={"type": "integer"},
                                pending_closes={"type": "integer"},
                                tasks={"type": "object"},
                            )
                        ),
                    ),
                    "500": _error("Internal error"),
                },
            )
        },
        "/allocate": {
            "post": _op(
                "Lease a run slot for a task key.",
                {
                    "200": _reply("Leased", _ok(lease_id=RUN_ID, reused={"type": "boolean"})),
                    "400": _error("task_key is required, or a field is malformed (code BAD_REQUEST)"),
                    "429": _error("No capacity; code TASK_SLOTS_EXHAUSTED or RUN_SLOTS_EXHAUSTED"),
                },
                _body(_obj(["task_key"], task_key=ID, request_id=SCALAR_ID)),
            )
        },
        "/reset": {
            "post": _op(
                "Start (or restart) the run's environment and wait for it.",
                {
                    "200": _reply(
                        "Started", _ok(user_msg=STR, tool_schemas={"type": "array", "items": {"type": "object"}})
                    ),
                    "500": _error("Unknown lease, or the start failed; error says why, code what kind of failure"),
                    "503": UNAVAILABLE,
                },
                _body(
                    _obj(
                        ["lease_id", "task_meta"],
                        lease_id=LEASE_ID,
                        task_meta=_ref("TaskMeta"),
                        run_ctx=_nullable(_ref("RunCtx")),
                        task_timeouts=_ref("TaskTimeouts"),
                    )
                ),
            )
        },
    }
    for path, (summary, body, success, failures) in lease_ops.items():
        paths[path] = {"post": _op(summary, {"200": _reply("Done", success), **failures}, _body(body))}
    return paths


def _runs_paths() -> dict:
    run_id = _path_param("run_id", "The run (lease) id.", limits.RUN_ID_PATTERN)
    accepted = _reply("Accepted; poll the job", _ok(job_id=JOB_ID))
    unknown_run = _error("Unknown run (code UNKNOWN_RUN)")
    wrong_state = _error("Run not started (RUN_NOT_READY) or closing/closed (RUN_CLOSED)")
    submitted = _ok(
        run_id=RUN_ID,
        job_id=_nullable(JOB_ID),
        state={"enum": RUN_STATES},
        reused={"type": "boolean"},
        jobs=_obj(
            start=JOB_ID,
            tool_calls={"type": "array", "items": JOB_ID},
            evaluation=_nullable(JOB_ID),
            close=_nullable(JOB_ID),
        ),
    )
    from app.runs_api import MAX_WAIT

    wait = {
        "name": "wait",
        "in": "query",
        "required": False,
        "schema": {"type": "number", "minimum": 0, "maximum": MAX_WAIT},
        "description": "Hold the request until the job has ended or this many seconds have passed.",
    }
    return {
        "/v1/runs": {
            "post": _op(
                "Allocate and start a run; optionally a whole episode in one request.",
                {
                    "202": _reply("Accepted; job_id is the start job, jobs lists every step", submitted),
                    "429": _error("No capacity, as /allocate"),
                },
                _body(_ref("RunRequest")),
                tag="runs",
            )
        },
        "/v1/runs/{run_id}": {
            "get": _op(
                "A run's record.",
                {"200": _reply("The run", _ok(run=_ref("Run"))), "404": unknown_run},
                params=[run_id],
                tag="runs",
            ),
            "delete": _op(
                "Release the run and tear it down (idempotent).",
                {
                    "202": _reply("Released; job_id is the teardown", _ok(job_id=JOB_ID, found={"const": True})),
                    "200": _reply(
                        "Already closing or closed; job_id is the newest close job",
                        _ok(job_id=_nullable(JOB_ID), found={"const": False}, state={"enum": RUN_STATES}),
                    ),
                    "404": unknown_run,
                },
                params=[run_id],
                tag="runs",
            ),
        },
        "/v1/runs/{run_id}/tool_calls": {
            "post": _op(
                "Queue one tool call.",
                {"202": accepted, "404": unknown_run, "409": wrong_state},
                _body(_ref("ToolCall")),
                [run_id],
                tag="runs",
            )
        },
        "/v1/runs/{run_id}/evaluation": {
            "post": _op(
                "Queue the task's tests (a body, if any, is ignored).",
                {"202": accepted, "404": unknown_run, "409": wrong_state},
                params=[run_id],
                tag="runs",
            )
        },
        "/v1/jobs/{job_id}": {
            "get": _op(
                "A job's record, optionally long-polled.",
                {
                    "200": _reply("The job (maybe still queued or running when wait ran out)", _ok(job=_ref("Job"))),
                    "400": _error(f"wait is not a number from 0 to {MAX_WAIT:g} (code BAD_REQUEST)"),
                    "404": _error("Unknown job (code UNKNOWN_JOB)"),
                },
                params=[_path_param("job_id", "The job id.", limits.JOB_ID_PATTERN), wait],
                tag="runs",
            )
        },
        "/metrics": {
            "get": _op(
                "Prometheus metrics (text exposition format).",
                {"200": {"description": "Metrics", "content": {"text/plain": {"schema": {"type": "string"}}}}},
                tag="meta",
            )
        },
        "/openapi.json": {
            "get": _op(
                "This document.",
                {"200": {"description": "OpenAPI 3.1", "content": {JSON: {"schema": {"type": "object"}}}}},
                tag="meta",
            )
        },
    }


def _common_responses(paths: dict) -> dict:
    """Statuses every operation shares: bad or too large bodies where a body is read, the
    optional guard (all but /healthz), and Redis away (all that read state)."""
    for path, ops in paths.items():
        for op in ops.values():
            responses = op["responses"]
            if "requestBody" in op:
                responses.setdefault("400", BAD_INPUT)
                responses.setdefault("413", TOO_LARGE)
                op["requestBody"]["description"] = BODY_NOTE
            if path != "/healthz":
                for status, reply in GUARD.items():
                    responses.setdefault(status, reply)
            if path not in ("/healthz", "/openapi.json"):
                responses.setdefault("503", BACKEND_DOWN)
    return paths


@functools.lru_cache(maxsize=1)
def _document() -> dict:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "termpool",
            "version": "1",
            "description": "A pool of terminal-bench environments. The pool API is byte-compatible with the "
            "reference pool server and blocks until each operation ends; the runs API (/v1) "
            "answers at once with ids to poll. Every reply is JSON with `ok`.",
        },
        "tags": [
            {"name": "pool", "description": "The pool API (blocking)"},
            {"name": "runs", "description": "The runs API (submit and poll)"},
            {"name": "meta"},
        ],
        "paths": _common_responses({**_pool_paths(), **_runs_paths()}),
        "x-error-codes": error_codes.rows(),
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer", "description": "Only when POOL_API_TOKEN is set."}
            },
        },
    }


def document() -> dict:
    """A copy, so a caller (or a test) cannot change what later requests are served."""
    return copy.deepcopy(_document())
