"""Real processes: concurrent writers on one store, and a writer killed with SIGKILL mid-segment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_pipeline.store.manifest import committed_segments, rebuild_manifest_at
from dflash_pipeline.store.reader import StoreReader
from dflash_pipeline.store.verify import verify_store
from helpers import write_random_store

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TESTS = Path(__file__).parent
WRITER = """
import sys, warnings
warnings.simplefilter("ignore")
from helpers import write_random_store
url, ids, hidden = sys.argv[1], [int(x) for x in sys.argv[2].split(",")], int(sys.argv[3])
write_random_store(url, segment_ids=ids, hidden=hidden, seed=ids[0], with_target=False, manifest=False,
                   samples_per_segment=4, min_len=200, max_len=300)
print("done", flush=True)
"""


def _spawn(url: str, ids: list[int], hidden: int = 64) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.Popen([sys.executable, "-c", WRITER, url, ",".join(map(str, ids)), str(hidden)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_concurrent_writer_processes(tmp_path):
    url = str(tmp_path / "store")
    write_random_store(url, segments=0)  # the coordinator creates the store and target/ first
    procs = [_spawn(url, [p, p + 3, p + 6]) for p in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err.decode()[-2000:]
    rebuild_manifest_at(url)
    r = StoreReader(url)
    assert committed_segments(r.kv) == list(range(9))
    assert r.num_samples == 36
    rep = verify_store(url)
    assert rep.ok and not rep.incomplete, rep.to_dict()


def test_sigkill_mid_segment_leaves_clean_store(tmp_path):
    url = str(tmp_path / "store")
    write_random_store(url, segments=0)
    root = tmp_path / "store"
    # Large segments (~2.5 MB of features each) keep the writer inside a segment most of the time.
    proc = _spawn(url, list(range(0, 400)), hidden=1024)
    victim = None
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        done = {int(p.stem) for p in (root / "commits").glob("*.json")} if (root / "commits").exists() else set()
        started = {int(p.name) for p in (root / "segments").glob("0*")} if (root / "segments").exists() else set()
        pending = started - done
        if len(done) >= 2 and pending:
            os.kill(proc.pid, signal.SIGKILL)
            victim = max(pending)
            break
        time.sleep(0.002)
    proc.wait(timeout=30)
    assert victim is not None, "the writer finished before it could be killed"
    assert proc.returncode == -signal.SIGKILL

    rep = verify_store(url)
    assert rep.ok, rep.to_dict()                       # every committed segment is intact
    assert victim in rep.incomplete
    r = StoreReader(url)                               # manifest missing: rebuilt from markers
    assert victim not in set(r.segment_ids().tolist())
    for seg in r.segment_ids():
        r.read_segment(int(seg))

    rep = verify_store(url, repair=True)
    assert rep.removed_incomplete == rep.incomplete and rep.manifest_rebuilt
    assert not (root / "segments" / f"{victim:08d}").exists()
    # The run can be finished: the killed segment is written again and commits.
    write_random_store(url, segment_ids=[victim], with_target=False)
    assert verify_store(url).ok
    assert victim in StoreReader(url).segment_ids()
