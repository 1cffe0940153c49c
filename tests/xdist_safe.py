"""A crash-safe ``--dist loadgroup`` scheduler (pytest plugin; tests/conftest.py uses it).

pytest-xdist 3.8.0's LoadScopeScheduling (which loadgroup extends) can hang the whole session
after a worker dies mid-run ("node down: Not properly terminated", "replacing crashed worker"):
``remove_node`` puts the dead worker's whole workload back on the queue, the work units it had
already finished included, and a unit with no pending test is then sent to a worker as nothing;
and a worker given a single test waits for a second one that the controller, which reschedules a
worker only when it completes a test, never sends. Every worker then idles until CI's time limit
(pytest-dev/pytest-xdist issues 1323, 1327 and 1378; the fixes are merged upstream but not in a
release). This subclass re-queues only the units that still have tests to run, counts the test the
worker died in as done (xdist has already reported it failed: it is not run again to crash the
replacement too), and tops a worker up to two pending tests, or tells it to finish.
"""

from __future__ import annotations

from typing import Any

import pytest


def _scheduler_class() -> type:
    from xdist.scheduler import LoadGroupScheduling

    class CrashSafeLoadGroupScheduling(LoadGroupScheduling):
        def remove_node(self, node: Any) -> str | None:
            workload = self.assigned_work.pop(node)
            if not self._pending_of(workload):
                return None
            crashitem = next(
                nodeid for unit in workload.values() for nodeid, done in unit.items() if not done
            )
            for scope, unit in workload.items():
                if crashitem in unit:
                    unit[crashitem] = True
                if not all(unit.values()):
                    self.workqueue[scope] = unit
            for other in self.assigned_work:
                self._reschedule(other)
            return crashitem

        def _reschedule(self, node: Any) -> None:
            if node.shutting_down:
                return
            while self.workqueue and self._pending_of(self.assigned_work.get(node, {})) < 2:
                self._assign_work_unit(node)
            if not self.workqueue:
                node.shutdown()

    return CrashSafeLoadGroupScheduling


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist", None) != "loadgroup":
        return None
    return _scheduler_class()(config, log)
