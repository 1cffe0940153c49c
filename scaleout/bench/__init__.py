"""Benchmarks: ``scaleout bench <name>``, one module here each (``_``-prefixed modules are helpers).

A benchmark module defines ``NAME``, ``HELP``, ``add_arguments(parser)``, ``run(args) -> int``
(optionally ``DESCRIPTION``) and ``SMOKE_ARGS``: the tiny settings tests/bench/test_bench.py runs
it with,
so every benchmark is run by a test. The measurement is :mod:`scaleout.bench._harness`: interleaved
variants, the slowest rank, medians and ratios against the baseline measured in the same run, a
Markdown table, JSON (``--out``) and a PNG where a picture helps (``--png``). Top-level imports stay
light (``scaleout --help`` imports every module).
"""
