"""Helpers of ``benchmarks/peers.py``: peer environments, workloads, timing and per-system runner scripts.

The runner scripts (``run_*.py``) are executed in subprocesses, some of them with the Python of a peer's
own virtual environment, so they import nothing from this package except :mod:`peers.common` and
:mod:`peers.workloads`, which need only torch (and transformers for the encoder).
"""
