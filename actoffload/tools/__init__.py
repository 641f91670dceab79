"""The tools around the core: the ``actoffload`` command (demo, bench), the models they
train, step profiling and plots, and the provenance of results. Nothing in the core
imports from here."""
