"""The caching allocator told the budget (budget/reclaim.py): idle blocks given back before
it grows past it, a setting of the user's left alone. On the CPU against a stand-in for
torch's allocator settings; on a GPU against the allocator itself."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from actoffload.budget import reclaim
from actoffload.budget.reserve import AllocatorReserve

GiB = 1 << 30
CUDA = torch.cuda.is_available()


class Allocator:
    """Stands in for torch's allocator settings: a device of ``total`` bytes."""

    def __init__(self, monkeypatch, total: int = 80 * GiB, fraction: float = 1.0):
        self.total, self.fraction, self.settings, self.fractions_set = total, fraction, [], []
        monkeypatch.setattr(torch.cuda.memory, "get_per_process_memory_fraction", lambda index: self.fraction)
        monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", self.settings.append)
        monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings", raising=False)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                            lambda fraction, index: self.fractions_set.append(fraction))
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (self.total // 2, self.total))
        for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
            monkeypatch.delenv(name, raising=False)


DEVICE = torch.device("cuda", 0)


def share(budget: int, total: int = 80 * GiB) -> str:
    """The threshold of ``budget`` on a device of ``total`` bytes at a fraction of 1."""
    return f"{budget / ((1 - (2 << 20) / total) * total):.12f}"


def test_reclaim_sets_the_threshold_at_the_budget_as_a_share_of_what_the_allocator_may_use(monkeypatch):
    allocator = Allocator(monkeypatch, fraction=0.5)
    assert reclaim.reclaim_above(DEVICE, 10 * GiB) == "threshold 0.250 of 40.0 GiB"
    assert allocator.settings == ["garbage_collection_threshold:0.250000000000"]
    assert allocator.fractions_set == [0.5]  # the hard limit stays the user's


def test_reclaim_keeps_the_users_allocator_settings(monkeypatch):
    allocator = Allocator(monkeypatch)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    reclaim.reclaim_above(DEVICE, 20 * GiB)
    assert allocator.settings == [f"expandable_segments:True,garbage_collection_threshold:{share(20 * GiB)}"]
    # a fraction of 1 (the default) leaves the allocator collecting nothing: 2 MiB under it
    assert allocator.fractions_set == [1 - (2 << 20) / (80 * GiB)]


def test_reclaim_sets_the_threshold_through_the_accelerator_settings_where_torch_has_them(monkeypatch):
    allocator, told = Allocator(monkeypatch, fraction=0.5), []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", told.append, raising=False)
    reclaim.reclaim_above(DEVICE, 10 * GiB)
    assert told == ["garbage_collection_threshold:0.250000000000"] and allocator.settings == []


@pytest.mark.parametrize("conf, said", [("garbage_collection_threshold:0.6", "the user's"),
                                        ("backend:cudaMallocAsync", "not PyTorch's native allocator")])
def test_reclaim_leaves_a_users_threshold_or_another_allocator_alone(monkeypatch, conf, said):
    allocator = Allocator(monkeypatch)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", conf)
    assert said in reclaim.reclaim_above(DEVICE, 20 * GiB)
    assert allocator.settings == [] and allocator.fractions_set == []


def test_reclaim_sets_nothing_where_the_budget_is_all_the_allocator_may_use(monkeypatch):
    allocator = Allocator(monkeypatch, total=16 * GiB)
    assert reclaim.reclaim_above(DEVICE, 16 * GiB) == "the budget is all the memory the allocator may use"
    assert allocator.settings == []


def test_reclaim_says_why_where_torch_cannot_set_it(monkeypatch):
    Allocator(monkeypatch)
    monkeypatch.delattr(torch.cuda.memory, "_set_allocator_settings")
    assert "cannot set it" in reclaim.reclaim_above(DEVICE, GiB)
    assert reclaim.reclaim_above(torch.device("cpu"), GiB) == "not a CUDA device"


def test_the_reserve_tells_the_allocator_the_budget_once_at_the_first_step():
    class Device:
        cuda, told = True, []

        def reserved(self) -> int:
            return 0

        def trim(self) -> None:
            pass

        def reclaim_above(self, budget: int, owner: object) -> str:
            self.told.append(budget)
            return "told"

    reserve, device = AllocatorReserve(), Device()
    for _ in range(3):
        reserve.step_begins(device, 5 * GiB)
        reserve.step_ended(device, 5 * GiB, GiB, GiB)
    assert device.told == [5 * GiB] and reserve.reclaim == "told"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU; CI has none")
def test_cuda_a_cache_of_idle_blocks_of_other_sizes_is_given_back_before_the_allocator_grows_past_the_budget():
    """In a process of its own: the threshold is a setting of the whole process's allocator."""
    script = textwrap.dedent("""
        import sys, torch
        from actoffload.budget.reclaim import reclaim_above
        MiB, cuda = 1 << 20, torch.device("cuda")
        torch.cuda.empty_cache()
        base = torch.cuda.memory_reserved()
        idle = [torch.empty(64 * MiB, dtype=torch.uint8, device=cuda) for _ in range(8)]
        del idle  # 512 MiB of 64 MiB blocks, cached
        if sys.argv[1] == "told":
            print(reclaim_above(cuda, base + 256 * MiB), file=sys.stderr)
        x = torch.empty(100 * MiB, dtype=torch.uint8, device=cuda)  # too large for any of them
        print((torch.cuda.memory_reserved() - base) // MiB)
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None), env.pop("PYTORCH_ALLOC_CONF", None)
    grown = {how: int(subprocess.run([sys.executable, "-c", script, how], env=env, check=True,
                                     capture_output=True, text=True).stdout)
             for how in ("told", "untold")}
    assert grown["untold"] >= 612  # every idle block kept, and the new one beside them
    assert grown["told"] <= 256 + 100 + 2  # back to the budget first (2 MiB: the allocator's rounding)


def test_the_users_settings_are_back_once_the_latest_budget_is_let_go(monkeypatch):
    allocator = Allocator(monkeypatch)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512")

    class Budget:
        pass

    first, second = Budget(), Budget()
    reclaim.reclaim_above(DEVICE, 20 * GiB, first)
    reclaim.reclaim_above(DEVICE, 40 * GiB, second)
    del first  # an earlier budget's: the later one's threshold stands
    assert allocator.settings[-1] == f"max_split_size_mb:512,garbage_collection_threshold:{share(40 * GiB)}"
    del second
    assert allocator.settings[-1] == "max_split_size_mb:512"
    assert allocator.fractions_set[-1] == 1.0


def test_reclaim_sets_a_small_budgets_share_in_digits_torch_parses_and_a_refusal_changes_nothing(monkeypatch):
    allocator = Allocator(monkeypatch, fraction=0.5)
    reclaim.reclaim_above(DEVICE, 64 << 10)  # 64 KiB of 40 GiB: no exponent, not 0
    assert allocator.settings == ["garbage_collection_threshold:0.000001525879"]

    def refuse(conf: str) -> None:
        raise RuntimeError("that setting cannot be changed once CUDA has started")

    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", refuse)
    assert "torch refused the settings: that setting" in reclaim.reclaim_above(DEVICE, GiB)
    assert allocator.fractions_set[-1] == 0.5  # the user's again
