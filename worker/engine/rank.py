"""One rank of a job's torch.distributed group, as torchrun starts it for launch.run_group.

Run as ``python -m worker.engine.rank``, it joins the group, connects to the launcher, and trains
its share of the job; rank 0 streams the telemetry, checkpoints and the outcome back.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from .channel import ADDRESS_ENV, REPORT_ENV, REPORT_TOKEN_ENV, TOKEN_ENV, RankChannel
from .config import job_config
from .device import resolve_device
from .distributed import join_group, leave_group
from .outcome import TrainingError
from .request import RunRequest
from .run import run_process


def main(argv: list[str] | None = None) -> int:
    """Train this rank's share of the job; rank 0 reports the outcome.

    The outcome is the result, a TrainingError (with its code) or running out of memory. Anything
    else ends a rank with its traceback in ranks.log, unreported: once one rank dies a collective
    fails on every other, and such a failure cannot be told from a fault of the run's own here; the
    group then ends as a lost rank's does, and the job resumes (up to train.max_restarts).
    """
    parser = argparse.ArgumentParser(prog="python -m worker.engine.rank")
    parser.add_argument("--spec", type=Path, required=True, help="the validated JobSpec, as JSON")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--corpus", type=Path)
    parser.add_argument("--fresh", action="store_true", help="do not resume from a checkpoint")
    parser.add_argument("--init-from", type=Path, help="a warm start's checkpoint file (every rank loads it)")
    args = parser.parse_args(argv)
    spec = json.loads(args.spec.read_text())
    rank = int(os.environ["RANK"])
    report = (os.environ[REPORT_ENV], os.environ[REPORT_TOKEN_ENV]) if REPORT_ENV in os.environ else None
    channel = RankChannel(os.environ[ADDRESS_ENV], os.environ[TOKEN_ENV], rank, report)
    lead = rank == 0
    try:
        device, _ = resolve_device(job_config(spec).train)
        group = join_group(device.type == "cuda")
        request = RunRequest(
            spec,
            args.out,
            args.corpus,
            sink=channel if lead else None,
            should_cancel=channel.should_cancel if lead else None,
            resume=not args.fresh,
            init_from=args.init_from,
        )
        result = run_process(request, group)
        if lead:
            channel.result(result)
        channel.done()
        leave_group(together=True)
        return 0
    except TrainingError as exc:
        # Every rank raises it at the same step (the decisions are collective): rank 0 reports it
        # and every rank leaves quietly, so that torchrun stops no rank before it is done and no
        # node takes the group's end for a lost rank: the outcome is in the report.
        if lead:
            channel.error(exc.code, str(exc))
        channel.done()
        leave_group(together=True)
        return 0
    except torch.OutOfMemoryError as exc:
        if lead:
            channel.error("out_of_memory", str(exc))
        raise
    finally:
        leave_group()
        channel.close()


if __name__ == "__main__":
    sys.exit(main())
