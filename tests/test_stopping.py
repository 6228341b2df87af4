"""Stopping a query mid-batch (:mod:`lambdalake.spark.stopping`) on a real Spark session: the stop
interrupts a ``foreachBatch`` callback's Spark job, and nothing of it reaches the log or the
process's output (the speed job's main query is such a query)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest

from lambdalake.spark.stopping import PY4J_CALLBACKS, interruptible, stop_quietly

pytestmark = [pytest.mark.services, pytest.mark.slow]


def _slow(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    time.sleep(120)  # interrupted by the stop long before
    yield from batches


@dataclass
class _Written:
    text: str = ""


@contextmanager
def _jvm_stderr(spark) -> Iterator[_Written]:
    """What the JVM prints to its standard error meanwhile (a dying thread's stack trace goes there)."""
    jvm = spark.sparkContext._jvm
    buffer, original = jvm.java.io.ByteArrayOutputStream(), jvm.System.err
    jvm.System.setErr(jvm.java.io.PrintStream(buffer, True))
    written = _Written()
    try:
        yield written
    finally:
        jvm.System.setErr(original)
        written.text = str(buffer.toString())


def test_a_query_stopped_in_the_middle_of_a_batch_logs_no_traceback(
    spark, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    running = threading.Event()
    ended: list[int] = []

    def batch(df, batch_id: int) -> None:
        if batch_id == 0:
            return  # the rate source's first batch is empty: no task to interrupt
        running.set()
        df.mapInArrow(_slow, df.schema).collect()
        ended.append(batch_id)

    query = (
        spark.readStream.format("rate").option("rowsPerSecond", 5).load()
        .writeStream.foreachBatch(interruptible(batch))
        .option("checkpointLocation", str(tmp_path / "checkpoint")).start()
    )  # fmt: skip
    level = logging.getLogger(PY4J_CALLBACKS).level
    try:
        assert running.wait(120), "no batch with rows started"
        time.sleep(2)  # its job is under way
        with caplog.at_level(logging.DEBUG), _jvm_stderr(spark) as jvm_err:
            stop_quietly(spark, query)
    finally:
        if query.isActive:
            query.stop()
    assert not ended, "the batch ended before the stop: it interrupted nothing"
    assert not query.isActive
    noise = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not noise, [(r.name, r.getMessage()[:200]) for r in noise]
    # Spark took the stop for a stop: its stream thread did not die checking the callback's error
    # (a StackOverflowError and a thousand lines of stack trace on the JVM's stderr).
    assert "StackOverflowError" not in jvm_err.text, jvm_err.text[:3000]
    # The loggers are as they were.
    assert logging.getLogger(PY4J_CALLBACKS).level == level
