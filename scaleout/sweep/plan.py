"""Which runs a scaling sweep makes: world sizes -> (nodes x ranks per node, global batch) per
point.

Everything here is checked before the first rank starts, so a bad sweep fails in one line instead of
after three good points have spent their minutes.

- Weak scaling keeps the per-rank batch fixed: global batch = per-rank batch x N.
- Strong scaling keeps the global batch fixed: every N must divide it (x train.grad_accum).
- Node shape: ``nodes`` (one count per point) or ``ranks_per_node`` (the same for every point; N <=
  ranks_per_node runs on one partly filled node, as one GPU of an 8-GPU node would; larger N must be
  a multiple of it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from scaleout.config import load_config
from scaleout.config.schema import Config
from scaleout.errors import ConfigError, UserError

MODES = ("weak", "strong")


@dataclass(frozen=True)
class SweepPoint:
    world: int
    nodes: int
    ranks_per_node: int
    global_batch: int

    @property
    def per_rank_batch(self) -> int:
        return self.global_batch // self.world

    @property
    def name(self) -> str:
        """Folder name of the point, e.g. ``w004-2x2``."""
        return f"w{self.world:03d}-{self.nodes}x{self.ranks_per_node}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "per_rank_batch": self.per_rank_batch, "name": self.name}


def node_shapes(
    worlds: list[int], nodes: list[int] | None, ranks_per_node: int | None
) -> list[tuple[int, int]]:
    """(nodes, ranks per node) for each world size; see the module docstring for the rules."""
    if len(set(worlds)) != len(worlds):
        raise UserError(f"--world={','.join(map(str, worlds))}: expected each world size once")
    if nodes is not None and ranks_per_node is not None:
        raise UserError(
            "--nnodes and --nproc-per-node both given: expected one (nodes per point, or ranks per "
            "node)"
        )
    if nodes is not None:
        if len(nodes) != len(worlds):
            raise UserError(
                f"--nnodes has {len(nodes)} entries but --world has {len(worlds)}: expected one "
                "node "
                f"count per world size"
            )
        shapes = []
        for w, n in zip(worlds, nodes, strict=True):
            if w % n:
                raise UserError(
                    f"--world {w} on --nnodes {n}: world size must be a multiple of the node count"
                )
            shapes.append((n, w // n))
        return shapes
    g = ranks_per_node or 1
    if g < 1:
        raise UserError(f"--nproc-per-node={g}: expected an integer >= 1")
    shapes = []
    for w in worlds:
        if w <= g:
            shapes.append((1, w))
        elif w % g:
            raise UserError(
                f"--world {w} is not divisible by --nproc-per-node {g}: expected world sizes up to "
                f"{g} "
                f"or multiples of {g}"
            )
        else:
            shapes.append((w // g, g))
    return shapes


def plan_points(
    worlds: list[int],
    mode: str,
    batch: int,
    grad_accum: int = 1,
    nodes: list[int] | None = None,
    ranks_per_node: int | None = None,
) -> list[SweepPoint]:
    """The sweep's points, sorted by world size.

    ``batch`` is the per-rank batch for weak scaling and the global batch for strong scaling.
    """
    if mode not in MODES:
        raise UserError(f"--mode={mode!r}: expected weak or strong")
    if batch < 1:
        raise UserError(f"batch {batch}: expected an integer >= 1")
    order = sorted(range(len(worlds)), key=lambda i: worlds[i])
    worlds = [worlds[i] for i in order]
    nodes = [nodes[i] for i in order] if nodes is not None and len(nodes) == len(order) else nodes
    shapes = node_shapes(worlds, nodes, ranks_per_node)
    points = []
    for w, (n, g) in zip(worlds, shapes, strict=True):
        if mode == "weak":
            if batch % grad_accum:
                raise UserError(
                    f"--mode weak: per-rank batch {batch} is not divisible by train.grad_accum="
                    f"{grad_accum}"
                )
            gb = batch * w
        else:
            if batch % (w * grad_accum):
                bad = [x for x in worlds if batch % (x * grad_accum)]
                raise UserError(
                    f"--mode strong: global batch {batch} is not divisible by world size {w}"
                    + (f" x train.grad_accum={grad_accum}" if grad_accum > 1 else "")
                    + f" (also fails for {bad}); expected a global batch divisible by every world "
                    "size"
                )
            gb = batch
        points.append(SweepPoint(w, n, g, gb))
    return points


def default_batch(cfg: Config, mode: str) -> int:
    """Weak: the config's per-rank batch (train.global_batch / its launch world); strong:
    train.global_batch."""
    t, launch = cfg.train, cfg.launch
    if mode == "strong":
        return int(t.global_batch)
    world = launch.nnodes * launch.nproc_per_node
    if t.global_batch % world:
        raise ConfigError(
            f"train.global_batch={t.global_batch} is not divisible by the config's launch world "
            f"{launch.nnodes}x{launch.nproc_per_node}: pass --per-rank-batch"
        )
    return t.global_batch // world


def point_overrides(point: SweepPoint, steps: int, warmup: int, output_dir: str) -> list[str]:
    """Overrides appended to the user's for one point (they win over the config and the user's).

    A sweep measures throughput over a fixed number of steps: no early stop at the target,
    evaluation only at the end, no checkpoints (a point must not resume from another point's
    checkpoint).
    """
    return [
        f"train.global_batch={point.global_batch}",
        f"train.max_steps={steps}",
        f"train.timing_skip_steps={warmup}",
        f"train.eval_every={steps}",
        "train.target=null",
        "train.progress=false",
        "checkpoint.dir=null",
        "checkpoint.every_steps=0",
        f"train.output_dir={output_dir}",
    ]


def check_points(
    config: str, overrides: list[str], points: list[SweepPoint], steps: int, warmup: int
) -> None:
    """Load and validate the config of every point for its world (torus grid, BN group, batch)."""

    if steps < 1 or warmup < 0 or warmup >= steps:
        raise UserError(
            f"--steps {steps} --warmup {warmup}: expected steps >= 1 and 0 <= warmup < steps "
            f"(at least one timed step)"
        )
    for p in points:
        cfg = load_config(config, [*overrides, *point_overrides(p, steps, warmup, "/tmp/unused")])
        try:
            cfg.check_world(p.world, p.ranks_per_node)
        except ConfigError as exc:
            raise ConfigError(
                f"sweep point world {p.world} ({p.nodes} nodes x {p.ranks_per_node}): {exc}"
            ) from None
