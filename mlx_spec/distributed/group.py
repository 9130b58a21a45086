"""Which group of processes this one belongs to, and which models are sharded across it.

`mlx.launch` starts one process per rank with MLX_RANK (ring, jaccl) or
Open MPI's variables set; outside such a launch there is no group and
nothing here initialises MLX's distributed engine. A target loaded by
`load_sharded` carries its group in the attribute mlx-lm's own code reads
(`sharding_group`), so the generation API can tell a sharded target apart.
"""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx

SHARDING_ATTR = "sharding_group"
LAUNCH_VARIABLES = ("MLX_RANK", "OMPI_COMM_WORLD_SIZE")


def launched() -> bool:
    """Whether this process was started by `mlx.launch` (or mpirun)."""
    return any(name in os.environ for name in LAUNCH_VARIABLES)


def launched_group() -> Optional["mx.distributed.Group"]:
    """The group of this launch when it has more than one rank, else None."""
    if not launched() or not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def sharding_group(model) -> Optional["mx.distributed.Group"]:
    """The group a target was sharded over by `load_sharded`, or None."""
    return getattr(model, SHARDING_ATTR, None)


def mark_sharded(model, group) -> None:
    """Mark the model (and the text model inside a wrapper, where MTP looks) as sharded."""
    for module in {id(m): m for m in (model, getattr(model, "language_model", model))}.values():
        object.__setattr__(module, SHARDING_ATTR, group)  # not a parameter of the model
