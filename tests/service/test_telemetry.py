"""Telemetry on real Postgres, Redis, API and worker processes: idempotent ingest, downsampled
history, the events stream (live, dropped and resumed), checkpoints with their metrics, tenants."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import httpx
import numpy as np
import pytest
import redis
from sqlalchemy import select

from app.db.models import Job, MetricChunk, MetricSeries
from app.db.session import transaction
from app.messaging.live_bus import NoBus, live_bus, stream_key
from app.repositories.job_events import JobEventRepository
from app.services import lifecycle
from app.services.job_journal import record_sample
from app.services.metric_history import history, store_metrics, unpack
from muonforge.api import SseParser
from muonforge.client import ApiError, Client
from tests.support.api import bearer, new_key
from tests.support.net import wait_for
from tests.support.services import running_api
from tests.support.specs import tiny_spec
from tests.support.telemetry import report, stored_job, synthetic_run
from worker.sink import JobSink


def new_job(settings) -> str:
    """A stored job of a fresh tenant (no task sent) to ingest telemetry into."""
    return stored_job(settings, new_key(settings), tiny_spec())


def stored(settings, job_id: str) -> dict[str, dict[int, float]]:
    """Every stored point, {name: {step: value}}, read back from the chunks."""
    out: dict[str, dict[int, float]] = {}
    with transaction(settings) as session:
        for chunk in session.scalars(select(MetricChunk).where(MetricChunk.job_id == job_id)):
            steps, values = unpack(chunk.steps, chunk.values)
            series = out.setdefault(chunk.name, {})
            for s, v in zip(steps.tolist(), values.tolist()):
                assert s not in series, f"{chunk.name} step {s} stored twice"
                series[s] = v
    return out


def ingest(settings, job_id: str, steps, mark=None) -> int:
    with transaction(settings) as session:
        return store_metrics(session, job_id, steps, mark)


def test_ingesting_the_same_batch_twice_stores_each_point_once(settings):
    job_id = new_job(settings)
    batch = [(s, {"loss": 5.0 - s / 100, "lr": 0.02}) for s in range(50)]
    assert ingest(settings, job_id, batch) == 100
    assert ingest(settings, job_id, batch) == 0
    assert stored(settings, job_id) == {
        "loss": dict((s, 5.0 - s / 100) for s in range(50)),
        "lr": dict.fromkeys(range(50), 0.02),
    }
    # A resumed attempt sends steps 40-59 again with other values, and a new name for a stored step.
    resumed = [(s, {"loss": -1.0, "val_loss": 4.0}) for s in range(40, 60)]
    assert ingest(settings, job_id, resumed) == 10 + 20
    points = stored(settings, job_id)
    assert points["loss"][45] == 5.0 - 45 / 100 and points["loss"][55] == -1.0  # the first value stays
    assert sorted(points["val_loss"]) == list(range(40, 60))  # a new name at stored steps is kept
    with transaction(settings) as session:
        rows = session.scalars(select(MetricSeries).where(MetricSeries.job_id == job_id))
        series = {s.name: (s.points, s.first_step, s.last_step) for s in rows}
    assert series == {"loss": (60, 0, 59), "lr": (50, 0, 49), "val_loss": (20, 40, 59)}


def test_non_finite_values_are_not_stored_and_the_mark_is_kept(settings):
    job_id = new_job(settings)
    ingest(settings, job_id, [(0, {"a": float("nan"), "b": 1.0}), (1, {"a": float("inf"), "b": 2.0})], mark="17-0")
    assert stored(settings, job_id) == {"b": {0: 1.0, 1: 2.0}}
    with transaction(settings) as session:
        assert session.get(Job, job_id).telemetry_mark == "17-0"


@pytest.fixture(scope="module")
def spiky_series(settings):
    """A 100,000-step series stored in chunks of 1 to 700 points, with spikes up and down."""
    rng = np.random.default_rng(0)
    values = np.sin(np.arange(100_000) / 500) + rng.normal(0, 0.05, 100_000)
    spikes = {12_345: 40.0, 77_777: -35.0, 99_998: 25.0, 3: -20.0}
    for step, value in spikes.items():
        values[step] = value
    job_id = new_job(settings)
    step = 0
    random.seed(0)
    while step < len(values):
        n = random.choice([1, 7, 50, 333, 700])
        ingest(settings, job_id, [(s, {"x": float(values[s])}) for s in range(step, min(step + n, len(values)))])
        step += n
    return job_id, values, spikes


def series_points(settings, job_id, **query) -> list[list[float]]:
    with transaction(settings) as session:
        (series,) = history(session, job_id, ["x"], query.pop("max_points", 1000), query.get("lo"), query.get("hi"))
    return series["points"]


@pytest.mark.parametrize("max_points", [3, 100, 1000, 5000])
def test_downsampling_keeps_the_global_min_and_max_with_real_points(settings, spiky_series, max_points):
    job_id, values, spikes = spiky_series
    points = series_points(settings, job_id, max_points=max_points)
    assert 0 < len(points) <= max_points
    steps = [p[0] for p in points]
    assert steps == sorted(set(steps))  # ascending, no point twice
    assert all(values[s] == v for s, v in points)  # real points, not averages
    assert [int(values.argmin()), values.min()] in points and [int(values.argmax()), values.max()] in points
    if max_points >= 1000:
        assert {s for s in spikes} <= set(steps)  # every spike survives at a useful resolution
    assert points[-1][0] == len(values) - 1  # the last point of the last bucket


def test_a_small_range_returns_every_point_and_edges_are_cut_exactly(settings, spiky_series):
    job_id, values, _ = spiky_series
    points = series_points(settings, job_id, lo=12_000, hi=12_600, max_points=1000)
    assert points == [[s, float(values[s])] for s in range(12_000, 12_601)]
    coarse = series_points(settings, job_id, lo=12_000, hi=40_000, max_points=60)
    assert all(12_000 <= p[0] <= 40_000 for p in coarse) and len(coarse) <= 60
    assert [12_345, 40.0] in coarse


def test_follow_a_running_job_drop_the_connection_and_resume_exactly(api_url, settings, auth, worker):
    key = auth["Authorization"].split()[1]
    spec = tiny_spec(steps=1500, eval_every=100, checkpoint_every=500)
    spec["model"] = {"arch": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 32}
    with Client(api_url, key) as client:
        job = client.create_job(spec)
        received, last_id = [], None
        for cut in (60, 150):  # drop the connection twice, mid-run
            for event in client.events(job["id"], last_event_id=last_id, reconnect=False):
                received.append(event)
                last_id = event.id
                if len(received) == cut:
                    break
        assert client.get_job(job["id"])["status"] in ("queued", "running"), "the drops should happen mid-run"
        received += list(client.events(job["id"], last_event_id=last_id))
        replay = list(client.events(job["id"]))  # the finished job's whole history
    assert received[-1].event == replay[-1].event == "done"
    ids = [int(e.id) for e in received[:-1]]
    assert ids == sorted(set(ids)), "ids increase: nothing repeated"
    key_of = lambda e: (e.event, e.data["step"] if e.event == "metrics" else int(e.id or 0) >> 32)  # noqa: E731
    assert sorted(map(key_of, received)) == sorted(map(key_of, replay)), "nothing missing, nothing repeated"
    metrics = [e.data for e in received if e.event == "metrics"]
    assert [m["step"] for m in metrics] == list(range(1501))
    assert all(m == r.data for m, r in zip(metrics, (e for e in replay if e.event == "metrics")))
    statuses = [e.data["status"] for e in received if e.event == "status"]
    assert statuses == ["queued", "running", "succeeded"]
    assert [e.data["step"] for e in received if e.event == "checkpoint"] == [500, 1000, 1500]


def test_a_new_stream_resumes_after_an_id_given_as_a_query_parameter(api_url, settings, auth, worker):
    """What a browser does when it opens a new EventSource after a refused one: it cannot set
    Last-Event-ID, so it passes the id in the query; from_step may be ahead (it polled meanwhile)."""
    with Client(api_url, auth["Authorization"].split()[1]) as client:
        job = client.create_job(tiny_spec(steps=40))
        replay = list(client.events(job["id"]))  # the finished job's whole history
    cut = next(i for i, e in enumerate(replay) if e.event == "metrics" and e.data["step"] == 15)
    job_events_after = [(e.event, e.data) for e in replay[cut + 1 :] if e.event not in ("metrics", "done")]
    assert job_events_after, "a checkpoint, samples and the last status come after step 15"

    def read(**params) -> list[tuple[str, dict]]:
        parser = SseParser()
        with httpx.stream("GET", f"{api_url}/v1/jobs/{job['id']}/events", params=params, headers=auth) as r:
            assert r.status_code == 200, r.read()
            events = [e for line in r.iter_lines() if (e := parser.feed(line)) is not None]
        return [(e.event, e.data) for e in events]

    resumed = read(last_event_id=replay[cut].id)
    assert resumed == [(e.event, e.data) for e in replay[cut + 1 :]], "exactly what follows the id"
    ahead = read(last_event_id=replay[cut].id, from_step=30)  # the steps up to 29 were polled
    assert [d["step"] for k, d in ahead if k == "metrics"] == list(range(30, 41))
    assert [(k, d) for k, d in ahead if k not in ("metrics", "done")] == job_events_after
    header_wins = {**auth, "Last-Event-ID": replay[-2].id}
    with httpx.stream(
        "GET", f"{api_url}/v1/jobs/{job['id']}/events", params={"last_event_id": "0"}, headers=header_wins
    ) as r:
        assert [line for line in r.iter_lines() if line.startswith("event:")] == ["event: done"]
    refused = httpx.get(f"{api_url}/v1/jobs/{job['id']}/events", params={"last_event_id": "033080603315"}, headers=auth)
    assert refused.status_code == 422 and refused.json()["error"]["param"] == "last_event_id"


def test_checkpoints_carry_their_metrics_and_history_matches_the_stream(api_url, settings, auth, worker):
    key = auth["Authorization"].split()[1]
    with Client(api_url, key) as client:
        job = client.create_job(tiny_spec(steps=40, keep_checkpoints=4))  # eval, checkpoint every 10
        events = list(client.events(job["id"]))
        streamed = {e.data["step"]: e.data["metrics"] for e in events if e.event == "metrics"}
        history = client.metrics(job["id"], names=["loss", "val_loss"])
        checkpoints = client.checkpoints(job["id"])
    assert history["loss"] == [[s, streamed[s]["loss"]] for s in range(40)]
    assert history["val_loss"] == [[s, streamed[s]["val_loss"]] for s in (0, 10, 20, 30, 40)]
    assert [c["step"] for c in checkpoints] == [40, 30, 20, 10]
    for c in checkpoints:  # the val_loss of its own step, the loss of the step before
        assert c["metrics"]["val_loss"] == streamed[c["step"]]["val_loss"]
        assert c["metrics"]["loss"] == streamed[c["step"] - 1]["loss"]
    samples = [e.data for e in events if e.event == "sample"]  # what the model wrote at each evaluation
    assert [s["step"] for s in samples] == [0, 10, 20, 30, 40]
    assert all(len(s["prompt"]) == 32 and len(s["text"]) == 120 for s in samples)


def test_a_sample_holding_a_nul_character_is_stored(settings):
    """An untrained byte- or char-level model can write NUL, which Postgres's JSON cannot hold."""
    job_id = new_job(settings)
    with transaction(settings) as session:
        record_sample(session, live_bus(settings), job_id, 0, "def f(\x00", "\x00x = 1\x00")
    with transaction(settings) as session:
        (event,) = [e for e in JobEventRepository(session).events(job_id) if e.kind == "sample"]
        assert event.payload == {"step": 0, "prompt": "def f(\ufffd", "text": "\ufffdx = 1\ufffd"}


def test_another_tenant_cannot_stream_read_history_or_download(api_url, settings, auth, worker):
    owner = Client(api_url, auth["Authorization"].split()[1])
    job = owner.create_job(tiny_spec(steps=20))
    list(owner.events(job["id"]))
    assert owner.checkpoints(job["id"])
    other = Client(api_url, new_key(settings))
    for call in (
        lambda: next(other.events(job["id"], reconnect=False)),
        lambda: other.metrics(job["id"]),
        lambda: other.checkpoints(job["id"]),
        lambda: other.download_checkpoint(job["id"], 20, "/dev/null"),
    ):
        with pytest.raises(ApiError) as err:
            call()
        assert err.value.status == 404 and err.value.code == "not_found"
    # Not an id, and ids no stream sends: a step (low 32 bits) or a seq past the int32 columns.
    for bad in ("not-an-id", "033080603315", str((2**31) << 32)):
        with pytest.raises(ApiError) as err:
            next(owner.events(job["id"], last_event_id=bad, reconnect=False))
        assert err.value.status == 422 and err.value.param == "Last-Event-ID", bad
    owner.close()
    other.close()


def test_history_query_validation(client, auth, settings):
    job = client.post("/v1/jobs", json=tiny_spec(), headers=auth).json()
    r = client.get(f"/v1/jobs/{job['id']}/metrics", params={"from_step": 10, "to_step": 5}, headers=auth)
    assert r.status_code == 200 and r.json()["series"] == []  # an empty range: no points
    r = client.get(f"/v1/jobs/{job['id']}/metrics", params={"from_step": -1}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["param"] == "from_step"
    r = client.get(f"/v1/jobs/{job['id']}/metrics", params={"max_points": 2}, headers=auth)
    assert r.status_code == 422 and r.json()["error"]["param"] == "max_points"
    assert client.get(f"/v1/jobs/{job['id']}/metrics", headers=auth).json() == {"job_id": job["id"], "series": []}
    client.post(f"/v1/jobs/{job['id']}/cancel", headers=auth)
    # The stream from the last steps an int32 step can take: its page's end is not past the columns.
    r = client.get(f"/v1/jobs/{job['id']}/events", params={"from_step": 2**31 - 2}, headers=auth)
    assert r.status_code == 200 and "event: done" in r.text


def scrape(api_url: str, name: str) -> float:
    for line in httpx.get(f"{api_url}/metrics").text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def test_a_client_that_goes_away_releases_its_stream_and_the_feed(api_url, settings, auth, no_worker):
    """A queued job (no worker here) streams nothing but its status: the stream stays open on the
    live feed until the client disconnects; then the server lets go of both."""
    key = auth["Authorization"].split()[1]
    with Client(api_url, key) as client:
        job = client.create_job(tiny_spec())
        stream = client.events(job["id"], reconnect=False)
        assert next(stream).event == "status"
        wait_for(
            lambda: scrape(api_url, "muonforge_event_streams") == 1 and scrape(api_url, "muonforge_live_feeds") == 1
        )
        stream.close()  # the connection is dropped
        wait_for(lambda: scrape(api_url, "muonforge_event_streams") == 0, timeout=20)
        wait_for(lambda: scrape(api_url, "muonforge_live_feeds") == 0, timeout=20)  # within a feed's block time
        client.cancel_job(job["id"])


def test_a_client_that_closes_its_stream_mid_way_leaves_no_traceback(settings, tmp_path):
    """A client that goes away while its stream replays a long history (as `muonforge logs
    --follow | head -2` does) is an ordinary disconnect: the API logs no error for it. Each close
    races the server's hand-over of its next event; one close in two used to leave "Exception in
    ASGI application" and an anyio.BrokenResourceError's traceback."""
    key = new_key(settings)
    job_id = synthetic_run(settings, key, tiny_spec(steps=3000))
    with running_api(settings, tmp_path) as url:
        for _ in range(10):
            with httpx.stream("GET", f"{url}/v1/jobs/{job_id}/events", headers=bearer(key)) as answer:
                assert answer.status_code == 200
                assert len([line for line, _ in zip(answer.iter_lines(), range(5))]) == 5
            wait_for(lambda: scrape(url, "muonforge_event_streams") == 0, timeout=20)
    log = (tmp_path / "api.log").read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log


def test_the_sink_stores_everything_when_the_live_bus_is_down(settings):
    """Redis unreachable: every step still reaches the database (the events stream then reads it
    from there), and the job's progress and summary stay current."""
    job_id = new_job(settings)
    down = settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/0"})
    with transaction(settings) as session:
        attempt = lifecycle.claim(session, NoBus(), job_id, "test", timedelta(minutes=1)).attempt
    sink = JobSink(down, job_id, attempt, 0, {})
    for step in range(30):
        sink.metrics(report(step, {"loss": 3.0 - step / 10}))
    sink.close()
    assert stored(settings, job_id) == {"loss": {s: 3.0 - s / 10 for s in range(30)}}
    with transaction(settings) as session:
        job = session.get(Job, job_id)
        assert job.progress_step == 30 and job.summary == {"loss": 3.0 - 29 / 10} and job.telemetry_mark is None


def test_steps_the_bus_did_not_take_go_out_before_the_later_ones(settings, monkeypatch):
    """Publishes that fail (Redis paused or restarting) leave no hole on the bus: their steps are
    published first once it answers, so a reader tailing from the stored mark misses none. Before
    this, the bus held steps 0-9 then 20-29 and a stream that had read 0-9 from the database
    skipped 10-19."""
    job_id = new_job(settings)
    with transaction(settings) as session:
        attempt = lifecycle.claim(session, NoBus(), job_id, "test", timedelta(minutes=1)).attempt
    sink = JobSink(settings, job_id, attempt, 0, {})
    publish, down = sink.bus.publish_metrics, [False]

    def flaky(job: str, steps):
        if down[0]:
            raise redis.TimeoutError("Timeout reading from socket")
        return publish(job, steps)

    monkeypatch.setattr(sink.bus, "publish_metrics", flaky)
    for first, failing in ((0, False), (10, True), (20, False)):
        down[0] = failing
        for step in range(first, first + 10):
            sink.metrics(report(step, {"loss": float(step)}))
        sink.flush()
    sink.close()
    entries = redis.Redis.from_url(settings.redis_url).xrange(stream_key(job_id))
    assert [int(fields[b"step"]) for _, fields in entries] == list(range(30))
    assert stored(settings, job_id) == {"loss": {s: float(s) for s in range(30)}}


def test_a_stream_trimmed_past_the_stored_mark_falls_back_to_the_database(api_url, settings, auth):
    """Redis trimmed the job's stream beyond what the database holds: a client that connects then
    reads the database until it has caught up, then the stream again; it misses nothing."""
    key = auth["Authorization"].split()[1]
    slow = settings.model_copy(update={"telemetry_flush_seconds": 3600.0})  # stores only when told
    with Client(api_url, key) as client:
        job = client.create_job(tiny_spec(steps=100))
        with transaction(settings) as session:
            attempt = lifecycle.claim(session, live_bus(settings), job["id"], "test", timedelta(minutes=5)).attempt
        sink = JobSink(slow, job["id"], attempt, 0, {})
        for step in range(50):
            sink.metrics(report(step, {"loss": float(step)}))
        sink.flush()  # stored, mark at step 49
        for step in range(50, 80):
            sink.metrics(report(step, {"loss": float(step)}))  # published, not stored
        wait_for(
            lambda: redis.Redis.from_url(settings.redis_url).xlen(stream_key(job["id"])) == 81
        )  # running + 80 steps
        redis.Redis.from_url(settings.redis_url).xtrim(stream_key(job["id"]), maxlen=5, approximate=False)
        with ThreadPoolExecutor(1) as pool:
            received = pool.submit(lambda: list(client.events(job["id"])))
            time.sleep(2.0)  # the client reads steps 0-49 and waits on the database
            sink.flush()  # 50-79 stored; the stream holds the new mark again
            for step in range(80, 100):
                sink.metrics(report(step, {"loss": float(step)}))
            sink.close()
            with transaction(settings) as session:
                lifecycle.finish(session, live_bus(settings), job["id"], attempt, "succeeded", 100, {})
            events = received.result(timeout=60)
    assert [e.data["step"] for e in events if e.event == "metrics"] == list(range(100))
    assert events[-1].event == "done"


def test_the_backfill_reads_bounded_pages_in_the_same_order(client, settings, auth, monkeypatch):
    """A long job's history read in pages of 7 steps and 5 events gives exactly the events one
    page gives, in the same order: a page costs the same however long the job."""
    from app.db.session import transaction
    from app.messaging.live_bus import NoBus
    from app.services import event_stream as stream
    from app.services.job_journal import record_log
    from app.services.metric_history import store_metrics

    job_id = client.post("/v1/jobs", json=tiny_spec(), headers=auth).json()["id"]
    with transaction(settings) as session:
        store_metrics(session, job_id, [(s, {"loss": 1.0 / (s + 1)}) for s in range(60)], None)
        for s in (0, 0, 3, 9, 9, 9, 10, 11, 30, 31, 32, 33, 34, 35, 59):
            record_log(session, NoBus(), job_id, "info", f"at {s}", step=s)
        record_log(session, NoBus(), job_id, "info", "no step", step=None)

    def read_all() -> list[tuple[str, str]]:
        cursor, seen = stream.Cursor(), []
        for _ in range(1000):
            page = stream.read_page(settings, job_id, cursor)
            seen += [(e.event, e.id) for e in page.events]
            if not page.more:
                return seen
        raise AssertionError("the pages never ended")

    whole = read_all()
    monkeypatch.setattr(stream, "PAGE_STEPS", 7)
    monkeypatch.setattr(stream, "PAGE_EVENTS", 5)
    assert read_all() == whole
    assert sum(kind == "metrics" for kind, _ in whole) == 60 and sum(kind == "log" for kind, _ in whole) == 16
    client.post(f"/v1/jobs/{job_id}/cancel", headers=auth)
