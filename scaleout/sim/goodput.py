"""Expected goodput at a scale: node failures (Poisson, one per node MTBF / nodes), the save stall
per checkpoint, the restart cost and the checkpoint interval (Young/Daly's unless given), to first
order (scaleout.telemetry.report.expected_goodput). ``scaleout simulate scale`` prints it for the
largest GPU
count it sweeps."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from scaleout.errors import UserError
from scaleout.telemetry.report import expected_goodput, young_daly_interval_s


@dataclass(frozen=True)
class GoodputPrediction:
    nodes: int
    job_mtbf_s: float  # node MTBF / nodes
    save_stall_s: float
    restart_s: float
    interval_s: float  # training seconds between saves
    goodput: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def predict(
    nodes: int,
    node_mtbf_h: float,
    save_stall_s: float,
    restart_s: float,
    interval_s: float | None = None,
) -> GoodputPrediction:
    if nodes < 1 or node_mtbf_h <= 0:
        raise UserError(
            f"goodput prediction needs nodes >= 1 and a node MTBF > 0 h, got {nodes} nodes and "
            f"{node_mtbf_h} h"
        )
    mtbf = node_mtbf_h * 3600.0 / nodes
    tau = interval_s if interval_s is not None else young_daly_interval_s(save_stall_s, mtbf)
    tau = max(tau, 1e-3)  # a zero stall: save as often as you like, the model's limit
    return GoodputPrediction(
        nodes=nodes,
        job_mtbf_s=mtbf,
        save_stall_s=save_stall_s,
        restart_s=restart_s,
        interval_s=tau,
        goodput=expected_goodput(tau, save_stall_s, restart_s, mtbf),
    )
