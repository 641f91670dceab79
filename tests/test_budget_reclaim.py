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
    """Stands in for torch's allocator settings: a device of ``total`` bytes, the settings
    torch holds ``users`` (the user's, from a variable or set at runtime)."""

    def __init__(self, monkeypatch, total: int = 80 * GiB, fraction: float = 1.0, users: str = ""):
        self.total, self.fraction, self.settings, self.fractions_set = total, fraction, [], []
        self.holds = users
        monkeypatch.setattr(torch.cuda.memory, "get_per_process_memory_fraction", lambda index: self.fraction)
        monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", self.set_settings)
        monkeypatch.delattr(torch._C, "_accelerator_setAllocatorSettings", raising=False)
        monkeypatch.setattr(torch._C, "_accelerator_getAllocatorSettings", lambda: self.holds, raising=False)
        monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", self.set_fraction)
        monkeypatch.setattr(reclaim, "_live", {})  # (no budget alive from another test)
        monkeypatch.setattr(reclaim, "_users_fraction", {})
        monkeypatch.setattr(reclaim, "_users_settings", None)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (self.total // 2, self.total))
        for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF"):
            monkeypatch.delenv(name, raising=False)

    def set_settings(self, conf: str) -> None:
        self.settings.append(conf)
        self.holds = conf

    def set_fraction(self, fraction: float, index: int) -> None:
        self.fraction = fraction
        self.fractions_set.append(fraction)


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
    allocator = Allocator(monkeypatch, users="max_split_size_mb:512,expandable_segments:False")
    reclaim.reclaim_above(DEVICE, 20 * GiB)
    assert allocator.settings == [
        f"max_split_size_mb:512,expandable_segments:False,garbage_collection_threshold:{share(20 * GiB)}"]
    # a fraction of 1 (the default) leaves the allocator collecting nothing: 2 MiB under it
    assert allocator.fractions_set == [1 - (2 << 20) / (80 * GiB)]


def test_reclaim_sets_the_threshold_through_the_accelerator_settings_where_torch_has_them(monkeypatch):
    allocator, told = Allocator(monkeypatch, fraction=0.5), []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", told.append, raising=False)  # (it holds "")
    reclaim.reclaim_above(DEVICE, 10 * GiB)
    assert told == ["garbage_collection_threshold:0.250000000000"] and allocator.settings == []


@pytest.mark.parametrize("conf, said", [("garbage_collection_threshold:0.6", "the user's"),
                                        ("backend:cudaMallocAsync", "not PyTorch's native allocator"),
                                        ("backend:hipMallocAsync", "not PyTorch's native allocator"),
                                        ("max_split_size_mb:256, expandable_segments:True", "expandable segments")])
def test_reclaim_leaves_a_users_threshold_another_allocator_or_expandable_segments_alone(monkeypatch, conf, said):
    allocator = Allocator(monkeypatch, users=conf)
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


class Budget:
    """Stands in for a budget's reserve: what a setting lives as long as."""


@pytest.mark.parametrize("first_let_go", ["earlier", "later"])
def test_the_users_settings_are_back_once_no_budget_is_alive_whichever_goes_first(monkeypatch, first_let_go):
    allocator = Allocator(monkeypatch, users="max_split_size_mb:512")
    budgets = {"earlier": Budget(), "later": Budget()}
    reclaim.reclaim_above(DEVICE, 20 * GiB, budgets["earlier"])
    reclaim.reclaim_above(DEVICE, 40 * GiB, budgets["later"])
    alive = "later" if first_let_go == "earlier" else "earlier"
    del budgets[first_let_go]  # the one alive sets the threshold
    assert allocator.settings[-1] == f"max_split_size_mb:512,garbage_collection_threshold:{share(20 * GiB if alive == 'earlier' else 40 * GiB)}"
    assert allocator.fraction < 1.0
    budgets.clear()
    assert allocator.settings[-1] == "max_split_size_mb:512"
    assert allocator.fraction == 1.0  # the user's, though a budget had lowered it when the other was made


def test_each_devices_fraction_is_back_once_its_budgets_are_gone(monkeypatch):
    allocator, fractions = Allocator(monkeypatch), {0: 1.0, 1: 0.8}
    monkeypatch.setattr(torch.cuda.memory, "get_per_process_memory_fraction", lambda index: fractions[index])
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, index: fractions.__setitem__(index, fraction))
    on0, on1 = Budget(), Budget()
    reclaim.reclaim_above(torch.device("cuda", 0), 20 * GiB, on0)
    reclaim.reclaim_above(torch.device("cuda", 1), 20 * GiB, on1)
    assert fractions[0] < 1.0 and fractions[1] == 0.8
    del on0, on1
    assert fractions == {0: 1.0, 1: 0.8} and allocator.settings[-1] == ""


def test_reclaim_reads_the_settings_torch_holds_not_a_variable_it_ignored(monkeypatch):
    # torch 2.13 reads PYTORCH_CUDA_ALLOC_CONF before PYTORCH_ALLOC_CONF, earlier versions the other way round
    allocator = Allocator(monkeypatch, users="garbage_collection_threshold:0.6")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:512")
    assert reclaim.reclaim_above(DEVICE, 20 * GiB) == "the user's garbage_collection_threshold"
    assert allocator.settings == []


@pytest.mark.parametrize("variables, users", [({"PYTORCH_ALLOC_CONF": "max_split_size_mb:512",
                                                "PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"},
                                               "max_split_size_mb:512"),
                                              ({"PYTORCH_ALLOC_CONF": "", "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"},
                                               "")])  # (an empty variable is set)
def test_on_a_torch_that_cannot_say_what_it_holds_reclaim_reads_the_variable_it_read(monkeypatch, variables, users):
    allocator = Allocator(monkeypatch)
    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings")
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    reclaim.reclaim_above(DEVICE, 20 * GiB)
    assert allocator.settings == [",".join(v for v in (users, f"garbage_collection_threshold:{share(20 * GiB)}") if v)]


def test_settings_set_at_runtime_are_the_users_and_come_back(monkeypatch):
    users = "max_split_size_mb:512,roundup_power2_divisions:[256:1,512:2,>:1]"
    allocator, budget = Allocator(monkeypatch, users=users), Budget()
    reclaim.reclaim_above(DEVICE, 20 * GiB, budget)
    assert allocator.holds == f"{users},garbage_collection_threshold:{share(20 * GiB)}"
    second = Budget()  # made while the first's settings are in place: the user's are still the user's
    assert reclaim.reclaim_above(DEVICE, 30 * GiB, second).startswith("threshold")
    del budget, second
    assert allocator.holds == users


@pytest.mark.parametrize("users", ["max_split_size_mb:512,", "max_split_size_mb:512, ", "  "])
def test_a_trailing_comma_or_blank_settings_leave_no_empty_item_before_the_threshold(monkeypatch, users):
    allocator = Allocator(monkeypatch, users=users)
    reclaim.reclaim_above(DEVICE, 20 * GiB)
    threshold = f"garbage_collection_threshold:{share(20 * GiB)}"
    assert allocator.settings == [f"max_split_size_mb:512,{threshold}" if users.strip() else threshold]


def test_a_budget_let_go_while_the_settings_are_applied_raises_nothing(monkeypatch):
    allocator, fractions = Allocator(monkeypatch), {0: 1.0, 1: 1.0}
    monkeypatch.setattr(torch.cuda.memory, "get_per_process_memory_fraction", lambda index: fractions[index])
    budgets = [Budget(), Budget()]
    reclaim.reclaim_above(torch.device("cuda", 0), 20 * GiB, budgets[0])
    reclaim.reclaim_above(torch.device("cuda", 1), 20 * GiB, budgets[1])

    def set_fraction(fraction: float, index: int) -> None:
        fractions[index] = fraction
        if index == 0 and budgets:
            budgets.clear()  # the other device's budget collected meanwhile (its finalizer runs _apply)

    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    reclaim._forget(max(reclaim._live) - 1)  # the first budget's setting, let go
    assert reclaim._live == {} and fractions == {0: 1.0, 1: 1.0} and allocator.holds == ""


def test_reclaim_sets_a_small_budgets_share_in_digits_torch_parses(monkeypatch):
    allocator = Allocator(monkeypatch, fraction=0.5)
    reclaim.reclaim_above(DEVICE, 64 << 10)  # 64 KiB of 40 GiB: no exponent, not 0
    assert allocator.settings == ["garbage_collection_threshold:0.000001525879"]


@pytest.mark.parametrize("error", [RuntimeError, ValueError])
def test_settings_torch_refuses_leave_everything_as_it_was(monkeypatch, error):
    allocator = Allocator(monkeypatch, fraction=0.5, users="typo_key:1")

    def refuse(conf: str) -> None:
        raise error(f"Unrecognized key in {conf}")

    monkeypatch.setattr(torch.cuda.memory, "_set_allocator_settings", refuse)
    assert "torch refused the settings: Unrecognized key" in reclaim.reclaim_above(DEVICE, GiB, Budget())
    assert allocator.fraction == 0.5 and reclaim._live == {}  # the user's, and nothing to restore
