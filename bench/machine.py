"""Facts about the machine and processes a benchmark records: usable CPUs, the machine's description, peak
memory and CPU time of this and other processes."""

from __future__ import annotations

import os
import platform
import resource
import sys
from typing import Any


def available_cpus() -> list[int]:
    """CPUs this process may run on (respects taskset/cgroups), sorted."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus_available": len(available_cpus()),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["cpu_model"] = names[0] if names else None
    except OSError:
        info["cpu_model"] = None
    try:
        import torch
        import transformers

        info["torch"] = torch.__version__
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def own_peak_rss_mib() -> float:
    """Peak resident memory of this process (Linux reports ru_maxrss in KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024 if sys.platform != "darwin" else peak / 2**20


def proc_peak_rss_mib(pid: int | None) -> float | None:
    """Peak RSS (VmHWM) of a live process, e.g. an SSD draft worker; None when unreadable."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def proc_cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system) a live process has used so far; None when unreadable."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None
