"""The stand-in GPU job: holds a simulated GPU open and runs fixed-size
"kernels" (a CPU loop of constant work) as fast as it is allowed to, counting
iterations. Frozen by the scheduler, it makes no progress; so its iterations per
second are its share of the GPU. Used by the tests, the benchmarks and the
README's walk-through.

With `mem`, it also holds that much simulated GPU memory of its instance
(cgpud.gpus.gpumem) from before it opens the GPU until it stops: an allocation that
does not fit raises OutOfMemoryError before anything runs.
"""
from __future__ import annotations

import json
import os
import sys
import time

KERNEL_LOOPS = 20_000  # about 0.5 ms of CPU on this kind of machine


def kernel(n: int = KERNEL_LOOPS) -> int:
    x = 0
    for i in range(n):
        x += i
    return x


def run(device: str, seconds: float, interval: float = 0.0, as_json: bool = False, out=sys.stdout,
        *, mem: int = 0, gpu: int | None = None, socket: str | None = None) -> dict:
    ctx = None
    if mem:
        from cgpud.gpus.gpumem import SimGpu

        ctx = SimGpu(gpu, socket)
        try:
            ctx.alloc(mem)
        except BaseException:
            ctx.close()
            raise
    try:
        return _run(device, seconds, interval, as_json, out, mem)
    finally:
        if ctx is not None:
            ctx.close()


def _run(device: str, seconds: float, interval: float, as_json: bool, out, mem: int) -> dict:
    opening = time.monotonic()  # (the daemon may see the open, and act on it, before open() returns)
    fd = os.open(device, os.O_RDONLY)  # "opening the GPU": the instance is active from here
    try:
        start = last = time.monotonic()
        total = since = 0
        end = start + seconds
        first = None
        while True:
            kernel()
            if first is None:
                first = time.monotonic() - start  # how soon the GPU let us run after opening it
            total += 1
            since += 1
            now = time.monotonic()
            if interval and now - last >= interval:
                if as_json:  # progress samples on the system-wide monotonic clock, to compare processes
                    print(json.dumps({"at": now, "iterations": total}), file=out, flush=True)
                else:
                    print(f"{now - start:8.2f} s  {since / (now - last):10.1f} it/s", file=out, flush=True)
                last, since = now, 0
            if now >= end:
                break
        elapsed = now - start
    finally:
        os.close(fd)
    result = {"iterations": total, "seconds": round(elapsed, 6), "it_per_s": total / elapsed,
              "first_kernel_s": round(first, 6), "opened_at": opening, "mem_bytes": mem}
    if as_json:
        print(json.dumps(result), file=out, flush=True)
    else:
        print(f"{total} iterations in {elapsed:.2f} s: {total / elapsed:.1f} it/s", file=out, flush=True)
    return result
