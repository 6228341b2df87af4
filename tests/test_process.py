"""Background processes by PID file (infra/process.py), the addresses settings name
(infra/addresses.py) and ``running()`` (infra/services.py): each test here failed on the code before
its fix."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import lambdalake.infra.process as process
import lambdalake.infra.services as services
from lambdalake.errors import ConfigurationError, LambdalakeError
from lambdalake.infra.addresses import host_port, joined
from lambdalake.infra.process import ManagedProcess, pid_alive
from lambdalake.settings import Settings

#: A process that sleeps and names itself, so a test's marker matches it alone.
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)", "lambdalake-test-sleeper"]


@pytest.fixture
def sleeper(tmp_path: Path) -> Iterator[ManagedProcess]:
    proc = ManagedProcess(
        name="sleeper", run_dir=tmp_path / "run", log_dir=tmp_path / "logs", marker="lambdalake-test-sleeper"
    )
    yield proc
    pid = proc.pid()
    if pid is not None:
        os.killpg(pid, signal.SIGKILL)


def test_checking_a_pid_never_deletes_a_pid_file(sleeper: ManagedProcess) -> None:
    """Measured before: pid() deleted a PID file it could not read, so a check racing a start's
    write of the file left the started service without one (and `down` could not stop it)."""
    sleeper.run_dir.mkdir(parents=True)
    sleeper.pid_file.write_text("")  # as a start that has opened the file and not written it yet
    assert sleeper.pid() is None
    assert sleeper.pid_file.exists()
    sleeper.pid_file.write_text("999999999")  # a PID no process has
    assert sleeper.pid() is None
    assert sleeper.pid_file.exists()


def test_a_pid_file_is_written_whole_and_removed_by_a_stop(sleeper: ManagedProcess) -> None:
    pid = sleeper.spawn(SLEEPER)
    assert sleeper.pid_file.read_text() == str(pid)
    assert sorted(p.name for p in sleeper.run_dir.iterdir()) == ["sleeper.pid"], "no partial file left"
    assert sleeper.pid() == pid
    assert sleeper.stop(timeout=10) is True
    assert not pid_alive(pid)
    assert not sleeper.pid_file.exists()


def test_a_stop_gives_up_after_sigkill_naming_the_process(
    sleeper: ManagedProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measured before: a process that outlived SIGKILL (stuck in the kernel) was waited on forever."""
    pid = sleeper.spawn(SLEEPER)
    monkeypatch.setattr(process, "pid_alive", lambda _pid: True)  # never goes, whatever it is sent
    monkeypatch.setattr(process.os, "killpg", lambda *_: None)
    started = time.monotonic()
    with pytest.raises(LambdalakeError) as stuck:
        sleeper.stop(timeout=0.2, kill_timeout=0.5)
    assert time.monotonic() - started < 10
    assert f"pid {pid}" in stuck.value.message and "after SIGKILL" in stuck.value.message
    assert sleeper.pid_file.exists(), "the PID file still names it"


@pytest.mark.parametrize(
    ("address", "host", "port"),
    [
        ("broker1", "broker1", 9092),
        ("broker1:9093", "broker1", 9093),
        ("[::1]:19092", "::1", 19092),
        ("[::1]", "::1", 9092),
        ("::1", "::1", 9092),
        (" localhost:9092 ", "localhost", 9092),
    ],
)
def test_an_address_with_or_without_a_port(address: str, host: str, port: int) -> None:
    """Measured before: a bootstrap address without a port crashed (int('broker1')), and [::1] kept
    its brackets, so the embedded broker took it for a remote host."""
    assert host_port(address, 9092) == (host, port)


def test_a_port_that_is_not_a_number_is_named() -> None:
    with pytest.raises(ConfigurationError) as bad:
        host_port("broker1:nine", 9092)
    assert "broker1:nine" in bad.value.message


def test_the_embedded_broker_is_found_on_ipv6_loopback_and_on_a_bare_name() -> None:
    local = services.BrokerService(Settings(kafka={"bootstrap_servers": "[::1]:19092"}))
    assert local.embedded and local.port == 19092 and local.address == "[::1]:19092"
    # Settings refuse an address without a port when read; a copy made in code is not validated.
    base = Settings()
    unvalidated = base.model_copy(
        update={"kafka": base.kafka.model_copy(update={"bootstrap_servers": "broker1,broker2:9093"})}
    )
    remote = services.BrokerService(unvalidated)
    assert not remote.embedded and remote.port == 9092
    assert joined("::1", 1) == "[::1]:1" and joined("h", 2) == "h:2"


class _Sleeper(services.EmbeddedService):
    """A stand-in service (a narrow unit test): a sleeping process, healthy while it runs."""

    name = "sleeper"
    marker = "lambdalake-test-sleeper"
    start_timeout = 10.0

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def port(self) -> int:
        return 1  # nothing listens there

    def ports(self) -> list[int]:
        return []

    def argv(self) -> list[str]:
        return SLEEPER

    def probe(self) -> str | None:
        return None if self.proc.pid() is not None else "not running"


def test_running_stops_only_what_it_started(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Measured before: a block run beside services started by `lambdalake up` (or by another
    state folder's block) stopped them on leaving."""
    settings = Settings(state_dir=tmp_path / "state")
    before = _Sleeper(settings)
    assert before.start() is True  # as `lambdalake up` started it
    pid = before.proc.pid()
    monkeypatch.setattr(services, "select", lambda _settings, _only=None: [_Sleeper(settings)])
    try:
        with services.running(settings) as found:
            assert [s.name for s in found] == ["sleeper"]
        assert pid is not None and pid_alive(pid), "a service the block did not start was stopped"
    finally:
        before.stop()
    fresh = Settings(state_dir=tmp_path / "other")
    monkeypatch.setattr(services, "select", lambda _settings, _only=None: [_Sleeper(fresh)])
    with services.running(fresh) as found:
        started = found[0].proc.pid()
        assert started is not None
    assert not pid_alive(started), "a service the block started is stopped after it"


class _Failing(_Sleeper):
    """A stand-in node that exits at once, saying why."""

    name = "failing-2"
    marker = "lambdalake-test-failing"

    def argv(self) -> list[str]:
        return [sys.executable, "-c", "import sys; print('bind failed: address in use'); sys.exit(3)",
                "lambdalake-test-failing"]  # fmt: skip

    def probe(self) -> str | None:
        return "not listening"


def test_a_node_that_does_not_come_up_is_named_with_its_log_and_what_started_is_stopped(
    tmp_path: Path,
) -> None:
    """start_all (`lambdalake up`): a node that exits while starting fails the start at once (never a
    hang), naming the node, its log file and the log's last lines, and the nodes this start spawned
    are stopped; one that needs it is never launched."""
    settings = Settings(state_dir=tmp_path / "state")
    after_class = type("_After", (_Sleeper,), {"name": "sleeper-3"})
    first, failing, after = _Sleeper(settings), _Failing(settings), after_class(settings)
    after.needs = [failing]
    t0 = time.monotonic()
    with pytest.raises(LambdalakeError) as failed:
        services.start_all([first, failing, after])
    assert time.monotonic() - t0 < 30
    text = failed.value.message
    assert "failing-2" in text and str(failing.proc.log_file) in text and "address in use" in text, text
    assert first.proc.pid() is None, "the node this start spawned still runs"
    assert after.proc.pid() is None and not after.proc.log_file.exists(), (
        "a node whose need failed was started"
    )


class _Deaf(_Sleeper):
    """A stand-in node that runs but never answers (as one started with other settings)."""

    name = "deaf"
    start_timeout = 1.0

    def probe(self) -> str | None:
        return "connection refused"


def test_a_running_node_that_does_not_answer_is_named_with_the_fix(tmp_path: Path) -> None:
    """A node `lambdalake up` finds running but not answering (started with other settings, say) is
    neither started again nor waited for forever: the error names it, its pid and the fix; it is
    left running (this start did not spawn it)."""
    settings = Settings(state_dir=tmp_path / "state")
    deaf = _Deaf(settings)
    assert deaf.launch() is True  # as an earlier `lambdalake up` with other settings left it
    pid = deaf.proc.pid()
    try:
        with pytest.raises(LambdalakeError) as failed:
            services.start_all([_Deaf(settings)])
        text = failed.value.message
        assert f"deaf runs (pid {pid}) but does not answer on" in text and "connection refused" in text
        assert "other settings" in (failed.value.fix or "")
        assert pid is not None and pid_alive(pid)
    finally:
        deaf.stop()
