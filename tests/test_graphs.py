"""GraphedStep's capture never compiles: a compiled function whose guards fail inside the capture raises
before anything runs, the step warms up once more outside it and captures again.

A compile inside a capture would break it (Inductor benchmarks with random tensors and synchronisations)
and a broken capture leaves the CUDA generator mid-capture, so that a later random op of the same process
fails. The CUDA calls of the capture are replaced here by stand-ins that record what
happens inside and outside the "capture"; torch.compile itself is real (aot_eager backend, fast).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from dflash_pipeline.decoding import graphs
from dflash_pipeline.decoding.graphs import GraphedStep, RecompileRequested, no_collection, no_compiling


@pytest.fixture
def compiled():
    torch._dynamo.reset()
    yield lambda fn: torch.compile(fn, backend="aot_eager")
    torch._dynamo.reset()


def test_no_compiling_runs_what_is_compiled_and_refuses_a_recompile(compiled):
    f = compiled(lambda x: x * 2 + 1)
    x = torch.arange(4.0)
    assert torch.equal(f(x), x * 2 + 1)               # compiled here, outside
    with no_compiling():
        assert torch.equal(f(x), x * 2 + 1)           # the guards hold: runs the compiled code
    with pytest.raises(RecompileRequested, match="fail_on_recompile"), no_compiling():
        f(torch.arange(4, dtype=torch.float64))       # another dtype: dynamo would compile again
    assert torch.equal(f(x.double()), x.double() * 2 + 1)   # outside, it compiles as before


class FakeCuda:
    """Stand-ins for the CUDA calls of GraphedStep._capture; `capturing` is True inside the capture."""

    def __init__(self, monkeypatch):
        self.capturing, self.captures, self.ended = False, 0, 0
        fake = self

        class Graph:
            def replay(self):
                pass

        @contextmanager
        def graph(g, pool=None):
            fake.capturing, fake.captures = True, fake.captures + 1
            try:
                yield
            finally:
                fake.capturing, fake.ended = False, fake.ended + 1   # capture_end runs on errors too

        class Stream:
            def __init__(self, *a, **k):
                pass

            def wait_stream(self, other):
                pass

        monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
        monkeypatch.setattr(torch.cuda, "graph", graph)
        monkeypatch.setattr(torch.cuda, "Stream", Stream)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
        monkeypatch.setattr(torch.cuda, "stream", lambda s: contextmanager(lambda: (yield))())


def test_a_step_whose_guards_fail_in_the_capture_is_compiled_outside_it_and_captured_again(compiled, monkeypatch):
    cuda = FakeCuda(monkeypatch)
    f = compiled(lambda x: x.sin() + 1)
    calls, ran_in_capture = [], []

    def step():
        # the third call (the first capture) meets an input its compiled code has no guard for, as the Gemma
        # 3 step did on the GPU; later calls keep that input
        n = 4 if len(calls) < 2 else 5
        calls.append(cuda.capturing)
        f(torch.ones(n))
        ran_in_capture.append(cuda.capturing)

    g = GraphedStep(step, torch.device("cpu"), enabled=True, warmup=2)
    g()
    assert g.graph is not None
    assert cuda.captures == 2 and cuda.ended == 2
    # warm, warm, capture (refused before the function ran), one more warm-up that compiles, capture
    assert calls == [False, False, True, False, True]
    assert ran_in_capture == [False, False, False, True]


def test_a_step_that_recompiles_at_every_call_fails_with_a_clear_error(compiled, monkeypatch):
    FakeCuda(monkeypatch)
    f = torch.compile(lambda x: x.cos(), backend="aot_eager", dynamic=False)
    sizes = iter(range(1, 100))

    def step():
        f(torch.ones(next(sizes)))    # a new static shape every call: the guards never hold

    g = GraphedStep(step, torch.device("cpu"), enabled=True, warmup=1)
    with pytest.raises(RuntimeError, match=f"after {graphs.CAPTURE_ATTEMPTS} warm-ups.*without compiling"):
        g()
    assert g.graph is None


def test_no_collection_pauses_the_collector_and_restores_it():
    """Inside a capture no cyclic garbage collection runs (one could release CUDA objects mid-capture);
    after it the collector is as it was, an error inside included."""
    import gc

    assert gc.isenabled()
    with no_collection():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(KeyError), no_collection():
        raise KeyError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with no_collection():
            pass
        assert not gc.isenabled()   # left disabled, as the caller had it
    finally:
        gc.enable()
