"""The budget's margins and tolerances, in one place: how far a measurement may stray from
the model, or from an earlier measurement, before the controller acts on it, and how close
two modelled step times must be to count as alike. Each constant says why it is there."""

from __future__ import annotations

MiB = 1 << 20

# ---------------------------------------------------------------- margins (bytes)
LEAST_MARGIN_FLOOR = MiB  # the allocator's rounding and a library's workspace: what the model never sees
LEAST_MARGIN_DIVISOR = 1000  # ... and, on a large budget, a thousandth of it: those grow with the step
OVERSHOOT_PAD_FLOOR = MiB  # an overshoot widens the margin by itself and this much more, so the next plan
OVERSHOOT_PAD_DIVISOR = 400  # ... (at least a 400th of the budget) does not land on the same edge again
BASE_TOLERANCE_FLOOR = MiB  # what is allocated when a step begins moves a little from step to step (noise) ...
BASE_TOLERANCE_DIVISOR = 100  # ... up to a hundredth of the budget; more is kept gradients or new optimizer state

# ---------------------------------------------------------------- tolerances (shares)
WORKLOAD_CHANGE = 0.10  # a group saving this share more or less than profiled is another workload (batch noise is less; when it is profiled: the controller's LIGHTER_STEPS)
TIE = 0.01  # modelled step times this close are alike: the model cannot tell them apart, so the plan doing less it cannot see goes first
CALIBRATION_SLACK = 0.05  # a measured step this close to the model is noise, not an error of the model to correct
HOST_PACED = 0.9  # a forward whose host time is at least this share of its device time ran at the host's pace


def least_margin(budget: int) -> int:
    """Bytes every modelled peak is raised by before any overshoot."""
    return max(LEAST_MARGIN_FLOOR, budget // LEAST_MARGIN_DIVISOR)


def overshoot_margin(budget: int, peak: int) -> int:
    """Bytes a step that peaked at ``peak`` over ``budget`` adds to the margin."""
    return peak - budget + max(OVERSHOOT_PAD_FLOOR, budget // OVERSHOOT_PAD_DIVISOR)


def base_tolerance(budget: int) -> int:
    """How far what is allocated when a step begins may move before the profile is stale."""
    return max(BASE_TOLERANCE_FLOOR, budget // BASE_TOLERANCE_DIVISOR)


def new_workload(now: int, then: int) -> bool:
    """Bytes saved now against then: more than ``WORKLOAD_CHANGE`` apart is another workload."""
    return abs(now - then) > WORKLOAD_CHANGE * max(then, 1)


def alike(fastest_s: float, step_s: float) -> bool:
    """Whether a plan modelled at ``step_s`` is alike to the fastest, at ``fastest_s``: the one
    tie rule of the search (:func:`~.search.fastest`) and of the controller's order of trying."""
    return step_s <= fastest_s * (1 + TIE)


def off_model(measured_s: float, modelled_s: float) -> int:
    """Whether a measured step is slower (1) or faster (-1) than modelled beyond noise, or neither (0)."""
    if measured_s > modelled_s * (1 + CALIBRATION_SLACK):
        return 1
    if measured_s < modelled_s * (1 - CALIBRATION_SLACK):
        return -1
    return 0
