"""Data parallelism: overlapped, bucketed gradient all-reduce with any :mod:`scaleout.comm`
algorithm.

``DataParallel`` (our reducer), ``ddp_comm_hook`` (the same algorithms inside torch's own
DistributedDataParallel), ``Timeline`` (Chrome trace of backward and communication). See
docs/overlap.md.
"""

from scaleout.parallel.data_parallel import DataParallel
from scaleout.parallel.ddp_hook import ddp_comm_hook
from scaleout.parallel.timeline import Timeline, load_trace

__all__ = ["DataParallel", "Timeline", "ddp_comm_hook", "load_trace"]
