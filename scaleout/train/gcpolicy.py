"""Python's garbage collector, kept out of the steps.

On 2,048 ranks a step waits for the slowest: a generation-2 collection that pauses one rank for
tens of ms stalls every rank, and automatic collections fire on allocation counts, i.e. at a
different step on every rank. So (as NVIDIA's MLPerf Llama configs do with ``GC_TRAIN``, and
Python's own advice for long-lived servers, ``gc.freeze`` docs):

- after set-up, ``gc.freeze()`` moves every object alive then (the model, the data index, the
  modules) to a permanent generation that no collection scans again;
- during the step loop automatic collection is off (``gc.disable()``);
- ``collect()`` runs one full collection at chosen points only: evaluation and checkpoint
  boundaries, which every rank reaches at the same step;
- ``stop()`` restores the collector as it was.

Reference cycles made by the steps are then freed at the next boundary; a loop that makes many
of them between two boundaries grows memory, which ``collect()`` counts (``freed``) and
report.json shows (``gc``). A collection that fires anyway (another thread re-enabled it) is
counted as ``unplanned``.
"""

from __future__ import annotations

import gc
import time
from typing import Any


class GcPolicy:
    def __init__(self) -> None:
        self.active = False
        self.in_boundary = False
        self.was_enabled = gc.isenabled()
        self.frozen = 0
        self.boundary = 0
        self.unplanned = 0
        self.freed = 0
        self.seconds = 0.0

    def _watch(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and self.active and not self.in_boundary:
            self.unplanned += 1

    def start(self) -> None:
        """After set-up, before the first step: freeze what is alive, collection off."""
        if self.active:
            return
        self.was_enabled = gc.isenabled()
        gc.collect()  # set-up's garbage first, so it is not frozen for the run
        gc.freeze()
        self.frozen = gc.get_freeze_count()
        gc.disable()
        gc.callbacks.append(self._watch)
        self.active = True

    def collect(self) -> int:
        """A full collection now (an evaluation or checkpoint boundary); the objects freed."""
        if not self.active:
            return 0
        self.in_boundary = True
        t0 = time.perf_counter()
        try:
            found = gc.collect()
        finally:
            self.in_boundary = False
        self.seconds += time.perf_counter() - t0
        self.boundary += 1
        self.freed += found
        return found

    def stop(self) -> None:
        """The collector as it was before ``start()``."""
        if not self.active:
            return
        self.active = False
        if self._watch in gc.callbacks:
            gc.callbacks.remove(self._watch)
        gc.unfreeze()
        if self.was_enabled:
            gc.enable()

    def summary(self) -> dict[str, Any]:
        return {
            "frozen_objects": self.frozen,
            "boundary_collections": self.boundary,
            "unplanned_collections": self.unplanned,
            "freed": self.freed,
            "collect_s": round(self.seconds, 4),
        }
