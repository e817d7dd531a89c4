"""What a process's memory is made of, from Linux and glibc: the process-level half of tools/bench_memory_estimate.py.

- `rss_bytes`, `peak_rss_bytes`, `reset_peak_rss`: /proc/self/status's VmRSS / VmHWM (and clear_refs to reset it);
  `rss_parts`: the resident set split into file-backed pages (library code and data) and anonymous ones (heap, stacks,
  anonymous mappings).
- `malloc_info`: glibc's own account (mallinfo2): bytes handed out (`in_use`, heap + mmapped chunks) and bytes it
  holds free in its arenas (`free`): what a rank has freed but glibc has not given back to the kernel.
- `RssPeakSampler`: the largest RSS seen while it runs (polled every millisecond) and glibc's figures at that moment,
  which VmHWM alone cannot give.
- `resident_bytes`: pages of a tensor's storage the kernel has actually committed (mincore): an allocation nothing
  ever touched takes address space only.
- `set_mmap_threshold`: glibc's M_MMAP_THRESHOLD, the experiment that shows the arenas' free bytes are allocator slack.

Linux and glibc only; each function says what it returns elsewhere (the bench then prints no breakdown).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from typing import Any

M_MMAP_THRESHOLD = -3  #: glibc's mallopt parameter number (malloc.h)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    """This process's resident set now."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """This process's peak resident set (VmHWM) since it started or since `reset_peak_rss`."""
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: '5' into clear_refs); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_parts() -> dict[str, int]:
    """The resident set now: `file` (pages of mapped files: shared libraries' code and data) and `anon` (heap,
    anonymous mappings, stacks), bytes."""
    return {"file": _status_kib("RssFile") * 1024, "anon": _status_kib("RssAnon") * 1024}


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


def _libc() -> Any | None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.mallinfo2.restype = _MallInfo2
        return libc
    except (OSError, AttributeError):  # not glibc, or glibc < 2.33
        return None


def malloc_info() -> dict[str, int] | None:
    """glibc's figures now: `in_use` (bytes of chunks handed out: arenas + mmapped), `free` (free bytes its arenas
    hold: freed by the program, not returned to the kernel), `mmapped`; None without glibc >= 2.33."""
    libc = _libc()
    if libc is None:
        return None
    m = libc.mallinfo2()
    return {"in_use": m.uordblks + m.hblkhd, "free": m.fordblks, "mmapped": m.hblkhd}


def set_mmap_threshold(nbytes: int) -> bool:
    """glibc's mallopt(M_MMAP_THRESHOLD, nbytes): allocations from `nbytes` up get their own mapping, returned to the
    kernel when freed (setting it also stops glibc from raising the threshold to the largest chunk freed so far, up
    to 32 MiB, after which freed tensors stay in the arenas). False without glibc."""
    libc = _libc()
    return bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, int(nbytes)) == 1)


def resident_bytes(tensor: Any) -> int:
    """Bytes of `tensor`'s (CPU) storage in resident pages (mincore; pages at the edges count whole)."""
    storage = tensor.untyped_storage()
    start, size = storage.data_ptr(), storage.nbytes()
    if not start or not size:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    base = start - start % page
    length = size + (start - base)
    pages = (length + page - 1) // page
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(base), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vec) * page


class RssPeakSampler:
    """While active: the largest RSS seen (polled every `period_s` by a thread) and, at that moment, `rss_parts` and
    `malloc_info`. The poll costs a little CPU; VmHWM stays the peak of record."""

    def __init__(self, period_s: float = 0.001) -> None:
        self.period_s, self.peak, self.at_peak = period_s, 0, {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        fd = os.open("/proc/self/statm", os.O_RDONLY)
        try:
            while not self._stop.is_set():
                rss = int(os.pread(fd, 256, 0).split()[1]) * page
                if rss > self.peak:
                    self.peak = rss
                    self.at_peak = {**rss_parts(), "malloc": malloc_info()}
                time.sleep(self.period_s)
        finally:
            os.close(fd)

    def __enter__(self) -> RssPeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
