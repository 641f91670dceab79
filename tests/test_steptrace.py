"""Reading a profiled step: the memory timeline and the bus copies' achieved bandwidth."""

import pytest
import torch

from actoffload.tools.steptrace import StepProfiler, StepTrace, parse_trace

CUDA_DEVICE = torch.device("cuda")


def _trace_events():
    t0 = 1_000_000.0  # microseconds, as the profiler writes them
    return {"traceEvents": [
        {"cat": "user_annotation", "name": "forward", "ph": "X", "ts": t0, "dur": 500},
        {"cat": "user_annotation", "name": "backward", "ph": "X", "ts": t0 + 600, "dur": 900},
        {"cat": "cpu_instant_event", "name": "[memory]", "ts": t0 + 10,
         "args": {"Total Allocated": 4096, "Device Type": 1}},
        {"cat": "cpu_instant_event", "name": "[memory]", "ts": t0 + 5,
         "args": {"Total Allocated": 1024, "Device Type": 0}},  # host memory: not the device's
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": t0 + 100, "dur": 100,
         "args": {"bytes": 5_000_000}},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": t0 + 150, "dur": 100,
         "args": {"bytes": 5_000_000}},  # overlaps the first: busy 150 us, not 200
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": t0 + 700, "dur": 200,
         "args": {"memory bandwidth (GB/s)": 25.0}},  # no byte count: from the bandwidth
        {"cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": t0 + 700, "dur": 50,
         "args": {"bytes": 1}},  # not a bus copy
    ]}


def test_parse_trace_reads_phases_memory_and_copies():
    tr = parse_trace(_trace_events(), CUDA_DEVICE)
    assert tr.forward_ms == (0.0, 0.5) and tr.backward_ms == (0.6, 1.5)
    assert tr.memory == [(0.01, 4096)]
    assert tr.copied_bytes("d2h") == 10_000_000 and tr.busy_ms("d2h") == pytest.approx(0.15)
    assert tr.gbps("d2h") == pytest.approx(10_000_000 / 150e-6 / 1e9)
    assert tr.gbps("h2d") == pytest.approx(25.0)


def test_busy_time_counts_overlapping_copies_once():
    tr = StepTrace(copies={"d2h": [(0, 2, 1), (1, 3, 1), (5, 6, 1), (5.5, 5.7, 1)], "h2d": []})
    assert tr.busy_ms("d2h") == pytest.approx(4.0)
    assert tr.gbps("h2d") is None  # no copies: no figure rather than a made-up one


def test_parse_trace_names_a_missing_forward_phase():
    with pytest.raises(ValueError, match="no 'forward' phase"):
        parse_trace({"traceEvents": []}, CUDA_DEVICE)


def test_step_profiler_records_a_cpu_step():
    x = torch.randn(64, 64, requires_grad=True)
    prof = StepProfiler(torch.device("cpu"), memory=True)
    with prof.step():
        with prof.phase("forward"):
            loss = (x @ x).relu().sum()
        with prof.phase("backward"):
            loss.backward()
    tr = prof.trace
    assert tr.forward_ms[0] == 0.0 and tr.backward_ms[0] >= tr.forward_ms[1] > 0
    assert len(tr.memory) > 0 and tr.copied_bytes("d2h") == 0
