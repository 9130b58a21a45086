"""The machine: chip, MLX device, memory, the BLAS library MLX really loaded, versions.

`blas_library()` runs a matmul first (so a lazily loaded BLAS is mapped) and
then reads /proc/self/maps; on macOS MLX's CPU path uses Accelerate and the
GPU path Metal, so no maps file is needed there. The chip's name and the
memory come from mlx_spec.calibration.machine (a calibration's key reads them too).
"""

from __future__ import annotations

import os
import platform
import re
from dataclasses import dataclass
from importlib import metadata

import mlx.core as mx

from ..calibration.machine import chip_name, memory_gb

BLAS_PATTERN = re.compile(
    r"lib(openblas\w*|blis\w*|mkl_\w+|blas|cblas|flexiblas|satlas|tatlas|atlas|armpl\w*|"
    r"accelerate)[.\w-]*\.so[.\d]*|Accelerate\.framework",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class MachineInfo:
    chip: str
    os: str
    mlx_device: str
    memory_gb: float
    cpu_count: int
    blas: str
    mlx_version: str
    mlx_lm_version: str
    python: str


def blas_library() -> str:
    """Names of the BLAS/LAPACK libraries mapped into this process, or a sentence why not."""
    a = mx.random.normal((64, 64), stream=mx.cpu)
    mx.eval(a @ a)  # make sure the BLAS is loaded before looking
    if platform.system() == "Darwin":
        return "Accelerate (macOS)"
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return "unknown (no /proc/self/maps)"
    found = sorted({os.path.basename(m.group(0)) for m in BLAS_PATTERN.finditer(maps)})
    return ", ".join(found) if found else "none found (BLAS statically linked into MLX or absent)"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine_info() -> MachineInfo:
    device = mx.default_device()
    name = mx.device_info().get("device_name", "")
    return MachineInfo(
        chip=chip_name(),
        os=f"{platform.system()} {platform.release()}",
        mlx_device=f"{device.type.name}{f' ({name})' if name else ''}",
        memory_gb=round(memory_gb(), 1),
        cpu_count=os.cpu_count() or 0,
        blas=blas_library(),
        mlx_version=mx.__version__,
        mlx_lm_version=_version("mlx-lm"),
        python=platform.python_version(),
    )
