"""Start, find and stop a background service process by its PID file."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from lambdalake.errors import LambdalakeError
from lambdalake.procs import pid_alive


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
        return True
    return False


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


#: Processes this Python process started, by PID file: their exit is known for sure (and reaped).
_SPAWNED: dict[str, subprocess.Popen] = {}


@dataclass(frozen=True)
class ManagedProcess:
    """A background process owned through ``<run_dir>/<name>.pid``.

    Args:
        name: Service name, used for the PID and log file names.
        run_dir: Folder of PID files.
        log_dir: Folder of log files.
        marker: A string the process's command line contains; guards against a recycled PID.
        term_group: Send the stop signal to the whole process group (default True); False sends
            it to the process alone, which stops its children itself (a Spark driver: a signal to
            its JVM and Python workers too would stop them under it). A process that outlives the
            timeout is killed with its group either way.
    """

    name: str
    run_dir: Path
    log_dir: Path
    marker: str
    term_group: bool = True

    @property
    def pid_file(self) -> Path:
        return self.run_dir / f"{self.name}.pid"

    @property
    def log_file(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def pid(self) -> int | None:
        """The PID of our running process, or None. Only reads: a stale PID file stays until a stop
        or the next start replaces it (deleting it here could delete the file a start is writing)."""
        pid = None
        with contextlib.suppress(OSError, ValueError):
            pid = int(self.pid_file.read_text().strip())
        # An unreadable command line (a race with the process starting) is not evidence of a
        # recycled PID; only a readable one without our marker is.
        if pid is not None and pid_alive(pid) and (not (cmdline := _cmdline(pid)) or self.marker in cmdline):
            return pid
        return None

    def spawn(
        self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Path | None = None
    ) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_file, "ab") as log:
            log.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting: {' '.join(argv)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                cwd=cwd,
                start_new_session=True,  # survives the CLI and is not hit by its Ctrl-C
            )
        # Written whole under another name, then renamed: a reader sees no file or the whole PID.
        partial = self.pid_file.with_name(f"{self.pid_file.name}.{os.getpid()}.tmp")
        partial.write_text(str(proc.pid))
        os.replace(partial, self.pid_file)
        _SPAWNED[str(self.pid_file)] = proc
        return proc.pid

    def exited(self) -> bool:
        """Whether the process this Python process spawned has exited (False if it spawned none)."""
        child = _SPAWNED.get(str(self.pid_file))
        return child is not None and child.poll() is not None and self.pid() is None

    def wait_until(self, check: Callable[[], bool], *, timeout: float, what: str) -> None:
        """Poll ``check`` until it holds; fail with the log's tail if the process dies or time runs out."""
        deadline = time.monotonic() + timeout
        gone_since: float | None = None
        child = _SPAWNED.get(str(self.pid_file))
        while time.monotonic() < deadline:
            # Gone means: the process we spawned has exited (not merely a PID-file glitch) and no PID
            # on record runs, for a moment (a process started by another CLI has no child here).
            spawned_alive = child is not None and child.poll() is None
            gone = not spawned_alive and self.pid() is None
            gone_since = (gone_since or time.monotonic()) if gone else None
            if gone_since is not None and time.monotonic() - gone_since > 3.0:
                raise LambdalakeError(
                    f"{self.name} exited while starting. Last lines of {self.log_file}:\n{self.log_tail()}",
                    fix=f"read {self.log_file}; `lambdalake down` then `lambdalake up` retries",
                )
            if check():
                return
            time.sleep(0.25)
        raise LambdalakeError(
            f"{self.name} did not become {what} within {timeout:.0f}s. Last lines of {self.log_file}:\n"
            f"{self.log_tail()}",
            fix=f"read {self.log_file}; the machine may be overloaded, retry `lambdalake up`",
        )

    def stop(self, *, sig: int = signal.SIGTERM, timeout: float = 60.0, kill_timeout: float = 30.0) -> bool:
        """Signal the process group and wait; SIGKILL after ``timeout``. Returns whether it was running.

        Raises:
            LambdalakeError: The process outlived SIGKILL by ``kill_timeout`` seconds (stuck in the
                kernel, e.g. on a hung disk): the PID file is kept, naming it.
        """
        pid = self.pid()
        if pid is None:
            return False
        with contextlib.suppress(ProcessLookupError):
            (os.killpg if self.term_group else os.kill)(pid, sig)
        deadline = time.monotonic() + timeout
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            while pid_alive(pid):
                if time.monotonic() - killed_at > kill_timeout:
                    raise LambdalakeError(
                        f"{self.name} (pid {pid}) still runs {kill_timeout:.0f} s after SIGKILL",
                        fix=f"see `ps -o pid,stat,wchan -p {pid}` (a process in state D waits on the "
                        "kernel); once it is gone, `lambdalake down` again",
                    )
                time.sleep(0.05)
        child = _SPAWNED.pop(str(self.pid_file), None)
        if child is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(1)  # reaped: no zombie left behind
        self.pid_file.unlink(missing_ok=True)
        return True

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
