"""What a container asks of cgpud, and how much memory that is on a GPU.
Pure and synchronous: envspec fills a `Request` in from the environment,
placement turns it into GPUs and memsizes; both import it from here.

`Sizing` says how many bytes a request takes on a given GPU: `units` × `unit`
bytes, or — with ALIYUN_COM_GPU_MEM_DEV — the device's total × units ÷ dev,
rounded down to a byte. Multi-GPU: N units over M GPUs is N/M units on each;
N/M must be whole (`split`, `UnevenSplit`). See docs/containers.md.
"""
from __future__ import annotations

from dataclasses import dataclass

from cgpud.core.model import InvalidValue

MIB = 1 << 20
GIB = 1 << 30
SHARE_UNIT = 128 * MIB


class UnevenSplit(InvalidValue):
    """N units over M GPUs where N/M is not whole: EINVAL."""


def unit_name(unit: int) -> str:
    if unit == GIB:
        return "GiB"
    if unit % MIB == 0:
        return f"× {unit // MIB} MiB"
    return f"× {unit} bytes"


def mib(n: int) -> str:
    """Bytes as MiB for a message, rounded DOWN (never shows more than there is)."""
    if n % MIB == 0:
        return f"{n // MIB} MiB"
    hundredths = n * 100 // MIB
    return f"{hundredths // 100}.{hundredths % 100:02d} MiB"


@dataclass(frozen=True)
class Sizing:
    """How much one GPU's instance asks: `units` allocation units of `unit`
    bytes, or with `dev` (ALIYUN_COM_GPU_MEM_DEV, in the same units) the
    fraction units/dev of whatever the device has."""

    units: int
    unit: int = GIB
    dev: int | None = None

    def __post_init__(self) -> None:
        for what, v in (("units", self.units), ("unit", self.unit)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if what == "units" else 1):
                raise ValueError(f"Sizing.{what} must be a whole number ({v!r})")
        if self.dev is not None and (isinstance(self.dev, bool) or not isinstance(self.dev, int) or self.dev < 1):
            raise ValueError(f"Sizing.dev must be None or a whole number >= 1 ({self.dev!r})")

    def memsize(self, device_memory: int) -> int:
        """Bytes on a GPU of `device_memory` bytes (floor, in bytes)."""
        if self.dev is None:
            return self.units * self.unit
        return device_memory * self.units // self.dev

    def __str__(self) -> str:
        if self.dev is None:
            return f"{self.units} {unit_name(self.unit)}"
        return f"{self.units}/{self.dev} of the GPU"


def split(total: Sizing, count: int) -> Sizing:
    """N units over M GPUs -> N/M units on each; refused unless whole."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise UnevenSplit(f"a request is spread over 1 or more GPUs, not {count!r}")
    if total.units % count:
        raise UnevenSplit(
            f"{total.units} {unit_name(total.unit)} over {count} GPUs is not a whole number per GPU "
            f"({total.units}/{count}); ask a multiple of {count}"
        )
    return Sizing(total.units // count, total.unit, total.dev)


@dataclass(frozen=True)
class Share:
    """One instance the container asks for, on a GPU it named."""

    gpu: int  # index
    memsize: int  # bytes
    units: int  # its ALIYUN_COM_GPU_MEM_CONTAINER value, in allocation units


@dataclass(frozen=True)
class Request:
    """What a container asks of cgpud.

    managed False: leave the container alone (`reason` says why); every other
    field is empty/default. managed True, then exactly one of:
      - `shares` non-empty: the GPUs it named with their memsizes, in the order
        named (its ALIYUN_COM_GPU_MEM_CONTAINER list applies in this order);
        `count` is 0 and `sizing` None;
      - `shares` empty: the daemon picks `count` GPUs (placement.resolve),
        each instance of `sizing` (already N/M per GPU).
    `passthrough`: GPUs the container sees whole, with no instance and no
    limit (named by NVIDIA_VISIBLE_DEVICES only, or given 0), ascending.
    `policy2`: the weight is above 1, so each GPU with one of these instances
    switches to policy 2; the caller applies it.
    """

    managed: bool
    reason: str = ""
    shares: tuple[Share, ...] = ()
    passthrough: tuple[int, ...] = ()
    count: int = 0
    sizing: Sizing | None = None
    unit: int = GIB
    weight: int = 1
    policy2: bool = False
    highprio: bool = False
    # core_mem: the compute percentage (ALIYUN_COM_GPU_CORE_PERCENTAGE), a multiple of 5 from 5 to 100;
    # its instances get policy 3 with 20 slots of 5 % each (weight = percentage / 5). None: not asked.
    percentage: int | None = None
    pod_units: int | None = None

    @property
    def gpus(self) -> tuple[int, ...]:
        """The named GPUs that get an instance (empty when the daemon picks)."""
        return tuple(s.gpu for s in self.shares)
