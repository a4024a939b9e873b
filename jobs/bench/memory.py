"""Peak memory of a cell, by the best method this machine offers (named in `method`).

On CUDA `torch.cuda.max_memory_allocated` after a reset; on Linux the process RSS high-water mark
(VmHWM), reset through /proc/self/clear_refs before the cell; elsewhere getrusage's maxrss (process
lifetime, so only growth shows). RSS includes every model copy the bench holds, so compare cells with
each other, not with a deployment.
"""
from __future__ import annotations

import re
import resource
from pathlib import Path

import torch


class PeakMemory:
    def __init__(self, device: torch.device):
        self.device, self.baseline = device, 0.0
        if device.type == "cuda":
            self.method = "cuda max_memory_allocated"
        elif self._clear_refs():
            self.method = "process RSS high-water (VmHWM, reset per cell)"
        else:
            self.method = "process ru_maxrss (lifetime)"

    @staticmethod
    def _clear_refs() -> bool:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # Linux: resets VmHWM to the current RSS
            return True
        except OSError:
            return False

    def reset(self) -> None:
        """Start a cell: forget the old peak and remember what was in use already (for peak_delta_mb)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        elif self.method.startswith("process RSS"):
            self._clear_refs()
        self.baseline = self.current_mb()

    def current_mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated() / 2**20
        status = Path("/proc/self/status")
        match = re.search(r"VmRSS:\s+(\d+) kB", status.read_text()) if status.exists() else None
        return int(match.group(1)) / 1024 if match else 0.0

    def delta_mb(self) -> float:
        """The cell's own working memory: its peak over what was in use when it started."""
        return max(0.0, self.peak_mb() - self.baseline)

    def peak_mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated() / 2**20
        if self.method.startswith("process RSS"):
            match = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
            if match:
                return int(match.group(1)) / 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
