"""The platform's long-running processes a deploy keeps running: each pipeline's speed job, the batch
scheduler and the serving API. Each is started (or restarted) when what it runs changed, recorded under
the state folder's ``deploy/``, and stopped by undeploy. Resources (topics, schemas, tables) are
:mod:`lambdalake.control.resources`'."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

from lambdalake.control.changes import Action, Change
from lambdalake.errors import LambdalakeError
from lambdalake.infra.process import ManagedProcess
from lambdalake.pipeline import Pipeline
from lambdalake.settings import PROJECT_ROOT, Settings

#: The process that runs every deployed pipeline's batch on its schedule.
SCHEDULER = "batch-schedule"
#: The serving API's process (``lambdalake serve``).
SERVING = "serving-api"


def speed_process(settings: Settings, pipeline: str) -> ManagedProcess:
    return ManagedProcess(
        name=f"speed-{pipeline}", run_dir=settings.state_dir / "run", log_dir=settings.state_dir / "logs",
        marker=f"speed run {pipeline}", term_group=False,
    )  # fmt: skip


def scheduler_process(settings: Settings) -> ManagedProcess:
    return ManagedProcess(
        name=SCHEDULER, run_dir=settings.state_dir / "run", log_dir=settings.state_dir / "logs",
        marker="batch schedule",
    )  # fmt: skip


def serving_process(settings: Settings) -> ManagedProcess:
    return ManagedProcess(
        name=SERVING, run_dir=settings.state_dir / "run", log_dir=settings.state_dir / "logs",
        marker="lambdalake serve",
    )  # fmt: skip


def record_file(settings: Settings, name: str) -> Path:
    return settings.state_dir / "deploy" / f"{name}.json"


def fingerprint(settings: Settings, pipeline: Pipeline) -> str:
    """What a pipeline's job runs: its files and the settings (a change restarts the job)."""
    digest = hashlib.sha256()
    files = [
        settings.pipelines_dir / f"{pipeline.name}.toml",
        *settings.pipelines_dir.glob(f"{pipeline.name}.*.json"),
    ]
    files += [settings.schemas_dir / v for v in pipeline.schema_.versions]
    for path in sorted(files):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    # The view versions it computes (a build adds one, a switch retires one): by internal name.
    digest.update(json.dumps([v.name for v in pipeline.views]).encode())
    digest.update(json.dumps(settings.to_env(), sort_keys=True).encode())
    return digest.hexdigest()[:16]


class Processes:
    """Keeps the platform's processes running what ``settings`` and the pipeline files say.

    Args:
        settings: The platform's settings (each process gets them as its environment).
        settle_s: Seconds a started process must keep running to count as started (default 5).
    """

    def __init__(self, settings: Settings, *, settle_s: float = 5.0) -> None:
        self.settings = settings
        self.settle_s = settle_s

    def ensure_speed_job(self, p: Pipeline) -> Change:
        proc = speed_process(self.settings, p.name)
        wanted = fingerprint(self.settings, p)
        return self._ensure(
            proc, f"speed job {p.name}", wanted,
            # A predecessor stopped by SIGKILL (it did not stop in time) holds its lease until the
            # TTL ends: the new job waits that long for it.
            [sys.executable, "-m", "lambdalake", "speed", "run", p.name,
             "--lease-wait", str(self.settings.cassandra.lease_ttl_s + 5)],
        )  # fmt: skip

    def ensure_scheduler(self) -> Change:
        """One scheduler for every pipeline deployed so far (its list is the deploy records')."""
        deployed = deployed_pipelines(self.settings)
        wanted = hashlib.sha256(json.dumps([deployed, self.settings.to_env()], sort_keys=True).encode())
        argv = [sys.executable, "-m", "lambdalake", "batch", "schedule"]
        for name in deployed:
            argv += ["--pipeline", name]
        return self._ensure(
            scheduler_process(self.settings), "batch scheduler", wanted.hexdigest()[:16], argv
        )

    def ensure_serving(self) -> Change:
        """The HTTP API over every pipeline (it reads the definitions at start: restarted on changes)."""
        digest = hashlib.sha256(json.dumps([deployed_pipelines(self.settings), self.settings.to_env(),
                                            [fingerprint(self.settings, p) for p in self._deployed()]],
                                           sort_keys=True).encode())  # fmt: skip
        what = f"serving API {self.settings.serving.scheme}://{self.settings.serving.host}:{self.settings.serving.port}"
        argv = [sys.executable, "-m", "lambdalake", "serve"]
        return self._ensure(serving_process(self.settings), what, digest.hexdigest()[:16], argv)

    def _deployed(self) -> list[Pipeline]:
        from lambdalake.pipeline import configured_pipeline

        return [configured_pipeline(name, self.settings) for name in deployed_pipelines(self.settings)]

    def _ensure(self, proc: ManagedProcess, what: str, wanted: str, argv: list[str]) -> Change:
        record = record_file(self.settings, proc.name.removeprefix("speed-"))
        previous = json.loads(record.read_text()) if record.exists() else {}
        pid = proc.pid()
        if pid is not None and previous.get("fingerprint") == wanted:
            return Change(what, "unchanged", f"pid {pid}, log {proc.log_file}")
        action: Action = "started"
        if pid is not None:
            proc.stop(timeout=90)
            action = "restarted"
        new_pid = proc.spawn(argv, env=self.settings.to_env(), cwd=PROJECT_ROOT)
        # A job that cannot start (settings, a broken definition, services down) exits within
        # seconds; one that survived this long runs, and its log says the rest.
        deadline = time.monotonic() + self.settle_s
        while time.monotonic() < deadline and proc.pid() is not None:
            time.sleep(0.25)
        if proc.pid() is None:
            raise LambdalakeError(
                f"{what} exited right after starting. Last lines of {proc.log_file}:\n{proc.log_tail()}",
                fix=f"read {proc.log_file}",
            )
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps({"fingerprint": wanted, "pid": new_pid, "argv": argv}))
        return Change(what, action, f"pid {new_pid}, log {proc.log_file}")


def deployed_pipelines(settings: Settings) -> list[str]:
    """Pipelines whose speed jobs deploy started (and undeploy has not stopped)."""
    folder = settings.state_dir / "deploy"
    return sorted(p.stem for p in folder.glob("*.json") if p.stem not in (SCHEDULER, SERVING))


def undeploy(settings: Settings, pipelines: list[str]) -> list[Change]:
    """Stop the speed jobs of ``pipelines`` (SIGTERM: they finish the micro-batch in flight) and the
    scheduler when no deployed pipeline is left (else restart it without them). Data is kept."""
    changes = []
    for name in pipelines:
        record = record_file(settings, name)
        stopped = speed_process(settings, name).stop(timeout=120)
        record.unlink(missing_ok=True)
        changes.append(Change(f"speed job {name}", "stopped" if stopped else "unchanged"))
    remaining = deployed_pipelines(settings)
    scheduler = scheduler_process(settings)
    serving = serving_process(settings)
    if not remaining:
        for proc, what in ((scheduler, "batch scheduler"), (serving, "serving API")):
            if proc.stop(timeout=60):
                changes.append(Change(what, "stopped"))
            record_file(settings, proc.name).unlink(missing_ok=True)
    else:
        if scheduler.pid() is not None:
            changes.append(Processes(settings).ensure_scheduler())
        if serving.pid() is not None:
            changes.append(Processes(settings).ensure_serving())
    return changes
