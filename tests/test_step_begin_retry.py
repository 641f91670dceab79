"""The step-begin logic (engine._in_step): a plan whose step_begins raises has the
step begun again at the next group, as the engine promises, after the first step too."""

from __future__ import annotations

import pytest
import torch

import actoffload as ao

from helpers import IMPLS


class _RaisesOnce(ao.Plan):
    def __init__(self, at: int):
        super().__init__()
        self.at, self.calls, self.begun = at, 0, 0

    def step_begins(self) -> None:
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("no plan fits")
        self.begun += 1


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("at", [1, 2])
def test_a_step_whose_beginning_raised_is_begun_again_at_the_next_group(impl, at):
    plan = _RaisesOnce(at)
    off = ao.Offloader(impl=impl, plan=plan)
    x = torch.randn(4, 8, requires_grad=True)
    for step in range(3):
        if step + 1 == at:
            with pytest.raises(RuntimeError, match="no plan fits"):
                with off.group("g"):
                    pass
        with off.group("g"):
            y = x.sin()
        with off.group("h"):
            y = y.sin()
        y.sum().backward()
    assert plan.begun == 3  # every step began once it could
