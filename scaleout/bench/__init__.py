"""Benchmarks: ``scaleout bench <name>``. Each is a module here defining NAME, HELP, add_arguments, run.

Conventions (README "Benchmarks"): compare side by side in one run and report ratios against the
baseline measured in the same run; print a table, write JSON (``--out``), and a PNG where a picture
helps. Shared helpers for that live in :mod:`scaleout.bench.common`.
"""
