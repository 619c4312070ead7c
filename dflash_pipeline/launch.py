"""Processes and devices: one process per GPU, started here or by a launcher, for every command.

`dflash extract` and `dflash train` (and every later multi-GPU command) run the same way:
- under `torchrun` / `accelerate launch` the environment names this process's rank (`launched`);
- otherwise `plan_processes` turns `--device` / `--gpus` into a device kind and a process count, and
  `launch` runs the entry function here (one process) or spawns one process per GPU (or per group of
  GPUs) with the environment a launcher would give them, and returns every rank's return value.
Inside a process, `bind_device` picks its GPU (or its share of the CPU cores), `process_group`
creates the collective group unless a launcher already did, and `stop_signals` turns SIGTERM /
SIGINT into a request to stop (a long run then ends its step and checkpoints).

Work is divided by what a rank is given (segments, rows), never by which machine it runs on, so a
restart with another number of processes is only another `world`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from dataclasses import dataclass
from typing import Any, Callable

import torch

from dflash_pipeline.errors import DFlashError


@dataclass(frozen=True)
class Proc:
    """This process's place in a run: its rank among `world`, its rank on this node, cpu or cuda."""

    rank: int
    world: int
    local_rank: int
    kind: str  # "cpu" | "cuda"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def env_rank() -> tuple[int, int, int] | None:
    """(rank, world, local_rank) when started by torchrun / accelerate launch, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0))
    return None


def launched(device: str) -> Proc | None:
    """This process as a launcher started it (its ranks from the environment), else None."""
    ranks = env_rank()
    if ranks is None:
        return None
    return Proc(*ranks, kind="cpu" if (device == "cpu" or visible_gpus() == 0) else "cuda")


def local_world_size(world: int) -> int:
    """Processes of this run on this node: the launcher's count, else all `world` (we spawned them)."""
    default = world if env_rank() is None else 1
    return int(os.environ.get("LOCAL_WORLD_SIZE", default))


def plan_processes(device: str, gpus: str, num_procs: int | None, gpus_per_process: int = 1) -> tuple[str, int]:
    """(device kind, processes) for a run started without a launcher, from --device and --gpus.

    On the CPU, `num_procs` processes (tests of the multi-process path); on GPUs, one process per
    `gpus_per_process` of the GPUs asked for. Asking for more GPUs than are visible is a user error.
    """
    visible = visible_gpus()
    if device == "cpu" or (device == "auto" and visible == 0):
        return "cpu", num_procs or 1
    if visible == 0:
        raise DFlashError("--device cuda asked for, but no GPU is visible")
    use = visible if gpus == "all" else int(gpus)
    if use > visible:
        raise DFlashError(f"--gpus {use}: only {visible} GPUs are visible")
    if use % gpus_per_process:
        raise DFlashError(f"--gpus-per-replica {gpus_per_process} does not divide the {use} GPUs used")
    return "cuda", use // gpus_per_process


def resolve_device(device: str = "auto") -> torch.device:
    """One process's device from --device: "auto" is CUDA where a GPU is visible, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def process_gpus(proc: Proc, gpus_per_process: int = 1) -> list[int]:
    """The GPUs of this process on its node: consecutive, `gpus_per_process` of them."""
    first = proc.local_rank * gpus_per_process
    return list(range(first, first + gpus_per_process))


def bind_device(proc: Proc, gpus_per_process: int = 1) -> torch.device:
    """Make this process's (first) GPU current, or on the CPU take an equal share of the cores."""
    if proc.kind == "cuda":
        first = process_gpus(proc, gpus_per_process)[0]
        torch.cuda.set_device(first)
        return torch.device("cuda", first)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // proc.world))
    return torch.device("cpu")


def free_port() -> int:
    """A TCP port free on this host now (for MASTER_PORT of processes spawned here)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(entry: Callable[..., Any], args: tuple = (), *, nprocs: int, kind: str) -> list[Any]:
    """Run `entry(proc, *args)` on `nprocs` ranks of this host; returns each rank's result, by rank.

    One process: called here, with `args` as they are. More: spawned (fresh interpreters, so `entry`
    and `args` must pickle), each with the environment torchrun would give it (MASTER_ADDR/PORT, RANK,
    WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), so that `process_group` and per-node shares work the same
    under both. An exception in any rank is raised here after all ranks ended; a user's error (DFlashError)
    in a spawned rank is raised here as one, naming the rank, so that the command prints its line and not
    the rank's traceback.
    """
    if nprocs == 1:
        return [entry(Proc(0, 1, 0, kind), *args)]
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    try:
        mp.start_processes(_spawned, args=(entry, args, nprocs, kind, free_port(), results), nprocs=nprocs, join=True,
                           start_method="spawn")
    except (mp.ProcessRaisedException, mp.ProcessExitedException):
        failed = [(rank, res) for rank, res in _drain(results) if isinstance(res, _RankError)]
        if failed:
            rank, err = failed[0]
            e = DFlashError(f"rank {rank}: {err.message}")
            e.exit_code = err.exit_code
            raise e from None
        raise
    out: list[Any] = [None] * nprocs
    for rank, res in _drain(results):
        out[rank] = res
    return out


@dataclass(frozen=True)
class _RankError:
    """A spawned rank's DFlashError, sent to the parent (the exception itself may not pickle)."""

    message: str
    exit_code: int


def _drain(results) -> list[tuple[int, Any]]:
    got = []
    while not results.empty():
        got.append(results.get())
    return got


def _spawned(rank: int, entry, args: tuple, world: int, kind: str, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    try:
        res = entry(Proc(rank, world, rank, kind), *args)
    except DFlashError as e:
        results.put((rank, _RankError(str(e), e.exit_code)))
        raise SystemExit(e.exit_code) from None   # the parent stops the other ranks and raises it, one line
    results.put((rank, res))


@contextlib.contextmanager
def process_group(backend: str, device: torch.device | None = None):
    """The default process group of the ranks in the environment, for the block inside.

    Created here unless a launcher (accelerate) or the caller already did; a group made here is also
    ended here, when the block completes, so the process exits without warnings. Not on an exception:
    ending a group while other ranks may still wait in a collective can hang.
    """
    import torch.distributed as dist

    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group(backend, **({"device_id": device} if device is not None else {}))
    yield
    if owned:
        dist.destroy_process_group()


class StopRequest:
    """A request to stop: `requested` by SIGTERM / SIGINT in this process (see `stop_signals`), `set`
    by the caller once it acts on it (with several ranks: once all ranks agree, so that they stop after
    the same step)."""

    def __init__(self):
        self.requested = False
        self.set = False
        self.signal = None

    def __call__(self, signum, frame):
        self.requested = True
        self.signal = signum


@contextlib.contextmanager
def stop_signals(stop: StopRequest):
    """SIGTERM / SIGINT request `stop` inside the block instead of ending the process (main thread
    only: Python delivers signals to no other); the previous handlers come back after it."""
    import threading

    caught = (signal.SIGTERM, signal.SIGINT) if threading.current_thread() is threading.main_thread() else ()
    old = {s: signal.signal(s, stop) for s in caught}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


__all__ = ["Proc", "StopRequest", "bind_device", "env_rank", "free_port", "launch", "launched", "local_world_size",
           "plan_processes", "process_gpus", "process_group", "stop_signals", "visible_gpus"]
