"""An attempt's lease on its job, or on its node slot, renewed from a background thread.

A node other than 0 of a job of several nodes holds a lease on its slot instead of the job's. The
thread renews it while the attempt makes progress.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

from sqlalchemy.orm import Session

from app.db.session import transaction
from app.services import leases
from app.settings import Settings
from worker.engine.launch import RankFailed
from worker.sink import LeaseLost

log = logging.getLogger("muonforge.worker")


class GangBroken(RankFailed):
    """The nodes of a job of several cannot go on together (a node stopped renewing its slot, or
    not every node joined in time): the attempt fails on every node and the job resumes."""


class Lease:
    """Renews the attempt's lease from a background thread while the trainer makes progress;
    remembers whether it was lost.

    The trainer ``pulse()``s before every step. An attempt with no pulse for ``stall_seconds``
    (a hung kernel, a deadlock, a step that will never end) stops renewing: its lease lapses and
    the reaper gives the job to another worker, which resumes it from its checkpoint. Were the
    thread to renew regardless, a stalled trainer would hold its job for ever.

    In a job of several nodes, node 0's lease is the job's, and each beat also looks for the other
    nodes whose slot lease lapsed (``lost_nodes``); another node renews its slot, for as long as
    the job runs in its attempt (node 0 watches for stalls: a stalled node stalls rank 0 too)."""

    def __init__(
        self, settings: Settings, job_id: str, attempt: int, node: int = 0, owner: str | None = None, nnodes: int = 1
    ) -> None:
        if node and owner is None:
            raise ValueError("a node other than node 0 renews its slot, and needs the slot's owner")
        self.settings, self.job_id, self.attempt = settings, job_id, attempt
        self.node, self.owner, self.nnodes = node, owner or "", nnodes  # node 0 owns no slot
        self.lost = threading.Event()
        self.stalled = threading.Event()
        self.lost_nodes: list[int] = []
        self._pulse = time.monotonic()  # loading the data counts as progress until the first step
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lease-{job_id}", daemon=True)

    def __enter__(self) -> Lease:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def pulse(self) -> None:
        """The trainer is making progress (it is about to run a step)."""
        self._pulse = time.monotonic()

    def check(self) -> None:
        """LeaseLost once the lease is lost, or left to lapse after a stall; GangBroken once
        another node of the job stopped renewing its slot."""
        if self.lost.is_set() or self.stalled.is_set():
            raise LeaseLost(f"job {self.job_id}: the lease was lost")
        if self.lost_nodes:
            raise GangBroken(f"node {self.lost_nodes[0]} of attempt {self.attempt} stopped renewing its lease")

    def _run(self) -> None:
        lease = timedelta(seconds=self.settings.lease_seconds)
        while not self._stop.wait(self.settings.heartbeat_seconds):
            idle = time.monotonic() - self._pulse
            if self.node == 0 and idle > self.settings.stall_seconds:
                log.error(
                    "job %s: attempt %d completed no step for %.0f s; its lease is left to lapse (the job resumes "
                    "elsewhere)",
                    self.job_id,
                    self.attempt,
                    idle,
                )
                self.stalled.set()
                return
            try:
                with transaction(self.settings) as session:
                    if not self._renew(session, lease):
                        self.lost.set()
                        return
            except Exception:  # a database blip: try again next beat; the lease has slack
                log.exception("job %s: heartbeat failed", self.job_id)

    def _renew(self, session: Session, lease: timedelta) -> bool:
        if self.node:
            return leases.renew_node(session, self.job_id, self.attempt, self.node, self.owner, lease)
        lost_nodes = leases.renew(session, self.job_id, self.attempt, lease, self.nnodes)
        if lost_nodes is None:
            return False
        if self.nnodes > 1:
            self.lost_nodes = lost_nodes
        return True
