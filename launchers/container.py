"""launch.container as srun options: what puts a step's tasks in a container, for `scaleout slurm
run` (every srun it starts) and submitit (its srun line). docs/launchers.md, "Containers"."""

from __future__ import annotations

from scaleout.config.schema import ContainerConfig


def srun_args(container: ContainerConfig) -> list[str]:
    """pyxis's --container-* options or Slurm's --container=<bundle>, values exactly as given."""
    if container.bundle:
        return [f"--container={container.bundle}"]
    if not container.image:
        return []
    pyxis = {  # after --container-image, in this order
        "mounts": container.mounts,
        "workdir": container.workdir,
        "env": container.env,
    }
    return [f"--container-image={container.image}"] + [
        f"--container-{key}={value}" for key, value in pyxis.items() if value
    ]
