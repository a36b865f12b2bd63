"""The web app's server side: pages, the session cookie, the files it serves, the events stream
from a step. What the pages do in a browser is tested in tests/browser."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import yaml

from app.api.deps import SESSION_COOKIE
from app.web.pages import EXAMPLES, NODE_MODULES
from muonforge.api import SseParser
from muonforge.client import Client
from tests.support.api import new_key
from tests.support.services import ROOT
from tests.support.specs import tiny_spec

PAGES = ["/", "/jobs/job_nothing", "/compare?jobs=a,b", "/new"]


@pytest.fixture
def browser(client):
    """The shared test client as a browser: cookies kept, forgotten afterwards."""
    client.cookies.clear()
    yield client
    client.cookies.clear()


@pytest.mark.parametrize("path", PAGES)
def test_every_page_is_the_sign_in_form_without_a_session(browser, path):
    page = browser.get(path)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<label for="api-key">API key</label>' in page.text and 'id="signin-form"' in page.text


def test_sign_in_keeps_the_key_in_an_httponly_strict_session_cookie(browser, settings):
    key = new_key(settings, "web-tenant")
    answer = browser.post("/v1/session", json={"api_key": key})
    assert answer.status_code == 200 and answer.json() == {"tenant": "web-tenant"}
    cookie = answer.headers["set-cookie"]
    attributes = {part.strip().split("=")[0].lower() for part in cookie.split(";")}
    assert cookie.startswith(f"{SESSION_COOKIE}={key};")
    assert {"httponly", "samesite", "path"} <= attributes and "samesite=strict" in cookie.lower()
    assert not attributes & {"max-age", "expires"}  # the browser session only
    # The cookie authenticates the API and the pages; the key is never written into a page.
    assert browser.get("/v1/jobs").status_code == 200
    assert browser.get("/v1/session").json() == {"tenant": "web-tenant"}
    for path in PAGES:
        page = browser.get(path)
        assert 'id="signin-form"' not in page.text and "web-tenant" in page.text and key not in page.text
    # Sign out: the cookie is gone, and so is access.
    assert browser.delete("/v1/session").status_code == 204
    assert SESSION_COOKIE not in browser.cookies
    assert browser.get("/v1/jobs").status_code == 401
    assert 'id="signin-form"' in browser.get("/").text


def test_a_wrong_key_signs_nobody_in(browser):
    answer = browser.post("/v1/session", json={"api_key": "mf_not_a_key"})
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "unauthorized"
    assert "set-cookie" not in answer.headers
    assert browser.post("/v1/session", json={"api_key": ""}).json()["error"]["param"] == "api_key"


def test_the_bearer_header_wins_over_the_cookie(browser, settings):
    browser.post("/v1/session", json={"api_key": new_key(settings, "cookie-tenant")})
    other = new_key(settings, "header-tenant")
    assert browser.get("/v1/session", headers={"Authorization": f"Bearer {other}"}).json() == {
        "tenant": "header-tenant"
    }


def test_user_text_in_a_page_is_escaped(browser, settings):
    """Pages render no user data server-side but the tenant's name, and that is escaped."""
    browser.post("/v1/session", json={"api_key": new_key(settings, "<b>x</b>")})
    page = browser.get("/").text
    assert "<b>x</b>" not in page and "&lt;b&gt;x&lt;/b&gt;" in page


@pytest.mark.skipif(not (NODE_MODULES / "uplot").is_dir(), reason="needs the web packages (make web)")
def test_every_script_and_stylesheet_a_page_names_is_served(browser, settings):
    browser.post("/v1/session", json={"api_key": new_key(settings)})
    for path in PAGES:
        for url in re.findall(r'(?:src|href)="(/(?:static|vendor)/[^"]+)"', browser.get(path).text):
            answer = browser.get(url)
            assert answer.status_code == 200, url
            assert re.match(r"(text/css|text/javascript|application/javascript)", answer.headers["content-type"]), url
            assert "?v=" in url and "missing" not in url  # versioned by content


def test_the_new_job_page_offers_the_examples_as_presets(browser, settings):
    browser.post("/v1/session", json={"api_key": new_key(settings)})
    page = browser.get("/new").text
    presets = json.loads(re.search(r'<script type="application/json" id="presets">(.*?)</script>', page, re.S).group(1))
    examples = sorted(EXAMPLES.glob("*.yaml"))
    assert EXAMPLES == ROOT / "examples" and examples
    assert [p["name"] for p in presets] == [e.stem for e in examples]
    assert [p["spec"] for p in presets] == [yaml.safe_load(e.read_text()) for e in examples]


def test_events_from_a_step_skip_the_telemetry_before_it(api_url, settings, auth, worker):
    with Client(api_url, auth["Authorization"].split()[1]) as client:
        job = client.create_job(tiny_spec(steps=20))
        everything = list(client.events(job["id"]))
    with httpx.stream("GET", f"{api_url}/v1/jobs/{job['id']}/events?from_step=15", headers=auth) as r:
        parser = SseParser()
        tail = [event for line in r.iter_lines() if (event := parser.feed(line)) is not None]
    assert [e.data["step"] for e in tail if e.event == "metrics"] == [15, 16, 17, 18, 19, 20]
    kinds = lambda events: [e.event for e in events if e.event != "metrics"]  # noqa: E731
    assert kinds(tail) == kinds(everything)  # every job event, the final done included
