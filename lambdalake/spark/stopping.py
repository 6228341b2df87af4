"""Stopping a streaming query without the errors its stop makes Spark and py4j log.

A stop interrupts the query's running batch: Spark logs each interrupted task, and a
``foreachBatch`` callback whose Spark call is interrupted is logged by py4j with its Python
traceback (and, its message being long, can overflow the stack of Spark's check of it:
:func:`interruptible`). None of it is a failure (the batch runs again from the checkpoint at the
next start), and an error of the query's own is its exception, which the job reports, so it is kept
out of the log while the query stops.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from py4j.protocol import Py4JError, Py4JJavaError
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming import StreamingQuery

#: Spark's loggers that report tasks interrupted by a stop as errors, with stack traces (a Real-time
#: task lasts its whole batch, so every stop of a Real-time query interrupts some).
STOP_NOISE = (
    "org.apache.spark.util.Utils",
    "org.apache.spark.sql.execution.datasources.v2.WriteToDataSourceV2Exec",
    "org.apache.spark.sql.execution.datasources.v2.DataWritingSparkTask",
    "org.apache.spark.scheduler.TaskSetManager",
    "org.apache.spark.TaskContextImpl",
)
#: py4j's callback server, which logs a ``foreachBatch`` callback's exception with its traceback.
PY4J_CALLBACKS = "py4j.clientserver"


def stop_quietly(spark: SparkSession, query: StreamingQuery, *, restore: bool = True) -> None:
    """Stop ``query`` with :data:`STOP_NOISE` and :data:`PY4J_CALLBACKS` silent.

    Args:
        spark: The query's session.
        query: The query.
        restore: Whether the loggers get their levels back afterwards (default True; a process
            about to end need not).
    """
    jvm = spark.sparkContext._jvm  # type: ignore[attr-defined]
    log4j = jvm.org.apache.logging.log4j
    configurator = log4j.core.config.Configurator
    before = {name: log4j.LogManager.getLogger(name).getLevel() for name in STOP_NOISE}
    callbacks = logging.getLogger(PY4J_CALLBACKS)
    callbacks_before = callbacks.level
    for name in STOP_NOISE:
        configurator.setLevel(name, log4j.Level.OFF)
    callbacks.setLevel(logging.CRITICAL + 1)
    try:
        query.stop()
    finally:
        if restore:
            for name, level in before.items():
                configurator.setLevel(name, level)
            callbacks.setLevel(callbacks_before)


#: The Java exceptions an interrupted Spark call ends in (Spark's own list of them).
INTERRUPTS = frozenset({
    "java.lang.InterruptedException",
    "java.io.InterruptedIOException",
    "java.nio.channels.ClosedByInterruptException",
})  # fmt: skip


class StoppedMidBatch(Exception):
    """A ``foreachBatch`` callback's Spark call was interrupted: its query is stopping."""


def interruptible(callback: Callable[[DataFrame, int], None]) -> Callable[[DataFrame, int], None]:
    """``callback`` (a ``foreachBatch`` function) ending in a short error when its query's stop
    interrupts it, instead of Py4J's.

    Spark tells a stop from a failure by matching a Py4J error's whole message (the callback's
    traceback, with the Java stack trace inside) against a pattern that recurses once a character:
    on a message that long the stream thread dies of a ``StackOverflowError`` and prints a thousand
    lines of it. The short error quotes the call and the Java exception the way Py4J does, which
    that pattern recognises, so the stop is a stop. Any other error is raised as it was.
    """

    @functools.wraps(callback)
    def run(df: DataFrame, batch_id: int) -> None:
        try:
            callback(df, batch_id)
        except Py4JJavaError as exc:
            name = _java_class(exc)
            if name not in INTERRUPTS:
                raise
            raise StoppedMidBatch(
                f"py4j.protocol.Py4JJavaError: An error occurred while calling batch {batch_id}.\n: {name}"
            ) from None

    return run


def _java_class(exc: Py4JJavaError) -> str | None:
    try:
        return str(exc.java_exception.getClass().getName())
    except Py4JError:  # the JVM is going away: no name to read
        return None
