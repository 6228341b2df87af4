"""One writer per pipeline and role, on every host: the Cassandra lease, and the commands that take it."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from lambdalake.cassandra.session import connect
from lambdalake.lease import Lease, LeaseHeld
from lambdalake.settings import Settings
from tests.conftest import isolated, run_cli

pytestmark = [pytest.mark.services]


def lease(settings: Settings, pipeline: str, role: str, ttl_s: int | None = None) -> Lease:
    return Lease(session=connect(settings.cassandra), cassandra=settings.cassandra, pipeline=pipeline,
                 role=role, ttl_s=ttl_s)  # type: ignore[arg-type]  # fmt: skip


def test_roles_that_write_the_same_things_exclude_each_other(
    services: Settings, tmp_path: Path, unique: str
) -> None:
    settings = isolated(services, tmp_path, unique)
    with lease(settings, "offers", "speed job"):
        for role in ("speed job", "speed reset"):
            with pytest.raises(LeaseHeld) as refused:
                lease(settings, "offers", role).acquire()
            text = refused.value.message
            assert f"speed job on {socket.gethostname()} (pid {os.getpid()})" in text, text
            assert "last renewed" in text and "undeploy" in (refused.value.fix or "")
        # Beside the speed job: a batch run and a replay; and another pipeline's speed job.
        with (
            lease(settings, "offers", "batch run"),
            lease(settings, "offers", "replay"),
            lease(settings, "telemetry", "speed job"),
        ):
            with pytest.raises(LeaseHeld):
                lease(settings, "offers", "batch restore").acquire()
            with pytest.raises(LeaseHeld):
                lease(settings, "offers", "replay").acquire()
    with lease(settings, "offers", "speed reset"):  # released on a clean stop
        pass


def test_a_holder_killed_blocks_no_one_longer_than_its_ttl(
    services: Settings, tmp_path: Path, unique: str
) -> None:
    settings = isolated(services, tmp_path, unique)
    crashed = lease(settings, "offers", "speed job", ttl_s=4).acquire()
    crashed._stop.set()  # as after kill -9: no renewal and no release
    with pytest.raises(LeaseHeld) as refused:
        lease(settings, "offers", "speed job").acquire()
    assert "4 s at most" in (refused.value.fix or "") or " s at most" in (refused.value.fix or "")
    t0 = time.monotonic()
    taken = lease(settings, "offers", "speed job").acquire(wait_s=15)
    assert time.monotonic() - t0 <= 6  # the TTL, plus a retry interval
    # The crashed holder learns at its next renewal that the lease is not its own any more.
    crashed._stop.clear()
    crashed._renew_once()
    assert crashed.lost.is_set()
    taken.release()


def test_a_holder_killed_on_this_machine_is_replaced_at_once_and_one_elsewhere_is_waited_for(
    services: Settings, tmp_path: Path, unique: str
) -> None:
    import signal
    import subprocess
    import sys

    from tests.conftest import PROJECT_ROOT, env_for

    settings = isolated(services, tmp_path, unique)
    holds = (
        "import sys, time\n"
        "from lambdalake.cassandra.session import connect\n"
        "from lambdalake.lease import Lease\n"
        "from lambdalake.settings import Settings\n"
        "s = Settings()\n"
        "Lease(session=connect(s.cassandra), cassandra=s.cassandra, pipeline='offers', role='speed job',"
        " ttl_s=600).acquire()\n"
        "print('held', flush=True)\n"
        "time.sleep(600)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", holds], env=env_for(settings), cwd=PROJECT_ROOT,
                              stdout=subprocess.PIPE)  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        with pytest.raises(LeaseHeld):  # alive: refused
            lease(settings, "offers", "speed job").acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(30)
    t0 = time.monotonic()
    with lease(settings, "offers", "speed job") as taken:  # its process is gone: taken without waiting
        assert time.monotonic() - t0 < 5 and taken.current() is not None
        assert taken.current().pid == os.getpid()  # type: ignore[union-attr]
    # A holder of another machine (another boot id), whose PID means nothing here, is waited for.
    elsewhere = lease(settings, "offers", "speed job", ttl_s=600)
    elsewhere.holder = f"other-host:{holder.pid}:0000@00000000-0000-0000-0000-000000000000/pid:[1]"
    elsewhere.acquire()
    elsewhere._stop.set()
    try:
        with pytest.raises(LeaseHeld):
            lease(settings, "offers", "speed job").acquire()
    finally:
        elsewhere.release()


def test_commands_refuse_with_exit_2_naming_the_holder(
    services: Settings, tmp_path: Path, unique: str
) -> None:
    settings = isolated(services, tmp_path, unique)
    with lease(settings, "offers", "batch run"):
        t0 = time.monotonic()
        beside = run_cli(settings, "batch", "run", "offers")
        output = beside.stdout.decode() + beside.stderr.decode()
        assert beside.returncode == 2, output
        assert f"batch run on {socket.gethostname()} (pid {os.getpid()})" in output, output
        assert "incubator" not in output  # refused before a Spark JVM started
        restore = run_cli(settings, "batch", "restore", "offers")
        assert restore.returncode == 2, restore.stdout.decode() + restore.stderr.decode()
    with lease(settings, "offers", "speed job"):
        for args in (["speed", "reset", "offers", "--yes"], ["speed", "run", "offers", "--once"]):
            refused = run_cli(settings, *args)
            output = refused.stdout.decode() + refused.stderr.decode()
            assert refused.returncode == 2 and "held by speed job" in output, output
    assert time.monotonic() - t0 < 120
