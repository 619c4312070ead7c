"""The profile report's arithmetic (kernel time, span, gaps and the host op at each) on known events."""

from __future__ import annotations

from types import SimpleNamespace as NS

from dflash_pipeline.extract.profiling import summarize


def _ev(name, start, end, device="DeviceType.CUDA"):
    return NS(name=name, device_type=device, time_range=NS(start=start, end=end))


class _Prof:
    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events


def test_kernel_time_span_and_gaps():
    events = [
        _ev("aten::mm", 0, 50, "DeviceType.CPU"),          # host op around the first gap's start
        _ev("aten::softmax", 100, 400, "DeviceType.CPU"),  # host op at the second gap
        _ev("gemm", 10, 40),
        _ev("gemm", 30, 60),                               # overlaps the first: counted once
        _ev("Memcpy DtoH (Device -> Pinned)", 60, 300),    # copies are not compute: left out
        _ev("softmax", 100, 110),                          # gap 60 -> 100, no host op running at 60
        _ev("gemm", 350, 400),                             # gap 110 -> 350, host in aten::softmax
    ]
    r = summarize(_Prof(events))
    assert r["kernels"] == 4
    assert r["span_s"] * 1e6 == 390                       # 10 .. 400
    assert round(r["kernel_busy_s"] * 1e6) == 50 + 10 + 50   # 10..60, 100..110, 350..400
    assert round(r["gaps_total_s"] * 1e6) == 40 + 240
    assert r["gaps_over_100us"] == 1
    assert r["largest_gaps"][0] == {"us": 240, "host_op": "aten::softmax"}
    assert r["top_kernels"][0]["name"] == "gemm"


def test_no_kernels():
    assert summarize(_Prof([_ev("aten::add", 0, 5, "DeviceType.CPU")])) == {"kernels": 0}
