"""The command line as a user runs it: a separate process, configured by environment variables."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lambdalake.settings import Settings
from tests.conftest import env_for, pipeline_named, run_cli, settings_for
from tests.helpers import REFERENCE_VALID, kcat_count


def test_help_lists_commands() -> None:
    result = run_cli(Settings(), "--help")
    assert result.returncode == 0
    for command in ("up", "down", "status", "produce", "topics", "schemas"):
        assert command in result.stdout.decode()


def test_stopped_broker_gives_an_error_naming_the_fix(tmp_path) -> None:
    # Nothing listens on these ports: the CLI must fail fast and say how to fix it.
    stopped = settings_for(tmp_path, {"broker": 1, "registry": 2, "cassandra": 3, "storage": 4})
    t0 = time.monotonic()
    result = run_cli(stopped, "produce", "offers", "--generate", "10", timeout=60)
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert "cannot reach Kafka at 127.0.0.1:1" in err
    assert "lambdalake up" in err and "LAMBDALAKE_KAFKA__BOOTSTRAP_SERVERS" in err
    assert "Traceback" not in err
    assert time.monotonic() - t0 < 30


def test_status_names_each_kind_it_cannot_read_pipelines_from_and_its_fix(tmp_path) -> None:
    # Nothing answers: the embedded Cassandra is started by `up`, the external broker is not.
    stopped = settings_for(tmp_path, {"broker": 1, "registry": 2, "cassandra": 3, "storage": 4})
    external = stopped.model_copy(
        update={"kafka": stopped.kafka.model_copy(update={"bootstrap_servers": "192.0.2.1:1"})}
    )
    result = run_cli(external, "status", "--json", timeout=60)
    shown = json.loads(result.stdout)
    assert result.returncode == 1 and shown["pipelines"] == [], shown
    assert shown["pipelines_unavailable"] == (
        "pipelines not read: no broker node answers (check that it runs at the settings' address); "
        "no cassandra node answers (start it: `lambdalake up`)"
    ), shown
    text = run_cli(external, "status", timeout=60).stdout.decode()
    assert "no broker node answers" in text and "Traceback" not in text, text


@pytest.mark.parametrize("command", [("speed", "run", "offers"), ("batch", "schedule", "--once")])
def test_a_job_with_cassandra_stopped_is_one_error_naming_the_fix_without_a_trace(
    tmp_path: Path, command: tuple[str, ...]
) -> None:
    """The long-running commands log the Cassandra driver's lines, one line each: its failed
    connection comes with a traceback, which the user must not see, only the command's own error."""
    stopped = settings_for(tmp_path, {"broker": 1, "registry": 2, "cassandra": 3, "storage": 4})
    result = run_cli(stopped, *command, timeout=120)
    text = (result.stdout + result.stderr).decode()
    assert "cannot reach Cassandra" in " ".join(text.split()), text[-2000:]
    assert "lambdalake up" in text and "Traceback" not in text and 'File "' not in text, text[-3000:]
    # speed run stops at the error (2); the schedule runs what is due and exits 1 when a run failed.
    assert result.returncode == (2 if command[0] == "speed" else 1), text[-2000:]


def test_either_file_or_generate() -> None:
    result = run_cli(Settings(), "produce", "offers")
    assert result.returncode == 2 and "exactly one of --file or --generate" in result.stderr.decode()


def test_speed_run_names_the_log_levels_it_takes() -> None:
    result = run_cli(Settings(), "speed", "run", "telemetry", "--log-level", "LOUD")
    err = result.stderr.decode()
    assert result.returncode == 2 and "'LOUD' is not one of" in err and "debug" in err


def test_unknown_pipeline() -> None:
    result = run_cli(Settings(), "topics", "nope")
    assert result.returncode == 2 and "offers" in result.stderr.decode()


@pytest.mark.services
@pytest.mark.slow
def test_produce_100k_offers_counted_by_kcat(services: Settings, tmp_path) -> None:
    saved = tmp_path / "offers.jsonl"
    result = run_cli(
        services, "produce", "offers", "--generate", "100000", "--seed", "11", "--save", str(saved)
    )
    assert result.returncode == 0, result.stderr.decode()
    records = [json.loads(line) for line in saved.read_text().splitlines()]
    assert len(records) == 100_000
    now_ms = int(time.time() * 1000)
    valid = sum(REFERENCE_VALID["offers"](r, now_ms) for r in records)
    pipeline = pipeline_named(services, "offers")
    assert kcat_count(services, pipeline.topic.name) == valid
    assert kcat_count(services, pipeline.topic.dlq) == len(records) - valid
    assert 0 < len(records) - valid < 5000
    assert f"{valid:,}" in result.stderr.decode()  # the summary reports what was sent


@pytest.mark.services
def test_produce_from_stdin(services: Settings, unique: str) -> None:
    lines = (
        b'{"vehicle_id": "v-1", "event_time": 1700000000000, "speed_kmh": 50.0, "heading_deg": 90.0,'
        b' "latitude": 1.0, "longitude": 2.0, "engine_state": "running", "odometer_km": 10.0}\n'
        b'{"vehicle_id": "v-1", "speed_kmh": -3}\n'
    )
    result = run_cli(services, "produce", "telemetry", "--file", "-", input=lines)
    assert result.returncode == 0, result.stderr.decode()
    assert "rejected by" in result.stderr.decode()


def _gone(pid: int, wait: float = 10.0) -> bool:
    """Whether the process has exited (a zombie not yet reaped by init counts as exited)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_up_status_down_cycle(tmp_path) -> None:
    """A second, independent set of services on other ports: up, status, idempotent up, down by PID."""
    own = settings_for(tmp_path, {"broker": 29092, "registry": 28081, "cassandra": 29042, "storage": 27000})
    try:
        assert run_cli(own, "up").returncode == 0
        status = run_cli(own, "status", "--json")
        assert status.returncode == 0, status.stderr.decode()
        services = json.loads(status.stdout)["services"]
        assert [s["name"] for s in services] == ["broker", "registry", "cassandra"]
        assert all(s["healthy"] and s["pid"] for s in services), services
        again = run_cli(own, "up")
        assert again.returncode == 0 and again.stderr.decode().count("already running") == 3
        pids = [s["pid"] for s in services]
    finally:
        down = run_cli(own, "down")
    assert down.returncode == 0, down.stderr.decode()
    for pid in pids:
        assert _gone(pid), f"process {pid} still runs after `lambdalake down`"
    after = run_cli(own, "status", "--json")
    assert after.returncode == 1
    assert not any(s["healthy"] for s in json.loads(after.stdout)["services"])


@pytest.mark.slow
def test_up_refuses_a_port_taken_by_someone_else(tmp_path) -> None:
    import socket

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    own = settings_for(tmp_path, {"broker": port, "registry": 1, "cassandra": 1, "storage": 1})
    try:
        result = run_cli(own, "up", "--only", "broker")
    finally:
        sock.close()
    err = result.stderr.decode()
    assert result.returncode == 2 and f"127.0.0.1:{port} is already in use" in err
    assert "LAMBDALAKE_KAFKA__BOOTSTRAP_SERVERS" in err


@pytest.mark.slow
def test_up_names_a_service_that_exits_while_starting_with_its_log(tmp_path) -> None:
    own = settings_for(tmp_path, {"broker": 29392, "registry": 1, "cassandra": 1, "storage": 1})
    own = own.model_copy(update={"kafka": own.kafka.model_copy(update={"heap": "lots"})})
    result = run_cli(own, "up", "--only", "broker", timeout=180)
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert "broker on 127.0.0.1:" in err and "exited while starting" in err, err
    assert str(tmp_path / "logs" / "broker.log") in err, err
    assert "Invalid initial heap size: -Xmslots" in err, err  # the JVM's own reason, from the log's tail
    assert "Traceback" not in err


def test_up_without_java_says_so(tmp_path) -> None:
    own = settings_for(tmp_path, {"broker": 29392, "registry": 1, "cassandra": 1, "storage": 1})
    env = {**env_for(own), "PATH": str(Path(sys.executable).parent), "JAVA_HOME": str(tmp_path / "nojava")}
    result = subprocess.run(
        [sys.executable, "-m", "lambdalake", "up", "--only", "broker"],
        env=env,
        capture_output=True,
        timeout=120,
    )
    err = result.stderr.decode()
    assert result.returncode == 2 and "no `java` was found" in err and "openjdk-17" in err, err
    assert "Traceback" not in err


def test_config_masks_secrets(tmp_path) -> None:
    settings = settings_for(tmp_path).model_copy(
        update={"kafka": Settings().kafka.model_copy(update={"sasl_password": "hunter2-secret"})}
    )
    result = run_cli(settings, "config")
    assert result.returncode == 0, result.stderr.decode()
    text = result.stdout.decode()
    assert "hunter2-secret" not in text and "**********" in text
    assert settings.kafka.bootstrap_servers in text
