"""Peaks entered twice, as loop_sweep.sweep_workload does (``with loop.peaks`` around
the whole workload, and again by ``_Loop.method`` for each method): each step's peaks are its
own, and leaving the contexts puts ``reset_peak_memory_stats`` back."""

from __future__ import annotations

import torch

from actoffload.tools import loop_sweep
from actoffload.tools.peaks import Peaks


def _fake():
    counters = {"reserved": 0, "allocated": 0}

    class FakeCuda:
        @staticmethod
        def reset_peak_memory_stats(device=None):
            counters.update(reserved=0, allocated=0)

    return counters, FakeCuda()


def test_peaks_entered_again_inside_itself_start_each_window_afresh():
    counters, fake = _fake()
    original = fake.reset_peak_memory_stats
    peaks = Peaks(torch.device("cpu"), read_peaks=lambda: (counters["reserved"], counters["allocated"]), module=fake)
    with peaks:
        with peaks:
            peaks.start()
            counters.update(reserved=900, allocated=700)
            assert peaks.read() == (900, 700)
            peaks.start()  # the next step: the last one's peaks are not its own
            counters.update(reserved=300, allocated=200)
            assert peaks.read() == (300, 200)
        peaks.start()  # still inside the outer context
        counters.update(reserved=100, allocated=50)
        fake.reset_peak_memory_stats()
        assert peaks.read() == (100, 50)
    assert fake.reset_peak_memory_stats == original


def test_the_loop_sweeps_steps_read_their_own_peaks():
    counters, fake = _fake()
    original = fake.reset_peak_memory_stats
    w = loop_sweep.llama(torch.device("cpu"), small=True)
    loop = loop_sweep._Loop(w, log=lambda s: None)
    loop.peaks = Peaks(torch.device("cpu"), read_peaks=lambda: (counters["reserved"], counters["allocated"]),
                       module=fake)
    with loop.peaks:  # as sweep_workload enters it
        with loop.method(loop_sweep.Method("none")):
            _, _, reserved, allocated = loop.timed(lambda: counters.update(reserved=900, allocated=700))
            assert (reserved, allocated) == (900, 700)
            _, _, reserved, allocated = loop.timed(lambda: counters.update(reserved=300, allocated=200))
            assert (reserved, allocated) == (300, 200)
    assert fake.reset_peak_memory_stats == original
