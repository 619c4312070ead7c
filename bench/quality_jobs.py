"""A small job runner for `bench/quality.py`: the CLI commands of a part, some at once, within a deadline.

Why it exists: a part is many `dflash train` / `dflash eval` runs, and the GPU machine gives a call at
most 10 minutes. On one H200, a SmolLM2-sized drafter's training step and `dflash eval` leave the GPU
mostly idle (host-bound), so several run side by side in separate processes; each job is exactly the
command a user types. Jobs have dependencies (an eval waits for its drafter), a pool per kind (how many
trainings, how many evals at once) and may be `exclusive` (alone on the machine, for timings).

At the deadline, running jobs get SIGTERM (`dflash train` checkpoints on it; the part resumes it next
time), then SIGKILL after a grace period; jobs not started are reported as such. A job whose `done`
check passes is skipped, so re-running a part continues where it stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

OK, SKIPPED, FAILED, STOPPED, NOT_STARTED, BLOCKED = "ok", "done before", "failed", "stopped at deadline", \
    "not started (deadline)", "blocked (a dependency did not finish)"
UNFINISHED = "ended unfinished"  # exit 0 while its `done` check fails: e.g. `dflash train` stopped by a signal
WAITING, RUNNING = "", "running"
_ENDED_BADLY = (FAILED, STOPPED, NOT_STARTED, BLOCKED, UNFINISHED)


@dataclass
class Job:
    name: str
    cmd: Sequence[str] | Callable[[], Sequence[str]]  # a callable is built when the job starts
    kind: str = "train"
    after: tuple[str, ...] = ()         # must have succeeded (or been done before)
    wait_for: tuple[str, ...] = ()      # must have ended, whatever their outcome
    exclusive: bool = False            # runs with nothing else running
    log: Path | None = None            # stdout + stderr (stderr only when `stdout` is given)
    stdout: Path | None = None         # stdout alone to this file (e.g. `dflash eval --json`)
    done: Callable[[], bool] | None = None
    finish: Callable[[int], None] | None = None  # called with the exit code when the process ends
    ok_codes: tuple[int, ...] = (0,)
    min_time_left: float = 60.0        # not started when less is left before the deadline
    status: str = ""
    rc: int | None = None
    seconds: float = 0.0
    proc: Any = field(default=None, repr=False)
    t0: float = 0.0
    files: list = field(default_factory=list, repr=False)


def _start(job: Job, env: dict[str, str]) -> None:
    cmd = list(job.cmd() if callable(job.cmd) else job.cmd)
    if job.log is not None:
        job.log.parent.mkdir(parents=True, exist_ok=True)
        log = open(job.log, "a", encoding="utf-8")
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        job.files.append(log)
    else:
        log = None
    out = log
    if job.stdout is not None:
        job.stdout.parent.mkdir(parents=True, exist_ok=True)
        out = open(job.stdout, "w", encoding="utf-8")
        job.files.append(out)
    job.t0, job.status = time.time(), RUNNING
    # A session of its own: at the deadline the whole job (its loader workers too) can be ended.
    err = log if log is not None else (subprocess.DEVNULL if out is not None else None)
    job.proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)


def _close(job: Job) -> None:
    for f in job.files:
        f.close()
    job.files.clear()


def run_jobs(jobs: list[Job], limits: dict[str, int], *, deadline: float | None = None, env: dict[str, str] | None = None,
             say: Callable[[str], None] = print, grace: float = 60.0, poll: float = 0.5) -> dict[str, dict[str, Any]]:
    """Run `jobs` (in list order as they become ready); {name: {status, rc, seconds}}."""
    env = dict(env or os.environ)
    names = {j.name for j in jobs}
    for j in jobs:
        unknown = [a for a in (*j.after, *j.wait_for) if a not in names]
        if unknown:
            raise ValueError(f"job {j.name} waits for unknown jobs {unknown}")
        if j.done is not None and j.done():
            j.status = SKIPPED
    by_name = {j.name: j for j in jobs}
    running: list[Job] = []
    stopping = False
    while True:
        now = time.time()
        for j in list(running):
            rc = j.proc.poll()
            if rc is None:
                continue
            running.remove(j)
            j.rc, j.seconds = rc, time.time() - j.t0
            _close(j)
            if j.finish is not None:
                try:
                    j.finish(rc)
                except Exception as e:  # a bookkeeping error must not end the other jobs
                    say(f"[{j.name}] after the job: {e!r}")
            if j.status != STOPPED:
                j.status = OK if rc in j.ok_codes else FAILED
                # `dflash train` checkpoints on SIGTERM and exits 0 (resumable): signalled from outside the
                # runner, its evals must not start on a drafter that was never exported (2026-12-07)
                if j.status == OK and j.done is not None and not j.done():
                    j.status = UNFINISHED
            say(f"[{j.name}] {j.status} (rc {rc}) in {j.seconds:.0f}s")
        for j in jobs:
            if j.status == WAITING and any(by_name[a].status in _ENDED_BADLY for a in j.after):
                j.status = BLOCKED
        if deadline is not None and now >= deadline and running and not stopping:
            stopping = True
            say(f"deadline: stopping {', '.join(j.name for j in running)}")
            for j in running:
                j.status = STOPPED
                j.proc.send_signal(signal.SIGTERM)  # the main process only: it winds its workers down
            kill_at = now + grace
        if stopping and running and time.time() >= kill_at:
            for j in running:
                try:
                    os.killpg(j.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        pending = [j for j in jobs if j.status == WAITING]
        if not running and (not pending or stopping):
            break
        if not stopping:
            _start_ready(pending, running, by_name, limits, deadline, env, say)
        if not running and pending and not stopping:
            # Nothing runs and nothing could start: the deadline is too close for what is left.
            for j in pending:
                j.status = NOT_STARTED
            break
        time.sleep(poll)
    for j in jobs:
        if j.status == WAITING:
            j.status = NOT_STARTED
    return {j.name: {"status": j.status, "rc": j.rc, "seconds": round(j.seconds, 1)} for j in jobs}


def _start_ready(pending: list[Job], running: list[Job], by_name: dict[str, Job], limits: dict[str, int],
                 deadline: float | None, env: dict[str, str], say) -> None:
    if any(j.exclusive for j in running):
        return
    for j in pending:
        if any(by_name[a].status not in (OK, SKIPPED) for a in j.after):
            continue
        if any(by_name[a].status in (WAITING, RUNNING) for a in j.wait_for):
            continue
        if deadline is not None and deadline - time.time() < j.min_time_left:
            continue
        if j.exclusive:
            if not running:
                say(f"[{j.name}] starting (alone)")
                _start(j, env)
                running.append(j)
            return  # an exclusive job that is ready holds back everything after it
        if sum(r.kind == j.kind for r in running) >= limits.get(j.kind, 1):
            continue
        say(f"[{j.name}] starting")
        _start(j, env)
        running.append(j)
