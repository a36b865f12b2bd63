"""The web app's pages and files: each page a shell whose script fetches what it shows.

The script reads the /v1 API with the session cookie; without a valid key in that cookie, every
page is the sign-in form. Third-party front-end code comes from app/web/node_modules, installed by
``npm ci`` from the locked app/web/package-lock.json (``make web``), and is never committed.
"""

from __future__ import annotations

import hashlib
import logging
from functools import cache, lru_cache
from pathlib import Path
from typing import Annotated

import yaml
from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from pydantic import ValidationError

from app.api.deps import Work
from app.errors import Unauthorized
from app.services.auth import tenant_name
from contract import metrics, status
from contract.spec import JobSpec
from contract.spec import choices as spec_choices

log = logging.getLogger("muonforge.web")
WEB = Path(__file__).parent
STATIC, NODE_MODULES = WEB / "static", WEB / "node_modules"
EXAMPLES = WEB.parents[1] / "examples"  # the repository's example specs: the /new page's presets
VENDOR = {  # URL prefix -> the files of an npm package that the pages load
    "/vendor/uplot": NODE_MODULES / "uplot" / "dist",
    "/vendor/js-yaml": NODE_MODULES / "js-yaml" / "dist" / "browser",
}
MAX_COMPARE = 20  # jobs on one compare page

router = APIRouter(include_in_schema=False)
templates = Jinja2Templates(directory=WEB / "templates")  # autoescaped: user text is never markup
templates.env.policies["json.dumps_kwargs"] = {"sort_keys": False}  # |tojson keeps a spec's own order


@cache
def asset(path: str) -> str:
    """``path`` (under /static or /vendor) with its content's hash as a version, so a browser may
    cache it for good and still gets a changed file at once."""
    prefix, _, rest = path.lstrip("/").partition("/")
    base = STATIC if prefix == "static" else VENDOR.get(f"/vendor/{rest.split('/')[0]}")
    name = rest if prefix == "static" else rest.partition("/")[2]
    file = base / name if base else None
    digest = hashlib.sha256(file.read_bytes()).hexdigest()[:12] if file and file.is_file() else "missing"
    return f"{path}?v={digest}"


templates.env.globals["asset"] = asset
# Embedded in every page: the scripts' only statuses and metric names.
templates.env.globals["contract"] = {"status": status.as_json(), "metrics": metrics.as_json()}


@lru_cache(maxsize=1)
def presets() -> list[dict]:
    """The example specs, {name, spec}, for the new-job form."""
    out = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        try:
            out.append({"name": path.stem, "spec": yaml.safe_load(path.read_text(encoding="utf-8"))})
        except (OSError, yaml.YAMLError) as exc:
            log.warning("preset %s skipped: %s", path, exc)
    return out


def _flat(obj: dict, prefix: str = "") -> dict:
    """A nested mapping as {dotted path: leaf value}."""
    out: dict = {}
    for key, value in obj.items():
        if isinstance(value, dict):
            out |= _flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


@cache
def spec_defaults() -> dict:
    """What the server makes of each field a spec leaves out, by its path, for the new-job form.

    ``base`` holds the values for the first architecture and the default optimizer; ``by``, keyed
    "ARCH OPTIMIZER", those that differ for a pair (lr, the MoE and QK-Clip fields). The
    architecture and the data source, which every spec gives, have none; nor has a section that
    cannot be filled in from the architecture alone (null: the form shows no default there).
    """
    given = ("model.arch", "data.builtin")

    def filled(arch: str, optimizer: str | None = None) -> dict:
        spec = {"model": {"arch": arch}, "data": {"builtin": "synthetic"}}
        if optimizer:
            spec["optimizer"] = {"name": optimizer}
        return {k: v for k, v in _flat(JobSpec.model_validate(spec).stored()).items() if k not in given}

    options = spec_choices()
    base = filled(options["model.arch"][0])
    by: dict[str, dict] = {}
    for arch in options["model.arch"]:
        for name in options["optimizer.name"]:
            try:
                values = filled(arch, name)
            except ValidationError as exc:  # as the first architecture's, but the sections in error
                sections = {str(e["loc"][0]) for e in exc.errors() if e["loc"]}
                values = {
                    k: None if k.split(".")[0] in sections else v
                    for k, v in filled(options["model.arch"][0], name).items()
                }
            diff = {k: v for k, v in values.items() if k != "optimizer.name" and (k not in base or base[k] != v)}
            if diff:
                by[f"{arch} {name}"] = diff
    return {"base": base, "by": by}


async def page(request: Request, work: Work, template: str, **context) -> HTMLResponse:
    """The page for a signed-in browser; the sign-in form otherwise."""
    try:
        tenant = await work(tenant_name)
    except Unauthorized:
        return templates.TemplateResponse(request, "signin.html", {"page": "signin"})
    return templates.TemplateResponse(request, template, {"tenant": tenant, **context})


@router.get("/", response_class=HTMLResponse)
async def jobs_page(request: Request, work: Work) -> HTMLResponse:
    return await page(request, work, "jobs.html", page="jobs")


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
async def job_page(request: Request, work: Work, job_id: str) -> HTMLResponse:
    return await page(request, work, "job.html", page="job", job_id=job_id)


@router.get("/compare", response_class=HTMLResponse)
async def compare_page(request: Request, work: Work, jobs: Annotated[str, Query(max_length=2000)] = "") -> HTMLResponse:
    ids = [j for j in (part.strip() for part in jobs.split(",")) if j][:MAX_COMPARE]
    return await page(request, work, "compare.html", page="compare", job_ids=ids, max_jobs=MAX_COMPARE)


@router.get("/sweeps", response_class=HTMLResponse)
async def sweeps_page(request: Request, work: Work) -> HTMLResponse:
    return await page(request, work, "sweeps.html", page="sweeps")


@router.get("/sweeps/{sweep_id}", response_class=HTMLResponse)
async def sweep_page(request: Request, work: Work, sweep_id: str) -> HTMLResponse:
    return await page(request, work, "sweep.html", page="sweep", sweep_id=sweep_id, max_jobs=MAX_COMPARE)


@router.get("/new", response_class=HTMLResponse)
async def new_job_page(request: Request, work: Work) -> HTMLResponse:
    return await page(
        request, work, "new.html", page="new", presets=presets(), choices=spec_choices(), defaults=spec_defaults()
    )


def install_web(app: FastAPI) -> None:
    """The pages, our static files, and the vendored packages' files."""
    app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    for prefix, directory in VENDOR.items():
        if not directory.is_dir():
            log.error("%s is missing: the web app's charts need `make web` (npm ci in app/web)", directory)
        app.mount(prefix, StaticFiles(directory=directory, check_dir=False), name=prefix)
