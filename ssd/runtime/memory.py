"""Device memory queries, used to size the KV cache from a fraction of what is free."""

from __future__ import annotations

import torch


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return _host_available_bytes()


def _host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); falls back to physical pages on other systems."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA allocator peak, or the resident-set high-water mark on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
