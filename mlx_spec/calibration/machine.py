"""Which machine this is: the chip's name and the memory MLX sees (a calibration's key).

The benchmark's machine report (mlx_spec.bench.machine) reads them from here. Nothing is
run in a shell: on macOS the chip's name is asked of the C library (sysctlbyname), elsewhere
read from /proc/cpuinfo.
"""

from __future__ import annotations

import ctypes
import os
import platform

import mlx.core as mx


def sysctl_string(name: str, libc=None) -> str:
    """The string value of the sysctl `name` (`sysctl -n name`), or "" where there is none:
    not macOS, no such name, or a C library without sysctlbyname."""
    try:
        libc = libc or ctypes.CDLL(None)  # the process's own symbols: the C library's among them
        size = ctypes.c_size_t(0)
        if libc.sysctlbyname(name.encode(), None, ctypes.byref(size), None, 0) != 0:
            return ""
        value = ctypes.create_string_buffer(size.value)
        if libc.sysctlbyname(name.encode(), value, ctypes.byref(size), None, 0) != 0:
            return ""
    except (OSError, AttributeError):  # no C library to load, or no sysctlbyname in it
        return ""
    return value.value.decode(errors="replace").strip()


def chip_name() -> str:
    if platform.system() == "Darwin":
        name = sysctl_string("machdep.cpu.brand_string")
        if name:
            return name
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
