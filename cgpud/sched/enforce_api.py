"""The small interfaces the scheduler loop plugs into.

The loop (`cgpud.sched.loop.GpuScheduler`) decides; these carry the decision
out and tell it what the instances are doing. They are called from the trio
thread, synchronously, at slice boundaries: they must be quick (well under a
millisecond: a cgroup write, a kill(2), a dictionary lookup) and must not
await or block.

Freeze/thaw contract (every backend):
- `freeze(gpu, name)`: stop the instance `name` on GPU `gpu` from using the
  GPU (cgroup freeze, SIGSTOP, a simulated GPU's gate). `thaw` undoes it.
- Calls are per (gpu, instance). The loop only calls them on a change: it
  never freezes what it has frozen or thaws what it has not frozen, and it
  assumes every instance starts thawed. A container with instances on
  several GPUs is one unit to freeze: a backend must keep it frozen while at
  least one GPU holds it frozen (count the holders), or the GPUs' schedulers
  would undo each other.
- An exception means "not done": the loop logs it and tries again at the
  next boundary. `thaw` of an instance that no longer exists must succeed
  quietly (there is nothing left to run).
- When the loop stops it thaws everything it froze. Making sure nothing stays
  frozen if the daemon dies is the backend's job (SPEC §7).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Enforcer(Protocol):
    def freeze(self, gpu: int, name: str) -> None:
        """Hold instance `name` on GPU `gpu` off the GPU."""

    def thaw(self, gpu: int, name: str) -> None:
        """Let instance `name` on GPU `gpu` run again."""


@runtime_checkable
class Activity(Protocol):
    def active(self, gpu: int, name: str) -> bool:
        """True while one of the instance's processes holds GPU `gpu` open.

        Read at every slice boundary. A detector that learns of a change
        between boundaries should call `GpuScheduler.poke()` (from the trio
        thread; from another thread through `trio.from_thread.run_sync`) so
        a high-priority instance takes the GPU at once and a newcomer is held
        off at once."""


# An Activity may also offer `snapshot() -> Mapping[(gpu, name), bool]`: the
# loop then asks once per boundary instead of once per instance.


@runtime_checkable
class UsageMeter(Protocol):
    def gpu_seconds(self, gpu: int, name: str) -> float:
        """Optional: cumulative GPU busy time (s) attributable to the instance
        (NVML per-process utilisation, the simulated GPU's own count).
        Only policy 4 uses it, to tell which of the instances running together
        takes more than its share; without a meter their time is split evenly."""
