"""Which fixed per-step cost the simulator charges (``scaleout simulate --overhead``): one of
scaleout's own measured calibrations (:data:`scaleout.sim.step.STEP_OVERHEADS`) or NVIDIA's MLPerf
BERT stack, calibrated by simulating a published run (:func:`scaleout.sim.mlperf.nvidia_host_s`).
Above both modules, so that the step model never imports the runs it is checked against.
"""

from __future__ import annotations

from scaleout.errors import ConfigError
from scaleout.sim.mlperf import CALIBRATION_RUN, nvidia_host_s
from scaleout.sim.step import STEP_OVERHEADS, StepOverhead


def get_overhead(name: str) -> StepOverhead:
    """A calibration of ``STEP_OVERHEADS``, or ``nvidia-bert``: NVIDIA's MLPerf BERT stack, host
    time calibrated on a published run (scaleout.sim.mlperf.nvidia_host_s; graphed only)."""
    if name == "nvidia-bert":
        host = nvidia_host_s()
        return StepOverhead(
            name,
            host,
            host,
            f"NVIDIA MLPerf BERT (--use_cuda_graph full_iteration), calibrated on run "
            f"({CALIBRATION_RUN}); eager: not measured, the graphed host time as a floor",
        )
    try:
        return STEP_OVERHEADS[name]
    except KeyError:
        raise ConfigError(
            f"unknown step-overhead calibration {name!r}; "
            f"expected one of {', '.join([*STEP_OVERHEADS, 'nvidia-bert'])}"
        ) from None
