"""Former home of the memory-budget planner, now split into the cost model
(``costmodel.py``), the search (``search.py``) and the actions (``actions.py``). It re-exports
the names code outside the budget still imports from here; new code imports from those
modules."""

from .actions import GroupDecision as GroupPlan
from .costmodel import MemoryPlan as Plan

__all__ = ["GroupPlan", "Plan"]
