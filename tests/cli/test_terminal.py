"""Every failure a person meets with the client commands, in a real pseudo-terminal: the exact
line shown, the exit status, no traceback (unless asked for); the progress bar of `submit
--follow` to each end of a job; Ctrl-C while following. The server is a local HTTP server that
answers as each test scripts it (tests/support/http_stub.py)."""

from __future__ import annotations

import json
import re
import threading
import time
from urllib.parse import parse_qs, urlsplit

import pytest

from contract.status import JobStatus, SweepStatus
from tests.support.http_stub import Reply, Request, StubServer, scripted
from tests.support.net import closed_port_url
from tests.support.terminal import assert_one_error, environment, finish, run, spawn

pytestmark = pytest.mark.system  # its tests start processes: the service's, torchrun's or a command's

KEY = "mf_test_key"


def error(code: str, message: str, param: str | None = None, **extra) -> dict:
    return {"error": {"code": code, "message": message, "param": param, **extra}}


def job(status: str = "queued", step: int = 0, error: dict | None = None, job_id: str = "job_1") -> dict:
    return {
        "id": job_id,
        "name": "tiny",
        "status": status,
        "spec": {"telemetry": {"every": 1}},
        "created_at": "2025-01-01T00:00:00Z",
        "started_at": None,
        "finished_at": None,
        "attempt": 1,
        "progress": {"step": step, "total_steps": 20},
        "summary": {"loss": 1.5} if step else {},
        "error": error,
    }


def sse(event_id: int | None, kind: str, data: dict) -> bytes:
    return (f"id: {event_id}\n" if event_id else "").encode() + f"event: {kind}\ndata: {json.dumps(data)}\n\n".encode()


@pytest.fixture
def spec(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"model": {"arch": "gpt"}, "data": {"builtin": "synthetic"}}))
    return path


# -- cannot reach or authenticate: 3 ---------------------------------------------------------------
def test_an_unreachable_server_names_the_url_and_how_to_start_one():
    url = closed_port_url()
    assert_one_error(
        run("jobs", env=environment(url, KEY)),
        3,
        f"error: cannot reach the server at {url}: connection refused; start one with 'muonforge up', or point"
        " MUONFORGE_API_URL (or --url) at it",
    )


def stalled_server(seconds: float) -> tuple[StubServer, threading.Event]:
    """A server that answers every request only once released (or after ``seconds``)."""
    release = threading.Event()

    def handle(request: Request) -> Reply:
        release.wait(seconds)
        return Reply(200, job())

    return StubServer(handle), release


def test_a_server_that_does_not_answer_in_time():
    stub, release = stalled_server(10)
    with stub as server:
        try:
            begun = time.monotonic()
            screen = run("show", "job_1", "--timeout", "0.5", env=environment(server.url, KEY))
            assert time.monotonic() - begun < 8
        finally:
            release.set()
    assert_one_error(
        screen,
        3,
        f"error: the server at {server.url} gave no answer within 0.5 s (3 attempts); try again later, or wait"
        " longer with --timeout SECONDS",
    )
    assert len(server.requests) == 3


def test_no_api_key():
    with StubServer(scripted(Reply(200, job()))) as server:
        screen = run("show", "job_1", env=environment(server.url))
    assert_one_error(screen, 3, "error: no API key: set MUONFORGE_API_KEY or pass --api-key")
    assert server.requests == []


def test_a_rejected_key_names_where_it_came_from():
    rejected = Reply(401, error("unauthorized", "unknown or revoked API key"))
    with StubServer(scripted(rejected)) as server:
        from_env = run("jobs", env=environment(server.url, KEY))
        from_flag = run("jobs", "--api-key", "mf_typed", env=environment(server.url, KEY))
    assert_one_error(
        from_env,
        3,
        "error: the server refused the API key from MUONFORGE_API_KEY: unknown or revoked API key (401 unauthorized)",
    )
    assert_one_error(
        from_flag,
        3,
        "error: the server refused the API key given with --api-key: unknown or revoked API key (401 unauthorized)",
    )
    assert [r.headers["authorization"] for r in server.requests] == [f"Bearer {KEY}", "Bearer mf_typed"]


def test_a_key_that_may_not_do_this():
    with StubServer(scripted(Reply(403, error("forbidden", "this key may only read jobs")))) as server:
        screen = run("cancel", "job_1", env=environment(server.url, KEY))
    assert_one_error(
        screen,
        3,
        "error: the API key from MUONFORGE_API_KEY is not allowed to do this: this key may only read jobs"
        " (403 forbidden)",
    )


def test_server_errors_are_retried_then_named_with_the_request_id():
    failing = Reply(503, error("internal", "overloaded"), {"X-Request-ID": "req_7f3a"})
    with StubServer(scripted(failing)) as server:
        shown = run("show", "job_1", env=environment(server.url, KEY))
        assert len(server.requests) == 3
        cancel = run("cancel", "job_1", env=environment(server.url, KEY))  # it may have been done: not repeated
        assert len(server.requests) == 4
    assert_one_error(
        shown, 3, "error: the server failed after 3 attempts: overloaded (503 internal, request id req_7f3a)"
    )
    assert_one_error(cancel, 3, "error: the server failed: overloaded (503 internal, request id req_7f3a)")


# -- bad input: 2 ----------------------------------------------------------------------------------
def test_an_unknown_id_is_named():
    with StubServer(scripted(Reply(404, error("not_found", "no job 'job_nope'", "job_id")))) as server:
        screen = run("show", "job_nope", env=environment(server.url, KEY))
    assert_one_error(screen, 2, "error: no job 'job_nope' (404 not_found)")


def test_a_404_from_another_server_names_the_request():
    page = b"<html><head><title>404 Not Found</title></head><body><h1>Not Found</h1></body></html>"
    with StubServer(scripted(Reply(404, page, {"Content-Type": "text/html"}))) as server:
        screen = run("logs", "job_nope", env=environment(server.url, KEY))
    assert_one_error(
        screen,
        2,
        f"error: GET {server.url}/v1/jobs/job_nope: 404 Not Found (404 http_error); is MUONFORGE_API_URL (or --url)"
        " a muonforge server?",
    )


def test_a_conflict():
    with StubServer(scripted(Reply(409, error("conflict", "job job_1 has already finished (succeeded)")))) as server:
        screen = run("cancel", "job_1", env=environment(server.url, KEY))
    assert_one_error(screen, 2, "error: job job_1 has already finished (succeeded) (409 conflict)")


def test_an_upload_over_the_limit_names_the_file(tmp_path):
    corpus = tmp_path / "big.txt"
    corpus.write_text("x" * 5000)
    too_large = Reply(413, error("payload_too_large", "the upload exceeds 1,000 bytes", "file"))
    with StubServer(scripted(too_large)) as server:
        screen = run("datasets", "upload", corpus, env=environment(server.url, KEY))
    assert_one_error(screen, 2, f"error: {corpus}: the upload exceeds 1,000 bytes (413 payload_too_large)")


def test_every_invalid_field_is_named_with_its_message(spec):
    fields = [
        {"param": "optimizer.lr", "message": "Input should be greater than 0"},
        {"param": "train.steps", "message": "Input should be greater than 0"},
    ]
    invalid = Reply(422, error("validation_error", fields[0]["message"], fields[0]["param"], errors=fields))
    with StubServer(scripted(invalid)) as server:
        screen = run("submit", spec, env=environment(server.url, KEY))
    assert_one_error(
        screen,
        2,
        "error: optimizer.lr: Input should be greater than 0; train.steps: Input should be greater than 0"
        " (422 validation_error)",
    )


@pytest.mark.parametrize("command", [["submit"], ["sweep"], ["train", "--out", "run"]])
def test_a_spec_that_is_not_yaml_is_one_line_naming_where(command, tmp_path):
    """PyYAML's message (several lines, with the file's text) is said on one line: file, line,
    column and the problem, as a compiler says it; nothing is sent (no server here)."""
    (tmp_path / "bad.yaml").write_text("name: tiny\nmodel:\n  arch: gpt\n  n_layer: 2: 3\n")
    (tmp_path / "bad.json").write_text('{"model": {"arch": "gpt"],\n "data": {}}\n')
    env = environment(closed_port_url(), KEY)
    screen = run(command[0], "bad.yaml", *command[1:], env=env, cwd=tmp_path)
    assert_one_error(screen, 2, "error: bad.yaml:4:13: mapping values are not allowed here")
    screen = run(command[0], "bad.json", *command[1:], env=env, cwd=tmp_path)
    assert_one_error(screen, 2, "error: bad.json:1:25: expected ',' or '}', but got ']'")


@pytest.mark.parametrize("command, statuses", [(["jobs"], JobStatus), (["sweeps", "list"], SweepStatus)])
def test_status_takes_every_status_of_the_contract(command, statuses):
    """``--status`` takes each status the API filters by (paused included: a sweep's trial that
    waits at a rung) and asks the server for it."""
    empty = Reply(200, {"data": [], "has_more": False, "next_after": None})
    with StubServer(scripted(empty)) as server:
        for status in statuses:
            screen = run(*command, "--status", status, env=environment(server.url, KEY))
            assert screen.status == 0, screen.lines
    assert [parse_qs(urlsplit(r.path).query)["status"] for r in server.requests] == [[s] for s in statuses]


CAP = "this tenant already has 2 queued or running jobs (the cap)"


def test_the_job_cap_is_waited_for_as_the_server_asks_then_reported(spec):
    with StubServer(scripted(Reply(429, error("rate_limited", CAP), {"Retry-After": "1"}))) as server:
        begun = time.monotonic()
        screen = run("submit", spec, env=environment(server.url, KEY))
        assert time.monotonic() - begun >= 2
    assert "Traceback" not in screen.raw and screen.status == 2
    assert screen.lines == [
        f"note: {CAP} (429 rate_limited); waiting 1 s as the server asks, then retry 1 of 2",
        f"note: {CAP} (429 rate_limited); waiting 1 s as the server asks, then retry 2 of 2",
        f"error: {CAP}; still refused after 3 attempts over 2 s; try again in 1 s (429 rate_limited)",
    ]
    keys = {r.headers["idempotency-key"] for r in server.requests}
    assert len(server.requests) == 3 and len(keys) == 1, "one submission, sent three times"


def test_the_job_cap_lifting_while_waiting(spec):
    replies = scripted(Reply(429, error("rate_limited", CAP), {"Retry-After": "1"}), Reply(201, job()))
    with StubServer(replies) as server:
        screen = run("submit", spec, env=environment(server.url, KEY))
    assert screen.status == 0 and "Traceback" not in screen.raw
    assert screen.lines == [
        f"note: {CAP} (429 rate_limited); waiting 1 s as the server asks, then retry 1 of 2",
        "job_1",
    ]


# -- --debug ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", [["--debug"], ["show", "job_nope", "--debug"], "MUONFORGE_DEBUG"])
def test_debug_adds_the_traceback_and_the_retries(how):
    url = closed_port_url()
    args = ["show", "job_nope"] if how == "MUONFORGE_DEBUG" else how
    args = args if args[0] == "show" else [*args, "show", "job_nope"]
    extra = {"MUONFORGE_DEBUG": "1"} if how == "MUONFORGE_DEBUG" else {}
    screen = run(*args, env=environment(url, KEY, **extra))
    assert screen.status == 3
    assert "Traceback (most recent call last):" in screen.raw
    assert "muonforge.client: GET /v1/jobs/job_nope: connection refused; retry 2 in" in screen.raw
    assert screen.lines[-1].startswith(f"error: cannot reach the server at {url}: connection refused")


# -- submit --follow: the progress bar to each end -------------------------------------------------
OUTCOMES = {
    "succeeded": (20, None, 0),
    "failed": (7, {"code": "training_error", "message": "the loss is not finite at step 8"}, 1),
    "cancelled": (12, None, 1),
}


def follow_server(outcome: str) -> StubServer:
    step, failure, _ = OUTCOMES[outcome]
    final = job(outcome, step, failure)

    def handle(request: Request):
        if request.method == "POST":
            return Reply(201, job())
        if request.path.endswith("/events"):
            events = [sse(1, "status", job()), sse(2, "status", job("running"))]
            events += [
                sse(2 + s, "metrics", {"step": s, "metrics": {"loss": 3 - s / 10, "tokens_per_s": 1234.0}})
                for s in range(1, step + 1)
            ]
            if outcome == "cancelled":
                events.append(sse(30, "status", job("cancelling", step)))
            return [*events, sse(31, "status", final), sse(None, "done", {})]
        return Reply(200, final)

    return StubServer(handle)


@pytest.mark.parametrize("outcome", list(OUTCOMES))
def test_the_progress_bar_ends_cleanly_with_the_job(outcome, spec):
    step, failure, status = OUTCOMES[outcome]
    with follow_server(outcome) as server:
        screen = run("submit", spec, "--follow", env=environment(server.url, KEY))
    assert screen.status == status and "Traceback" not in screen.raw
    lines = screen.lines
    assert lines[0] == "job_1"
    assert re.fullmatch(r"\[\d\d:\d\d:\d\d\] status      queued \(attempt 1\)", lines[1]), lines
    # The time is printed again only when the second has changed since the line before.
    stamp = r"(?:\[\d\d:\d\d:\d\d\]| {10})"
    assert re.fullmatch(rf"{stamp} status      running \(attempt 1\)", lines[2]), lines
    detail = f": {failure['code']}: {failure['message']}" if failure else " (attempt 1)"
    assert re.fullmatch(rf"{stamp} status      {outcome}{re.escape(detail)}", lines[-3]), lines
    loss = f"{3 - step / 10:.4f}"
    # The bar's last frame: named by the outcome, at the step the job reached, no ETA left.
    assert re.fullmatch(rf"{outcome} [━╸╺]+ +{step}/20 loss {loss}  val -  1,234 tok/s \d:\d\d:\d\d", lines[-2]), lines
    summary = {
        "id": "job_1",
        "status": outcome,
        "progress": {"step": step, "total_steps": 20},
        "summary": {"loss": 1.5},
        "error": failure,
    }
    assert json.loads(lines[-1]) == summary
    bar_ends = screen.raw.rindex(outcome + "\x1b")
    assert "\x1b[?25l" in screen.raw and "\x1b[?25h" in screen.raw[bar_ends:], "the cursor is shown again"


# -- Ctrl-C while following: detached, the job goes on ---------------------------------------------
def live_server(first_events: list[bytes]) -> tuple[StubServer, threading.Event]:
    """A server whose events stream sends ``first_events`` then stays open until released."""
    release = threading.Event()

    def stream():
        yield from first_events
        release.wait(30)

    def handle(request: Request):
        if request.method == "POST" and request.path == "/v1/jobs":
            return Reply(201, job())
        if request.path.endswith("/events"):
            return stream()
        return Reply(200, job("running", 3))

    return StubServer(handle), release


def test_ctrl_c_detaches_submit_follow(spec):
    events = [sse(1, "status", job()), sse(2, "status", job("running"))]
    events += [sse(2 + s, "metrics", {"step": s, "metrics": {"loss": 2.0}}) for s in range(1, 4)]
    server, release = live_server(events)
    with server:
        child = spawn("submit", spec, "--follow", env=environment(server.url, KEY))
        try:
            child.expect(r"3/20")
            child.sendintr()
            screen = finish(child)
        finally:
            release.set()
    assert screen.status == 130 and "Traceback" not in screen.raw
    assert re.fullmatch(r"train [━╸╺]+ +3/20 loss 2\.0000  val -  - tok/s \d:\d\d:\d\d ETA [-:\d]+", screen.lines[-2])
    assert screen.lines[-1] == "detached; job_1 goes on. Re-attach: muonforge logs job_1 --follow"
    assert "\x1b[?25h" in screen.raw[screen.raw.rindex("3/20") :], "the cursor is shown again"
    assert not [r for r in server.requests if r.path.endswith("/cancel")], "the job is left running"


def test_ctrl_c_detaches_logs_follow():
    events = [
        sse(1, "status", job()),
        sse(2, "status", job("running")),
        sse(3, "log", {"level": "info", "message": "step 1"}),
    ]
    server, release = live_server(events)
    with server:
        child = spawn("logs", "job_1", "--follow", env=environment(server.url, KEY))
        try:
            child.expect("step 1")
            child.sendintr()
            screen = finish(child)
        finally:
            release.set()
    assert screen.status == 130 and "Traceback" not in screen.raw
    assert screen.lines == [
        "status      queued (attempt 1)",
        "status      running (attempt 1)",
        "info        step 1",
        "^C",
        "detached; job_1 goes on. Re-attach: muonforge logs job_1 --follow",
    ]
    assert not [r for r in server.requests if r.path.endswith("/cancel")], "the job is left running"


def test_ctrl_c_elsewhere_is_interrupted():
    stub, release = stalled_server(30)
    with stub as server:
        child = spawn("show", "job_1", env=environment(server.url, KEY))
        try:
            while not server.requests:
                time.sleep(0.05)
            child.sendintr()
            screen = finish(child)
        finally:
            release.set()
    assert screen.status == 130 and "Traceback" not in screen.raw
    assert screen.lines == ["^C", "interrupted"]


def test_help_lists_the_exit_statuses():
    shown = run("--help", env=environment())
    assert shown.status == 0
    for status in (
        "0    ok",
        "1    the job ended failed or cancelled",
        "2    bad input",
        "3    cannot reach",
        "130  interrupted",
        "141  the reader of the output went away",
    ):
        assert status in shown.text, shown.text
