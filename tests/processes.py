"""The processes of the kill tests (tests/test_evaluate_resume.py, tests/test_corpus.py): a run's processes launched
with a token in their environment, every process carrying it killed at once (SIGKILL), nothing left running."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def kill_all() -> None:
    """SIGKILL to every process of this run (its environment holds the token), this one last."""
    mark = f"RELEVANCY_TEST_RUN={os.environ['RELEVANCY_TEST_RUN']}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if mark in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                    os.kill(int(entry), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
    os.kill(os.getpid(), signal.SIGKILL)


def environment(token: str, **extra: str) -> dict[str, str]:
    """The environment of a run's processes: one thread each, this checkout's source, the run's token."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "RELEVANCY_TEST_RUN": token, **extra,
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}


def alive(token: str) -> list[int]:
    """The processes whose environment holds the run's token."""
    mark = f"RELEVANCY_TEST_RUN={token}".encode()
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and mark in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.append(int(entry))
        except OSError:
            pass
    return found


def launch(commands: list[list[str]], log: Path, timeout: float, **extra: str) -> list[int]:
    """Run `commands` at once (the processes of one run, sharing a fresh token) to their end; their exit statuses.
    Past `timeout` every process of the run is killed and the test fails: nothing hangs."""
    token = uuid.uuid4().hex
    with open(log, "w") as output:
        processes = [subprocess.Popen(command, env=environment(token, **extra), stdout=output, stderr=subprocess.STDOUT,
                                      cwd=ROOT) for command in commands]
        try:
            deadline = time.monotonic() + timeout
            statuses = [process.wait(timeout=max(1.0, deadline - time.monotonic())) for process in processes]
        except subprocess.TimeoutExpired:
            statuses = None
        finally:
            for pid in alive(token):
                os.kill(pid, signal.SIGKILL)
            for process in processes:
                process.wait(timeout=30)
    assert statuses is not None, f"still running after {timeout} s: {log.read_text()[-3000:]}"
    for _ in range(100):  # a killed process's children are reaped by init, soon
        if not alive(token):
            break
        time.sleep(0.05)
    assert not alive(token), "processes of the run outlived it"
    return statuses


def free_port() -> int:
    """A TCP port free on localhost now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
