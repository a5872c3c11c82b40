"""Timing shared by the benchmark scripts: functions timed round-robin in one process (this
machine is noisy and shared), each reported as its median wall and process-CPU time."""
from __future__ import annotations

import contextlib
import statistics
import time

import torch


def timed_alternately(fns: dict, repeat: int, grad: bool | None = None) -> dict:
    """Median (wall ms, process-CPU ms) of each function, run round-robin after one warm-up each;
    ``grad``: run with autograd on or off (None: as the caller has it)."""
    wall = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    with contextlib.nullcontext() if grad is None else torch.set_grad_enabled(grad):
        for f in fns.values():
            f()
        for _ in range(repeat):
            for k, f in fns.items():
                t0, c0 = time.perf_counter(), time.process_time()
                f()
                wall[k].append(time.perf_counter() - t0)
                cpu[k].append(time.process_time() - c0)
    return {k: (statistics.median(wall[k]) * 1e3, statistics.median(cpu[k]) * 1e3) for k in fns}
