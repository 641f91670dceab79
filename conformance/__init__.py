"""Differential conformance suite: fast against ref against no offloader.

    python -m conformance --impl fast --device cuda --seeds 2000
    pytest conformance
"""
