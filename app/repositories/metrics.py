"""All SQL about stored telemetry: metric series and their columnar chunks."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import bindparam, delete, func, insert, select, text, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from app.db.models import Job, MetricChunk, MetricSeries

# The metric_chunks columns a COPY writes, with their Postgres types (COPY's binary format needs them).
CHUNK_COLUMNS = {
    "job_id": "text",
    "name": "text",
    "first_step": "int4",
    "last_step": "int4",
    "n": "int4",
    "steps": "bytea",
    "values": "bytea",
    "min_step": "int4",
    "min_value": "float8",
    "max_step": "int4",
    "max_value": "float8",
    "last_value": "float8",
}

# Per series and bucket of ``width`` steps (a chunk belongs to the bucket of its first step), the
# chunks holding the bucket's smallest value, its largest value and its last point: a window over
# the summaries of the chunks inside [lo, hi], never over points.
BUCKET_SUMMARIES = text("""
SELECT name, b, rmin, rmax, rlast, min_step, min_value, max_step, max_value, last_step, last_value FROM (
    SELECT name, (first_step - :lo) / :width AS b, min_step, min_value, max_step, max_value, last_step, last_value,
           ROW_NUMBER() OVER (PARTITION BY name, (first_step - :lo) / :width ORDER BY min_value, min_step) AS rmin,
           ROW_NUMBER() OVER (PARTITION BY name, (first_step - :lo) / :width ORDER BY max_value DESC, max_step)
               AS rmax,
           ROW_NUMBER() OVER (PARTITION BY name, (first_step - :lo) / :width ORDER BY last_step DESC) AS rlast
    FROM metric_chunks
    WHERE job_id = :job_id AND name IN :names AND first_step >= :lo AND last_step <= :hi
) AS ranked WHERE rmin = 1 OR rmax = 1 OR rlast = 1
""").bindparams(bindparam("names", expanding=True))


class MetricRepository:
    def __init__(self, session: Session) -> None:
        self.session = session

    # -- ingest ---------------------------------------------------------------------------------
    def lock_job(self, job_id: str) -> bool:
        """Lock the job's row until commit (one writer of a job's metrics at a time); False if
        there is no such job."""
        query = select(Job.id).where(Job.id == job_id).with_for_update()
        return self.session.scalar(query) is not None

    def series_state(self, job_id: str) -> dict[str, Any]:
        """Every series of the job: name -> row (last_step, tail_step, tail_points)."""
        query = select(MetricSeries.name, MetricSeries.last_step, MetricSeries.tail_step, MetricSeries.tail_points)
        return {row.name: row for row in self.session.execute(query.where(MetricSeries.job_id == job_id))}

    def take_chunks(self, job_id: str, keys: Sequence[tuple[str, int]]) -> dict[str, tuple[bytes, bytes]]:
        """Delete the chunks (name, first_step) and return their points, by name."""
        if not keys:
            return {}
        key = tuple_(MetricChunk.name, MetricChunk.first_step)
        stmt = (
            delete(MetricChunk)
            .where(MetricChunk.job_id == job_id, key.in_(list(keys)))
            .returning(MetricChunk.name, MetricChunk.steps, MetricChunk.values)
        )
        return {row.name: (row.steps, row.values) for row in self.session.execute(stmt)}

    def add_chunks(self, rows: Sequence[dict[str, Any]]) -> None:
        """Insert chunk rows: COPY (binary) on Postgres, one multi-row INSERT elsewhere."""
        if not rows:
            return
        connection = self.session.connection()
        if connection.dialect.name != "postgresql":
            self.session.execute(insert(MetricChunk.__table__), list(rows))
            return
        driver = connection.connection.driver_connection
        if driver is None:  # only an invalidated connection has none
            raise RuntimeError("the database connection was invalidated")
        cursor = driver.cursor()
        columns = ", ".join(f'"{c}"' for c in CHUNK_COLUMNS)
        with cursor.copy(f"COPY metric_chunks ({columns}) FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(list(CHUNK_COLUMNS.values()))
            for row in rows:
                copy.write_row([row[c] for c in CHUNK_COLUMNS])

    def update_series(self, rows: Sequence[dict[str, Any]]) -> None:
        """Add points to series ({job_id, name, points, first_step, last_step, tail_step,
        tail_points}), creating new ones."""
        if not rows:
            return
        dialect = postgresql if self.session.get_bind().dialect.name == "postgresql" else sqlite
        stmt = dialect.insert(MetricSeries.__table__)
        excluded = stmt.excluded
        stmt = stmt.on_conflict_do_update(
            index_elements=["job_id", "name"],
            set_={
                "points": MetricSeries.points + excluded.points,
                "last_step": excluded.last_step,
                "tail_step": excluded.tail_step,
                "tail_points": excluded.tail_points,
            },
        )
        self.session.execute(stmt, list(rows))

    def set_mark(self, job_id: str, mark: str) -> None:
        self.session.execute(update(Job).where(Job.id == job_id).values(telemetry_mark=mark))

    # -- reads ----------------------------------------------------------------------------------
    def last_steps(self, job_ids: Sequence[str], name: str) -> dict[str, int]:
        """The last stored step of the series ``name`` of each of these jobs that has it, by job."""
        if not job_ids:
            return {}
        query = select(MetricSeries.job_id, MetricSeries.last_step).where(
            MetricSeries.job_id.in_(list(job_ids)), MetricSeries.name == name
        )
        return {row.job_id: row.last_step for row in self.session.execute(query)}

    def series(self, job_id: str, names: Sequence[str] | None = None) -> list[MetricSeries]:
        query = select(MetricSeries).where(MetricSeries.job_id == job_id)
        if names is not None:
            query = query.where(MetricSeries.name.in_(names))
        return list(self.session.scalars(query.order_by(MetricSeries.name)))

    def chunks(
        self, job_id: str, names: Sequence[str] | None, lo: int, hi: int, cut_by_range: bool = False
    ) -> list[Any]:
        """Chunks (name, steps, values) overlapping steps [lo, hi], by name then step;
        ``cut_by_range``: only those that reach past lo or hi."""
        query = select(MetricChunk.name, MetricChunk.steps, MetricChunk.values).where(
            MetricChunk.job_id == job_id, MetricChunk.last_step >= lo, MetricChunk.first_step <= hi
        )
        if names is not None:
            query = query.where(MetricChunk.name.in_(names))
        if cut_by_range:
            query = query.where((MetricChunk.first_step < lo) | (MetricChunk.last_step > hi))
        return list(self.session.execute(query.order_by(MetricChunk.name, MetricChunk.first_step)))

    def range_stats(self, job_id: str, names: Sequence[str], lo: int, hi: int) -> list[Any]:
        """Per series, the chunks overlapping [lo, hi] and their points (name, chunks, points)."""
        query = (
            select(MetricChunk.name, func.count().label("chunks"), func.sum(MetricChunk.n).label("points"))
            .where(
                MetricChunk.job_id == job_id,
                MetricChunk.name.in_(names),
                MetricChunk.last_step >= lo,
                MetricChunk.first_step <= hi,
            )
            .group_by(MetricChunk.name)
        )
        return list(self.session.execute(query))

    def bucket_summaries(self, job_id: str, names: Sequence[str], lo: int, hi: int, width: int) -> list[Any]:
        """BUCKET_SUMMARIES of the chunks inside [lo, hi]: up to three rows per series and bucket."""
        params = {"job_id": job_id, "names": list(names), "lo": lo, "hi": hi, "width": width}
        return list(self.session.execute(BUCKET_SUMMARIES, params))
