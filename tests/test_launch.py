"""launch.py: --device/--gpus to processes, the spawned ranks' environment, collected results, the
process group, and a progress line sent to a spawned process."""

from __future__ import annotations

import os
import pickle
import threading

import pytest
import torch

from dflash_pipeline import launch as L
from dflash_pipeline.errors import DFlashError
from dflash_pipeline.progress import LiveLine


def test_plan_processes(monkeypatch):
    monkeypatch.setattr(L, "visible_gpus", lambda: 0)
    assert L.plan_processes("auto", "all", None) == ("cpu", 1)
    assert L.plan_processes("cpu", "all", 3) == ("cpu", 3)
    with pytest.raises(DFlashError, match="no GPU is visible"):
        L.plan_processes("cuda", "all", None)
    monkeypatch.setattr(L, "visible_gpus", lambda: 4)
    assert L.plan_processes("auto", "all", None) == ("cuda", 4)
    assert L.plan_processes("cpu", "all", None) == ("cpu", 1)
    assert L.plan_processes("cuda", "2", None) == ("cuda", 2)
    assert L.plan_processes("auto", "all", None, gpus_per_process=2) == ("cuda", 2)
    with pytest.raises(DFlashError, match="--gpus 8: only 4 GPUs are visible"):
        L.plan_processes("auto", "8", None)
    with pytest.raises(DFlashError, match="--gpus-per-replica 3 does not divide the 4 GPUs"):
        L.plan_processes("auto", "all", None, gpus_per_process=3)


def test_launched_reads_the_launcher_environment(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert L.launched("auto") is None and L.local_world_size(3) == 3
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert L.launched("cpu") == L.Proc(5, 8, 1, "cpu")
    assert L.local_world_size(8) == 1   # a launcher that does not say: assume one process here
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert L.local_world_size(8) == 4
    assert L.process_gpus(L.Proc(5, 8, 1, "cuda"), 2) == [2, 3]


def test_one_process_runs_here_without_pickling():
    lock = threading.Lock()   # cannot be pickled: proves the entry ran in this process
    got = L.launch(_here, (lock,), nprocs=1, kind="cpu")
    assert got == [(L.Proc(0, 1, 0, "cpu"), os.getpid())]


def _here(proc, lock):
    with lock:
        return proc, os.getpid()


def _ranked(proc, line):
    import torch.distributed as dist

    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")}
    with L.process_group("gloo"):
        t = torch.tensor([proc.rank + 1.0])
        dist.all_reduce(t)
    return proc, env, float(t), dist.is_initialized(), (line.enabled, line.log_every)


def test_spawned_ranks_get_a_launcher_environment_and_a_group():
    got = L.launch(_ranked, (LiveLine(log_every=7.0),), nprocs=2, kind="cpu")
    assert [r[0] for r in got] == [L.Proc(0, 2, 0, "cpu"), L.Proc(1, 2, 1, "cpu")]
    for rank, (_, env, total, still_init, line) in enumerate(got):
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert total == 3.0          # the all-reduce ran over both ranks
        assert not still_init        # the group made for the block is ended with it
        assert line == (True, 7.0)   # the progress line arrives with its settings
    assert got[0][1]["MASTER_PORT"] == got[1][1]["MASTER_PORT"]


def test_progress_line_pickles_without_its_stream():
    line = pickle.loads(pickle.dumps(LiveLine(enabled=False, log_every=3.0)))
    assert not line.enabled and line.log_every == 3.0 and line.stream is not None


def _fails_on_rank_1(proc):
    if proc.rank == 1:
        raise DFlashError("a user's mistake, found by one rank")
    return proc.rank


def test_a_user_error_in_a_spawned_rank_is_raised_as_one():
    """A DFlashError in one spawned rank reaches the command as a DFlashError naming the rank (printed as one
    line), not as the rank's traceback inside a multiprocessing exception."""
    with pytest.raises(DFlashError, match=r"^rank 1: a user's mistake, found by one rank$"):
        L.launch(_fails_on_rank_1, (), nprocs=2, kind="cpu")
