"""The request and reply models (app/models.py, app/replies.py, app/fields.py) and the document made from them (app/apidoc.py),
validated directly: no Docker, no Redis, no HTTP.

The texts checked here are the ones both faces answer with a 400 (app/http.py `parse`).
"""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from app import create_app, error_codes, fields, models, replies, stop_app
from app.apidoc import document
from devstack import FIXTURES
from poolcore import failures
from poolcore.config import load_settings

pytestmark = pytest.mark.unit

RUN = "run-0123456789abcdef"


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return load_settings({"DATASET_DIR": str(FIXTURES), "TBENCH_OUTPUT_ROOT": str(tmp_path_factory.mktemp("outputs"))})


def valid(model: type[BaseModel], body: dict, cfg=None):
    return model.model_validate(body, context={"cfg": cfg})


def refused(model: type[BaseModel], body: dict, cfg=None, root: str = "") -> str:
    with pytest.raises(ValidationError) as caught:
        model.model_validate(body, context={"cfg": cfg})
    return fields.explain(caught.value, root)


def meta(**fields) -> dict:
    return {"task_name": "hello-file", **fields}


# ---- ids ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "body, text",
    [
        ({}, "task_key is required"),
        ({"task_key": ""}, "task_key is required"),
        ({"task_key": None}, "task_key is required"),
        ({"task_key": ["x"]}, "task_key must be a string"),
        ({"task_key": "x" * 1000}, "task_key is longer than 256 characters"),
        ({"task_key": "a\x1b[31m"}, "task_key must not contain control characters"),
        ({"task_key": "x", "request_id": {"a": 1}}, "request_id must be a string or an integer"),
        ({"task_key": "x", "request_id": True}, "request_id must be a string or an integer"),
        ({"task_key": "x", "request_id": 1.5}, "request_id must be a string or an integer"),
        ({"task_key": "x", "request_id": 2**64}, "request_id must be an integer of at most 64 bits"),
        ({"task_key": "x", "request_id": "r" * 300}, "request_id is longer than 256 characters"),
        ({"task_key": "x", "request_id": "a\x1fb"}, "request_id must not contain control characters"),
    ],
)
def test_allocate_texts(body, text):
    assert refused(models.AllocateRequest, body) == text


def test_scalar_ids_accept_strings_integers_and_null():
    def request_id(value):
        return fields.text_id(valid(models.AllocateRequest, {"task_key": "k", "request_id": value}).request_id)

    assert request_id("ep-1") == "ep-1"
    assert request_id(7) == "7"
    assert request_id(-7.0) == "-7"  # JSON Schema counts 7.0 as an integer
    assert request_id(None) == fields.text_id(valid(models.AllocateRequest, {"task_key": "k"}).request_id) == ""
    assert request_id("../../etc/passwd ü") == "../../etc/passwd ü"  # a key, never a path


@pytest.mark.parametrize("model", [models.LeaseRequest, models.ExecToolRequest, models.ResetRequest])
def test_lease_id_comes_first(cfg, model):
    assert refused(model, {}, cfg) == "lease_id is required"
    assert refused(model, {"lease_id": 7}, cfg) == "lease_id must be a string"
    assert refused(model, {"lease_id": "run-\x00"}, cfg) == "lease_id must not contain control characters"


# ---- task_meta, run_ctx, task_timeouts ----------------------------------------------------------
@pytest.mark.parametrize(
    "task_meta, text",
    [
        ("hello-file", "task_meta must be a dict"),
        (None, "task_meta must be a dict"),
        ({"task_path": "hello-file"}, "task_meta.task_name is required"),
        ({"task_name": "hello-file/", "task_path": "hello-file"}, "task_meta.task_name must be letters and digits"),
        ({"task_name": "x" * 101, "task_path": "hello-file"}, "task_meta.task_name must be letters and digits"),
        (meta(task_path="../../../etc"), "task_meta.task_path: task_path '../../../etc' resolves to"),
        (meta(task_path="/etc"), "task_meta.task_path: "),
        (meta(task_path="hello-file/../../.."), "task_meta.task_path: "),
        (meta(task_path="no-such-task"), "task_meta.task_path: no task.yaml in 'no-such-task' under DATASET_DIR"),
        (meta(task_name="other", task_path=None), "task_meta.task_path: no task.yaml in 'other'"),
        (meta(task_path=""), "task_meta.task_path must not be empty"),
        (meta(task_path="hello-file\x00"), "task_meta.task_path must not contain control characters"),
        (meta(task_path="t" * 2000), "task_meta.task_path is longer than 1024 characters"),
        (meta(task_path="hello-file/" + "ü" * 200), "task_meta.task_path has a component longer than 255 bytes"),
        (meta(instruction=5), "task_meta.instruction must be a string"),
        (meta(instruction="a\x00b"), "task_meta.instruction must not contain a NUL character"),
        (meta(instruction="x" * (fields.MAX_TEXT_LENGTH + 1)), "task_meta.instruction is longer than"),
    ],
)
def test_task_meta_texts(cfg, task_meta, text):
    body = {"lease_id": RUN} if task_meta is None else {"lease_id": RUN, "task_meta": task_meta}
    assert refused(models.ResetRequest, body, cfg).startswith(text)


def test_task_meta_keeps_extra_fields_and_resolves_the_path(cfg):
    body = valid(models.ResetRequest, {"lease_id": RUN, "task_meta": meta(instruction="go", source="x")}, cfg)
    assert body.task_meta.model_dump() == {
        "task_name": "hello-file",
        "task_path": "hello-file",
        "instruction": "go",
        "source": "x",
    }
    absolute = valid(models.TaskMeta, meta(task_path=str(FIXTURES / "hello-file")), cfg)
    assert absolute.task_path == "hello-file"


@pytest.mark.parametrize(
    "run_ctx, text",
    [
        ([], "run_ctx must be a dict"),
        ({"log_dir": "/tmp"}, "run_ctx.log_dir: "),
        ({"log_dir": "../outside"}, "run_ctx.log_dir: "),
        ({"log_dir": 5}, "run_ctx.log_dir must be a string"),
        ({"log_dir": "l" * 2000}, "run_ctx.log_dir is longer than 1024 characters"),
        ({"log_dir": "a/" + "l" * 300}, "run_ctx.log_dir has a component longer than 255 bytes"),
        ({"log_dir": "a\nb"}, "run_ctx.log_dir must not contain control characters"),
        ({"uid": "u" * 129}, "run_ctx.uid is longer than 128 characters"),
        ({"uid": {"a": 1}}, "run_ctx.uid must be a string or an integer"),
        ({"group_index": [1]}, "run_ctx.group_index must be a string or an integer"),
        ({"sample_index": "a\x00"}, "run_ctx.sample_index must not contain control characters"),
    ],
)
def test_run_ctx_texts(cfg, run_ctx, text):
    body = {"lease_id": RUN, "task_meta": meta(), "run_ctx": run_ctx}
    assert refused(models.ResetRequest, body, cfg).startswith(text)


def test_run_ctx_defaults_and_keeps_its_values(cfg):
    for absent in ({}, {"run_ctx": None}, {"run_ctx": {"log_dir": ""}}):
        body = valid(models.ResetRequest, {"lease_id": RUN, "task_meta": meta(), **absent}, cfg)
        assert body.run_ctx.model_dump() == {
            "uid": None,
            "group_index": None,
            "sample_index": None,
            "log_dir": str(cfg.default_log_dir),
        }
    ctx = {"uid": 7, "group_index": "g", "log_dir": "ep/1", "extra": [1]}
    body = valid(models.ResetRequest, {"lease_id": RUN, "task_meta": meta(), "run_ctx": ctx}, cfg)
    assert body.run_ctx.model_dump() == {**ctx, "sample_index": None, "log_dir": str(cfg.output_root / "ep/1")}


def test_task_timeouts_garbage_is_dropped_not_refused():
    garbage = {"eval": 10**400, "reset_session": float("inf"), "close_session": -1, "bogus": 5, "ensure_image": 30}
    assert models.TaskTimeouts.model_validate(garbage).given() == {"ensure_image": 30.0}
    for value in ([1, 2], "soon", None, {"eval": "soon", "reset_session": True}):
        assert models.TaskTimeouts.model_validate(value).given() == {}


# ---- tool calls and runs ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "tool_call, text",
    [
        ("shell_exec", "tool_call must be a dict"),
        (None, "tool_call must be a dict"),
        ({}, "tool_call.name is required"),
        ({"name": ""}, "tool_call.name must be a non-empty string"),
        ({"name": 5}, "tool_call.name must be a non-empty string"),
        ({"name": "n" * 257}, "tool_call.name is longer than 256 characters"),
        ({"name": "shell\x00exec"}, "tool_call.name must not contain control characters"),
        ({"name": "shell_exec", "arguments": []}, "tool_call.arguments must be a dict"),
    ],
)
def test_tool_call_texts_on_both_faces(tool_call, text):
    assert refused(models.ExecToolRequest, {"lease_id": RUN, "tool_call": tool_call}) == text
    if tool_call is None:
        assert refused(models.ExecToolRequest, {"lease_id": RUN}) == text
    if isinstance(tool_call, dict):  # the runs API's body is the tool call itself
        assert refused(models.ToolCall, tool_call, root="tool_call") == text


def test_tool_call_arguments_default_to_empty():
    assert valid(models.ToolCall, {"name": "x", "arguments": None, "more": 1}).model_dump() == {
        "name": "x",
        "arguments": {},
    }


@pytest.mark.parametrize(
    "extra, text",
    [
        ({"task_key": ["k"]}, "task_key must be a string or an integer"),
        ({"request_id": {"a": 1}}, "request_id must be a string or an integer"),
        ({"script": {"name": "shell_view"}}, "script must be a list"),
        ({"script": ["shell_view"]}, "script[0]: tool_call must be a dict"),
        ({"script": [{"name": "shell_view"}, {"arguments": {}}]}, "script[1]: tool_call.name is required"),
        ({"script": [{"name": "shell_view", "arguments": [1]}]}, "script[0]: tool_call.arguments must be a dict"),
        ({"script": [{"name": "shell_view"}] * 1001}, "script has 1001 items; at most 1000 are allowed"),
        ({"script": [{"name": "x", "arguments": {"c": "x" * (1 << 20)}}]}, "script is larger than 1048576 bytes"),
        ({"evaluate": "yes"}, "evaluate must be true or false"),
        ({"close": 1}, "close must be true or false"),
    ],
)
def test_run_request_texts(cfg, extra, text):
    assert refused(models.RunRequest, {"task_meta": meta(), **extra}, cfg).startswith(text)
    assert refused(models.RunRequest, {}, cfg) == "task_meta must be a dict"


def test_run_request_defaults(cfg):
    body = valid(models.RunRequest, {"task_meta": meta(), "evaluate": None, "task_key": 7}, cfg)
    assert (body.script, body.evaluate, body.close, body.capacity_key()) == (None, False, False, "7")
    assert valid(models.RunRequest, {"task_meta": meta()}, cfg).capacity_key() == "hello-file"


@pytest.mark.parametrize("value", ["abc", "-1", "61", "nan", "inf", "", "1e9"])
def test_wait_must_be_a_number_from_0_to_60(value):
    from app.runs_api import WAIT

    with pytest.raises(ValidationError):
        WAIT.validate_python(value)
    assert WAIT.validate_python("60") == 60.0 and WAIT.validate_python("0.5") == 0.5


# ---- replies and the document -------------------------------------------------------------------
def test_error_reply_has_every_code():
    error = replies.Error(error="x", **failures.fields("HOST_LOST"))
    assert error.model_dump() == {"ok": False, "error": "x", "code": "HOST_LOST", "retryable": True}
    with pytest.raises(ValidationError):
        replies.Error(error="x", code="NO_SUCH_CODE", retryable=False)


@pytest.fixture(scope="module")
def doc(cfg):
    app = create_app(cfg)
    yield document(app)  # no request reaches Redis
    stop_app(app)


def test_openapi_document_is_valid(doc):
    # Required, not skipped when absent: pinned in requirements-dev.txt.
    from openapi_spec_validator import validate

    validate(doc)


def test_openapi_document_carries_the_codes(doc):
    assert doc["x-error-codes"] == error_codes.rows()
    error = doc["components"]["schemas"]["Error"]["properties"]
    assert error["code"]["enum"] == list(failures.CODES) and error["retryable"]["type"] == "boolean"
    job = doc["components"]["schemas"]["Job"]["properties"]
    assert {"code", "retryable", "attempts"} <= set(job)


def test_openapi_document_states_the_limits(doc):
    schemas = doc["components"]["schemas"]
    lease_id = schemas["LeaseRequest"]["properties"]["lease_id"]
    assert (lease_id["maxLength"], lease_id["pattern"]) == (fields.MAX_ID_LENGTH, fields.PRINTABLE_PATTERN)
    assert schemas["RunRequest"]["properties"]["script"]["anyOf"][0]["maxItems"] == fields.MAX_SCRIPT_STEPS
    assert "type" not in schemas["TaskTimeouts"]  # anything is taken; what is not a timeout is ignored
    wait = doc["paths"]["/v1/jobs/{job_id}"]["get"]["parameters"][1]
    assert (wait["name"], wait["schema"]["maximum"]) == ("wait", fields.MAX_WAIT)
    assert "POOL_API_TOKEN" in doc["components"]["securitySchemes"]["bearer"]["description"]
    assert "API_TOKEN is set" not in doc["components"]["securitySchemes"]["bearer"]["description"].replace(
        "POOL_API_TOKEN", ""
    )
