"""Which group of processes this one belongs to, and which models are sharded across it.

`mlx.launch` starts one process per rank with MLX_RANK (ring, jaccl) or
Open MPI's variables set; outside such a launch there is no group and
nothing here initialises MLX's distributed engine. A target loaded by
`load_sharded` carries its group in an attribute of its own, so the
generation API can tell a sharded target apart. (Not mlx-lm's
`sharding_group`: a text model that reads it would gather its logits when
pipelined.)
"""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx

SHARDING_ATTR = "_mlx_spec_sharding_group"
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
    """Mark the model as sharded over `group`."""
    object.__setattr__(model, SHARDING_ATTR, group)  # not a parameter of the model
