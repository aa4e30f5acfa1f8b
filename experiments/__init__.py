"""Experiments beside the package, not installed: the CPU demo's own RL loop (``python -m experiments.demo`` from
the repository root, docs/demo.md) and the studies that rest on it."""
