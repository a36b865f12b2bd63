"""Jobs of several nodes (``resources.nnodes``), gang-scheduled on as many workers through the database.

A job's task goes out once per node. The worker that claims the job is node 0: its claim opens the
attempt's node slots (app.services.lifecycle ``claim``), the job's lease is its lease, and it
publishes where the others meet it: its c10d rendezvous and its launcher's socket, which global
rank 0 reports to. Each other worker that takes one of the job's tasks claims a free slot of the
running attempt under a lease of its own, and nothing starts until every slot is held. Node 0
alone records the outcome. A node whose group fails lets its slot lapse at once, and a node whose
worker is lost stops renewing it: either way node 0 sees the lapsed slot, gives the job back (the
attempt fails on every node: the others' slot leases end with it, which kills their groups) and
the job resumes from its latest checkpoint with a new gang.
"""

from __future__ import annotations

import logging
import socket
import time
from datetime import timedelta
from functools import partial

from app.db.models import JobNode
from app.db.session import retrying, transaction
from app.services import leases
from app.settings import Settings
from contract.spec import JobSpec
from worker.artifacts import (
    dataset_file,
    model_directory,
    read_as_stored,
    restore_checkpoint,
    run_directory,
    warm_start_file,
)
from worker.engine.launch import Meeting, Node
from worker.engine.request import RunRequest
from worker.engine.run import run_job
from worker.lease import GangBroken, Lease
from worker.sink import LeaseLost

log = logging.getLogger("muonforge.worker")
POLL_SECONDS = 0.5  # how often a node waiting for the others looks


def nnodes_of(spec: JobSpec) -> int:
    return spec.resources.nnodes


def node_address(settings: Settings) -> str:
    """Where the other nodes reach this worker: MUONFORGE_NODE_ADDRESS, or this host's name resolved."""
    if settings.node_address:
        return settings.node_address
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def this_node(settings: Settings, job_id: str, attempt: int, index: int, lease: Lease, nnodes: int) -> Node:
    """The engine's Node of this attempt: node ``index`` of ``nnodes``, meeting the others here."""
    return Node(index, node_address(settings), partial(_meet, settings, job_id, attempt, lease, nnodes))


def _meet(settings: Settings, job_id: str, attempt: int, lease: Lease, nnodes: int, mine: Meeting | None) -> Meeting:
    """Node 0 (``mine``: where it is met) publishes it and waits up to ``gang_wait_seconds`` for
    every slot to be held (GangBroken then, or on a cancel meanwhile); another node waits for node
    0's meeting until the attempt is over (LeaseLost)."""
    patience = settings.outage_patience_seconds
    if mine is not None:
        publish = partial(_publish, settings, job_id, attempt, mine)
        if not retrying(publish, f"job {job_id}: publishing where its nodes meet", patience):
            raise LeaseLost(f"job {job_id}: attempt {attempt} is over")
    deadline = time.monotonic() + settings.gang_wait_seconds
    while True:
        lease.pulse()  # waiting for the gang is progress of a kind: no stall
        lease.check()
        gang = retrying(partial(_gang, settings, job_id, attempt), f"job {job_id}: its nodes", patience)
        held = sum(n.owner is not None for n in gang.nodes)
        meeting = _published(gang.nodes[0])
        if held == nnodes and meeting is not None:
            return meeting
        if mine is not None and gang.cancel:
            raise GangBroken("the job was cancelled before every node joined")
        if mine is not None and time.monotonic() > deadline:
            raise GangBroken(f"{held} of the job's {nnodes} nodes joined within {settings.gang_wait_seconds:g} s")
        time.sleep(POLL_SECONDS)


def _publish(settings: Settings, job_id: str, attempt: int, mine: Meeting) -> bool:
    with transaction(settings) as session:
        return leases.publish_meeting(session, job_id, attempt, mine.rendezvous, mine.run_id, mine.report, mine.token)


def _published(first: JobNode) -> Meeting | None:
    """Where node 0 is met, once it has published it (its four fields together)."""
    if first.rendezvous is None or first.run_id is None or first.report is None or first.token is None:
        return None
    return Meeting(first.rendezvous, first.run_id, first.report, first.token)


def _gang(settings: Settings, job_id: str, attempt: int) -> leases.Gang:
    with transaction(settings) as session:
        return leases.gang(session, job_id, attempt)


def run_node(settings: Settings, job_id: str, owner: str) -> str:
    """Take a free slot of a running job of several nodes and train as that node until the attempt
    ends; what happened ("skipped": no slot to take). A node other than 0 records no outcome."""
    patience = settings.outage_patience_seconds
    joined = retrying(partial(_join, settings, job_id, owner), f"job {job_id}: joining", patience)
    if joined is None:
        return "skipped"  # a redelivery, a finished job, a full gang
    attempt, index, spec = joined.attempt, joined.node, joined.spec
    model_id = spec.model.hf.model_id if spec.model.hf is not None else None
    log.info("job %s: attempt %d: node %d joined by %s", job_id, attempt, index, owner)

    out_dir = run_directory(settings, job_id)
    with Lease(settings, job_id, attempt, node=index, owner=owner) as lease:
        node = this_node(settings, job_id, attempt, index, lease, nnodes_of(spec))
        try:
            # Through this host's cache, held for the whole run; a file it cannot read: the node leaves.
            with (
                dataset_file(settings, joined.dataset) as corpus,
                warm_start_file(settings, spec) as init_from,
                model_directory(settings, job_id, model_id, joined.model) as model_dir,
            ):
                restore_checkpoint(settings, job_id)  # every node resumes from the same checkpoint
                run_job(
                    RunRequest(
                        read_as_stored(spec, joined.dataset),
                        out_dir,
                        corpus,
                        init_from=init_from,
                        watch=lease.check,
                        node=node,
                        model_dir=model_dir,
                    )
                )
        except LeaseLost:
            return "lease_lost"  # the attempt is over: node 0 ended it or gave the job back
        except Exception as exc:
            log.warning("job %s: attempt %d: node %d cannot go on: %s", job_id, attempt, index, exc)
            leave = partial(_leave, settings, job_id, attempt, index, owner)
            retrying(leave, f"job {job_id}: leaving", patience)
            return "left"
    return "node_done"


def _join(settings: Settings, job_id: str, owner: str) -> leases.NodeClaim | None:
    with transaction(settings) as session:
        return leases.join(session, job_id, owner, timedelta(seconds=settings.lease_seconds))


def _leave(settings: Settings, job_id: str, attempt: int, node: int, owner: str) -> None:
    with transaction(settings) as session:
        leases.leave(session, job_id, attempt, node, owner)
