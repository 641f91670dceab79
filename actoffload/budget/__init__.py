"""Memory budgets: plan keep / offload / recompute per group to meet a device-memory target
at the least step time. ``costmodel`` says what a plan costs, ``search`` which plans to
consider and which to run, ``controller`` profiles, applies and checks them (a state
machine), ``actions`` is the vocabulary they share and ``tolerances`` their margins."""

from .search import BudgetTooSmall

__all__ = ["BudgetTooSmall"]
