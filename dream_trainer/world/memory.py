"""Memory readings behind `DistributedWorld.memory_status`: the caching allocator's counters
on CUDA, the process's resident set everywhere. Host reads only, never a device sync."""

from __future__ import annotations

import functools
import os
import resource
import sys
from dataclasses import dataclass

import torch

MB = 2**20

_status_fd: tuple[int, int] | None = None  # (pid, descriptor) of /proc/self/status, kept open
_statm_fd: tuple[int, int] | None = None  # (pid, descriptor) of /proc/self/statm, kept open


@dataclass(frozen=True)
class MemoryStatus:
    """The memory of one device and of this process at one moment, in bytes.

    On CUDA the device fields are the caching allocator's counters
    (``torch.cuda.memory_stats``: host-side, no device sync). On every other device they are
    the process's resident set: on CPU, tensors live in the process's memory.

    Attributes:
        device: the device read.
        allocated: CUDA: bytes held by tensors. Else: the process's resident set (`rss`).
        reserved: CUDA: bytes the caching allocator holds (`allocated` plus its cache).
            Else: `rss`.
        peak_allocated: the highest `allocated` since the process started or the last
            ``world.reset_peak_memory()``. Else: `peak_rss`.
        peak_reserved: the same for `reserved`. Else: `peak_rss`.
        rss: the process's resident set (on every device; Linux ``VmRSS``).
        peak_rss: its highest value (Linux ``VmHWM``) since the process started or the last
            reset. Where the OS has no ``/proc`` it is ``getrusage``'s peak, which cannot be
            reset, and `rss` is that peak too.
        total: CUDA: the device's memory. Else: the host's physical memory (None: unknown).
    """

    device: torch.device
    allocated: int
    reserved: int
    peak_allocated: int
    peak_reserved: int
    rss: int
    peak_rss: int
    total: int | None

    @property
    def fragmentation(self) -> float:
        """``(reserved - allocated) / reserved``: the share of the reserved memory that the
        allocator holds but no tensor uses (0 when nothing is reserved)."""
        return (self.reserved - self.allocated) / self.reserved if self.reserved else 0.0

    def mb(self) -> dict[str, float]:
        """Every byte count in MiB, keyed ``<field>_mb`` (``total_mb`` only when known)."""
        names = ("allocated", "reserved", "peak_allocated", "peak_reserved", "rss", "peak_rss", "total")
        return {f"{name}_mb": getattr(self, name) / MB for name in names if getattr(self, name) is not None}


def process_memory() -> tuple[int, int]:
    """``(rss, peak rss)`` of this process in bytes: Linux ``/proc/self/status`` (a pread of a
    descriptor kept open, about 10 µs); elsewhere ``getrusage``'s peak for both."""
    global _status_fd
    try:
        if _status_fd is None or _status_fd[0] != os.getpid():  # first call, or a forked child
            _status_fd = (os.getpid(), os.open("/proc/self/status", os.O_RDONLY))
        data = os.pread(_status_fd[1], 16384, 0)
        return _kib(data, b"VmRSS:"), _kib(data, b"VmHWM:")
    except (OSError, ValueError, AttributeError):  # no /proc (macOS), no pread (Windows)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        peak = peak if sys.platform == "darwin" else peak * 1024
        return peak, peak


def _kib(data: bytes, field: bytes) -> int:
    start = data.index(field) + len(field)
    return int(data[start : data.index(b"kB", start)]) * 1024


def allocated_bytes(device: torch.device) -> int:
    """`MemoryStatus.allocated` alone, for a sample taken often: on CUDA the caching
    allocator's counter (``torch.cuda.memory_allocated``: no syscall, no sync), elsewhere the
    resident set from Linux ``/proc/self/statm`` (one small pread of a descriptor kept open;
    ``/proc/self/status``, which `process_memory` reads for the peak too, costs the kernel
    more) or, without ``/proc``, `process_memory`."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    global _statm_fd
    try:
        if _statm_fd is None or _statm_fd[0] != os.getpid():  # first call, or a forked child
            _statm_fd = (os.getpid(), os.open("/proc/self/statm", os.O_RDONLY))
        return int(os.pread(_statm_fd[1], 256, 0).split()[1]) * _page_size()
    except (OSError, ValueError, AttributeError, IndexError):
        return process_memory()[0]


@functools.cache
def _page_size() -> int:
    return os.sysconf("SC_PAGE_SIZE")


@functools.cache  # the host's physical memory does not change while the process runs
def _host_total() -> int | None:
    try:
        return _page_size() * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, OSError, ValueError):
        return None


def read_memory_status(device: torch.device) -> MemoryStatus:
    """The `MemoryStatus` of `device` (see `DistributedWorld.memory_status`)."""
    rss, peak_rss = process_memory()
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)  # one call: the allocator's host-side counters
        return MemoryStatus(
            device=device,
            allocated=stats.get("allocated_bytes.all.current", 0),
            reserved=stats.get("reserved_bytes.all.current", 0),
            peak_allocated=stats.get("allocated_bytes.all.peak", 0),
            peak_reserved=stats.get("reserved_bytes.all.peak", 0),
            rss=rss,
            peak_rss=peak_rss,
            total=torch.cuda.get_device_properties(device).total_memory,
        )
    peak = max(peak_rss, rss)
    return MemoryStatus(device=device, allocated=rss, reserved=rss, peak_allocated=peak, peak_reserved=peak,
                        rss=rss, peak_rss=peak, total=_host_total())


def reset_peak_memory(device: torch.device) -> bool:
    """Reset the peaks: the device's on CUDA (``torch.cuda.reset_peak_memory_stats``) and
    the process's peak resident set (Linux: ``5`` written to ``/proc/self/clear_refs``).
    Returns whether the process's peak could be reset (False elsewhere, or when the
    kernel refuses: it then stays the peak since the process started)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False
