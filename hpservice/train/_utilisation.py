"""What a step achieved against what the device could do: model FLOPs, MFU and memory.

MFU (model FLOPs utilisation, PaLM appendix B) = tokens/s per rank x training FLOPs per token /
the device's peak FLOP/s. The peak comes from the vendor's dense (no sparsity) numbers for the
step's compute dtype (bf16/fp16 tensor cores, or plain fp32: torch leaves TF32 off for matmuls by
default), or, on a CPU, from a matmul probe this process runs once at start: there is no
meaningful datasheet number for "a CPU" shared with other processes and threads.
"""

from __future__ import annotations

import os
import resource
import sys
import time

import torch

# Dense peak FLOP/s by device-name fragment (first match wins: more specific names first) and dtype.
# Sources: NVIDIA's H100/H200 (SXM), A100 and L4 datasheets.
PEAK_FLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100 PCIe": {"bf16": 756e12, "fp16": 756e12, "fp32": 51e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "L4": {"bf16": 121e12, "fp16": 121e12, "fp32": 30.3e12},
}


def compute_dtype_name(mixed_precision: str) -> str:
    """The dtype the matmuls run in: ``parallelism.mixed_precision`` ("none" -> fp32)."""
    return "fp32" if mixed_precision == "none" else mixed_precision


def table_peak_flops(device_name: str, dtype: str) -> float | None:
    for fragment, peaks in PEAK_FLOPS.items():
        if fragment in device_name:
            return peaks[dtype]
    return None


_measured: dict[tuple, float] = {}  # one probe per process, dtype and thread count


def measure_cpu_peak_flops(dtype: torch.dtype = torch.float32, n: int = 512, seconds: float = 0.2) -> float:
    """FLOP/s of this process's best ``n x n`` matmul rate over ``seconds`` (after a warm-up), with
    the threads torch uses here: the roof a training step on this CPU can reach."""
    key = (dtype, n, torch.get_num_threads())
    if key not in _measured:
        _measured[key] = _probe(dtype, n, seconds)
    return _measured[key]


def _probe(dtype: torch.dtype, n: int, seconds: float) -> float:
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    out = torch.empty(n, n, dtype=dtype)
    torch.mm(a, b, out=out)
    best = float("inf")
    deadline = time.perf_counter() + seconds
    while True:
        t0 = time.perf_counter()
        for _ in range(4):
            torch.mm(a, b, out=out)
        best = min(best, (time.perf_counter() - t0) / 4)
        if time.perf_counter() > deadline:
            break
    return 2 * n**3 / best


class Utilisation:
    """Per-step FLOPs, MFU and memory of one rank."""

    def __init__(self, device: torch.device, mixed_precision: str, flops_per_token: int, flops_no_attention: int):
        self.device = device
        self.flops_per_token = flops_per_token
        self.flops_no_attention = flops_no_attention
        dtype = compute_dtype_name(mixed_precision)
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
            self.peak = table_peak_flops(name, dtype)
            self.peak_source = f"{name} {dtype} datasheet" if self.peak else f"{name}: not in the peak table"
        else:
            torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
            self.peak = measure_cpu_peak_flops(torch_dtype)
            self.peak_source = f"CPU {dtype} matmul probe ({torch.get_num_threads()} threads)"

    def start_step(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)  # the peaks below are this step's

    def record(self, tokens_per_s_per_rank: float) -> dict:
        achieved = self.flops_per_token * tokens_per_s_per_rank
        out = {
            "flops_per_token": self.flops_per_token,
            "flops_per_token_no_attention": self.flops_no_attention,
            "achieved_tflops_per_rank": achieved / 1e12,
            "peak_tflops_per_rank": self.peak / 1e12 if self.peak else None,
            "mfu": achieved / self.peak if self.peak else None,
            "mfu_no_attention": self.flops_no_attention * tokens_per_s_per_rank / self.peak if self.peak else None,
        }
        if self.device.type == "cuda":
            out["peak_memory_allocated_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            out["peak_memory_reserved_gib"] = torch.cuda.max_memory_reserved(self.device) / 2**30
        rss = rss_bytes()
        out["rss_gib"] = rss / 2**30
        out["peak_rss_gib"] = max(rss, max_rss_bytes()) / 2**30  # the kernel's high-water mark lags
        return out


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Current resident set size (Linux ``/proc/self/statm``); the peak elsewhere."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return max_rss_bytes()


def max_rss_bytes() -> int:
    """The resident set's high-water mark (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib if sys.platform == "darwin" else kib * 1024
