"""Telemetry: what a run tells -- the MLPerf log, metrics sinks, the run report, timers, the
profiler and device facts (peak FLOPS, memory)."""
