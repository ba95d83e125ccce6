"""Benchmarks of hpservice against torch, run with ``python -m hpservice.bench <name>``.

Each benchmark measures ours and torch's implementation of the same operation in the same
processes, so the reported ratio ours/torch is what matters, not the absolute times of the
machine it ran on.
"""
