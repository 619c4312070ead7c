"""bench/quality_gpu.sh's detached start: the call returns while the parts run on; `stop` ends them."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _stand_in(tmp_path: Path, body: str) -> tuple[Path, dict]:
    """(KEEP folder, environment) for the script with the target assembled already (nothing to carry) and a
    stand-in for python that runs `body` (sh) as the parts' `bench/quality.py`; `wait` gives up after 1 s."""
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "smollm2.gguf").write_bytes(b"a target")
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\n{body}\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    env.update(KEEP=str(keep), PYTHON=str(fake), WAIT="1")
    return keep, env


def _gone(pid: int) -> bool:
    """Whether `pid` has ended (a zombie not yet reaped counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(sys.platform != "linux", reason="setsid and the script's shell tools")
def test_start_returns_while_the_detached_parts_run_even_through_a_pipe(tmp_path):
    # A stand-in for python: the parts' `bench/quality.py` runs for 30 s, so a call that waits for them (or for
    # a process still holding its stdout) takes 30 s; `start` with WAIT=1 must come back in a few.
    marker = tmp_path / "parts-ran"
    keep, env = _stand_in(tmp_path, f"touch {marker}\nsleep 30")
    t0 = time.monotonic()
    # `| cat`: the pipe's reader ends only once every process holding the pipe has closed it
    out = subprocess.run(["bash", "-c", "bash bench/quality_gpu.sh start recipes | cat"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    try:
        assert "started detached: recipes" in out.stdout, out.stdout + out.stderr
        assert "detached parts still running" in out.stdout, out.stdout
        assert took < 20, f"start held the call for {took:.0f} s"
        deadline = time.monotonic() + 10
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert marker.exists(), "the detached parts never ran"
    finally:  # read here, not before the asserts: the detached run writes its pid once it has started
        pid_file = keep / "detached.pid"
        if pid_file.exists():
            subprocess.run(["pkill", "-TERM", "-s", pid_file.read_text().strip()], check=False)


@pytest.mark.skipif(sys.platform != "linux", reason="setsid and the script's shell tools")
def test_stop_ends_the_detached_parts_so_that_start_runs_again(tmp_path):
    # The stand-in starts a job in a session of its own, as bench/quality_jobs.py starts each training: `stop`
    # must end it too, not only the detached session (a training left running holds the GPU's memory).
    runs, jobs = tmp_path / "runs", tmp_path / "jobs"
    keep, env = _stand_in(tmp_path, f"setsid sleep 60 &\necho $! >> {jobs}\necho run >> {runs}\nsleep 60")

    def script(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "bench/quality_gpu.sh", *args], cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=90)

    def wait_for_runs(n: int) -> None:
        deadline = time.monotonic() + 10
        while (not runs.exists() or len(runs.read_text().split()) < n) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert runs.exists() and len(runs.read_text().split()) == n

    try:
        assert "started detached" in script("start", "recipes").stdout
        wait_for_runs(1)
        assert "already running" in script("start", "recipes").stdout  # refused while they run
        sid = (keep / "detached.pid").read_text().strip()
        job = int(jobs.read_text().split()[0])
        assert os.getsid(job) != int(sid)  # the job runs in a session of its own
        t0 = time.monotonic()
        out = script("stop")
        assert "stopped the detached parts" in out.stdout, out.stdout + out.stderr
        assert time.monotonic() - t0 < 20
        assert subprocess.run(["pgrep", "-s", sid], capture_output=True).returncode == 1  # nothing left
        assert _gone(job), "stop left the job's own session running"
        assert "no detached parts running" in script("stop").stdout
        assert "started detached" in script("start", "recipes").stdout  # and may start again
        wait_for_runs(2)
    finally:
        pid_file = keep / "detached.pid"
        if pid_file.exists():
            subprocess.run(["pkill", "-TERM", "-s", pid_file.read_text().strip()], check=False)
