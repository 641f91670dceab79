"""Memory budgets: plan keep / offload / recompute per group to meet a device-memory target
at the least step time (the planner is a pure function; the controller applies it)."""
