"""Shared helpers of the benchmark scripts: timing, memory, tables. Not timed tests: scripts that print ratios."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_time(fn, device: torch.device, *, warmup: int = 2, reps: int = 10) -> float:
    """Median wall time of ``fn()`` in seconds, after ``warmup`` calls (which include any compilation)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def peak_rss(fn) -> float | None:
    """The process's peak resident set size while ``fn()`` runs, in GiB (Linux; None elsewhere).

    The kernel's high-water mark is reset first (``/proc/self/clear_refs``), so the figure is the peak
    of this call, everything the process holds included (the model, Python, torch's libraries).
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        fn()
        return None
    fn()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    return None


def peak_memory(fn, device: torch.device) -> float | None:
    """Peak GPU memory allocated during ``fn()`` beyond what was allocated before, in GiB (None on the CPU)."""
    if device.type != "cuda":
        fn()
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**30


def matmul_tflops(device: torch.device, seconds: float = 3.0) -> float:
    """The machine's measured limit: the rate of square matrix products on ``device`` (TFLOP/s), bf16 on CUDA
    (8192 x 8192), float32 on the CPU (512 x 512), over about ``seconds``."""
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    a @ b
    sync(device)
    done, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            a @ b
        sync(device)
        done += 10
    return 2 * n**3 * done / (time.perf_counter() - t0) / 1e12


def environment(device: torch.device) -> dict:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    return {"device": f"{device.type}: {name}", "torch": torch.__version__, "threads": torch.get_num_threads()}


def print_table(rows: list[dict], columns: list[str]) -> None:
    def cell(v):
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("| " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        print("| " + " | ".join(v.ljust(w) for v, w in zip(row, widths)) + " |")


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=1))
        print(f"wrote {path}")
