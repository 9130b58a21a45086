"""Which machine this is: the chip's name and the memory MLX sees (a calibration's key).

The benchmark's machine report (mlx_spec.bench.machine) reads them from here.
"""

from __future__ import annotations

import os
import platform
import subprocess

import mlx.core as mx


def chip_name() -> str:
    if platform.system() == "Darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"],
                                  capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or mx.device_info().get("device_name", "unknown")


def memory_gb() -> float:
    size = mx.device_info().get("memory_size")
    if not size:
        try:
            size = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            size = 0
    return size / 1e9
