"""Ctrl+C on `attnkit serve` exits 130, without a traceback, wherever it lands.

The command line's policy (docs/conventions.md): Ctrl+C exits 130, as a shell reports
it, and prints no traceback. A server has many places for a signal to land: Python
importing the commands, uvicorn starting, idle, inside a request, right after one, and
a second Ctrl+C during the graceful shutdown. Each run below starts a real
`python -m attnkit serve` and sends SIGINT at one of those points; fifty in a row.
"""

from __future__ import annotations

import http.client
import json
import random
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

POINTS = ("loading", "listening", "in a request", "after a request", "twice")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _read_until(stream, marker: bytes, seen: list[bytes]) -> None:
    """Read `stream` (unbuffered) line by line into `seen` until a line holds `marker`."""
    while True:
        line = stream.readline()
        seen.append(line)
        if not line or marker in line:
            return


def _wait_listening(port: int, process: subprocess.Popen) -> None:
    while process.poll() is None:
        with socket.socket() as client:
            if client.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)


def _post(port: int, text: str) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        body = json.dumps({"text": text, "model": "random"})
        connection.request("POST", "/api/attention", body, {"Content-Type": "application/json"})
        return connection.getresponse().status
    except OSError:  # the server went away mid-request: what Ctrl+C does
        return -1
    finally:
        connection.close()


def _interrupt_at(point: int, rng: random.Random) -> tuple[int | None, bytes]:
    """Start `attnkit serve`, send SIGINT at `point`, and return (exit code, stderr)."""
    port = _free_port()
    # -X importtime: Python writes a line as each module finishes importing, so the
    # "loading" point can wait for attnkit itself (past the interpreter's own start,
    # which no program can guard) and then land anywhere in the commands' imports.
    process = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "attnkit", "serve", "--port", str(port), "-m", "random",
         "--no-access-log"],  # the access log is not what this test reads
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, bufsize=0,
    )
    seen: list[bytes] = []
    try:
        if point == "loading":
            _read_until(process.stderr, b"| attnkit\n", seen)
            time.sleep(rng.uniform(0.0, 0.6))
        else:
            assert process.stdout.readline().startswith(b"attnkit: open http://127.0.0.1:")
            _wait_listening(port, process)
            if point == "in a request":
                request = threading.Thread(target=_post, args=(port, " ".join(["word"] * 400)))
                request.start()
                time.sleep(rng.uniform(0.0, 0.05))
            elif point == "after a request":
                assert _post(port, "the cat sat on the mat") == 200
            elif point == "twice":
                process.send_signal(signal.SIGINT)
                time.sleep(rng.uniform(0.0, 0.05))
        process.send_signal(signal.SIGINT)
        _, errors = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    if point == "in a request":
        request.join(timeout=60)
    return process.returncode, b"".join(seen) + errors


@pytest.mark.slow
def test_ctrl_c_exits_130_without_a_traceback_wherever_it_lands():
    rng = random.Random(0)
    for run in range(50):
        point = POINTS[run % len(POINTS)]
        code, errors = _interrupt_at(point, rng)
        problems = [line for line in errors.decode(errors="replace").splitlines() if "import time:" not in line]
        assert (code, problems) == (130, []), f"run {run}, SIGINT {point}: exit {code}\n" + "\n".join(problems)
