"""Where the API's CPU goes under bench/api_load.py: py-spy samples the `muonforge api` process
while it holds the GIL, and each sample is counted once, in the stage its deepest frame of this
project's code (and the library below it) names.

    .venv/bin/python bench/api_profile.py [--seconds 15] [--rate 250]

Needs py-spy (the dev extra) and the right to trace a child process (root, or ptrace_scope 0).
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = re.compile(r"\((app|contract|worker)/")
LIBRARY = re.compile(r"\(([a-z_]+)[/.]")
THREADS = ("anyio", "asyncio", "concurrent", "threading")


def stage(frames: list[str]) -> str:
    """The stage one sample (its frames, outermost first) belongs to."""
    stack = ";".join(frames)
    ours = [i for i, f in enumerate(frames) if OURS.search(f)]
    deepest = frames[ours[-1]] if ours else ""
    below = frames[ours[-1] + 1 :] if ours else frames
    libraries = [m.group(1) for f in below if (m := LIBRARY.search(f))]
    library = libraries[-1] if libraries else ""
    if "_find_and_load" in stack or "<module>" in deepest or "_lifespan" in deepest:
        return "start-up (imports, lifespan)"
    if "JobWriter._run" in stack:
        return "JobWriter thread: batch INSERT, first events, commit"
    if "TaskPublisher._run" in stack:
        return "TaskPublisher thread: task messages"
    if "run_deliveries" in stack or "run_reaper" in stack:
        return "background loops (webhooks, reaper)"
    if "shared_limits.py" in deepest or "TenantLimits" in deepest:
        return "per-tenant limits: rate token, stream slot (Redis scripts)"
    if "auth.py" in deepest:
        return "auth (key hash, cache)"
    if re.search(r"submission.py|admission.py|caps.py|facts.py|contract/spec.py", deepest) or library == "pydantic":
        return "spec validation, checks, admission"
    if library in THREADS or re.search(r"quotas.py|deps.py", deepest):
        return "thread hand-offs (anyio, per-tenant pool, unit of work)"
    if "observability.py" in deepest:
        return "request metrics"
    return "HTTP: uvicorn, Starlette, FastAPI routing, JSON"


def stages(raw: Path) -> collections.Counter[str]:
    """Samples per stage of the API process, from py-spy's raw (collapsed stacks) output."""
    counts: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if "muonforge.cli api" in stack:
            counts[stage(stack.split(";")[2:])] += int(n)  # past "process N" of py-spy and of the API
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=15.0, help="length of each bench/api_load.py phase")
    parser.add_argument("--rate", type=int, default=250, help="samples per second")
    args = parser.parse_args()
    spy = Path(sys.executable).with_name("py-spy")
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "api.raw"
        load = [sys.executable, str(ROOT / "bench" / "api_load.py"), "--seconds", str(args.seconds)]
        subprocess.run(
            [
                str(spy),
                "record",
                "--subprocesses",
                "--gil",
                "--format",
                "raw",
                "-r",
                str(args.rate),
                "-o",
                str(raw),
                "--",
                *load,
            ],
            check=True,
        )
        counts = stages(raw)
    total = sum(counts.values())
    print(f"\nAPI process, samples while holding the GIL: {total}")
    for name, n in counts.most_common():
        print(f"{n / total:7.1%}  {name}")


if __name__ == "__main__":
    main()
