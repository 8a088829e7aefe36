"""What the planner (cgpud.sched.policies) is given and gives back: the policies' numbers, a GPU's
view at one boundary (GpuView, InstView), the parameters (Params), a decision (Decision) and a
decision planned ahead (Ahead). Plain values: nothing here plans, reads a clock or keeps state."""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from functools import cached_property

FAIR, PREEMPTIVE, WEIGHTED, FIXED, WEAK, NATIVE = range(6)
POLICY_NAMES = ("fair", "preemptive", "weighted", "fixed", "weak", "native")
EXCLUSIVE_POLICIES = frozenset({FAIR, PREEMPTIVE, WEIGHTED, FIXED})

WASTE = ""  # ring key of the slots nobody holds (no instance has an empty name)

NORMAL = "normal"
PRIO = "prio"


class Kind(str, enum.Enum):
    """What a decision is, for accounting, telemetry and the timeline."""

    SLOT = "slot"  # a ring slot of one instance (it may be idle: its time is then wasted)
    WASTE = "waste"  # a ring slot nobody holds: the GPU is left idle on purpose
    IDLE = "idle"  # nobody to run at all
    PRIO = "prio"  # high-priority group, counted against prio_ratio
    FILL = "fill"  # capped high-priority group using time nobody else wants
    WEAK = "weak"  # policy 4: the instances under their share, together
    NATIVE = "native"  # policy 5: everyone


@dataclass(frozen=True)
class InstView:
    name: str
    weight: int
    highprio: bool
    active: bool


@dataclass(frozen=True)
class GpuView:
    """What the planner needs to know about one GPU at one boundary."""

    policy: int
    max_inst: int
    prio_ratio: int  # percent
    instances: tuple[InstView, ...] = ()

    @cached_property
    def names(self) -> frozenset[str]:
        return frozenset(i.name for i in self.instances)

    @cached_property
    def active_names(self) -> frozenset[str]:
        return frozenset(i.name for i in self.instances if i.active)


@dataclass(frozen=True)
class Params:
    """slice: the base slice X (s). window: the sliding window (s) over which
    policy 4 measures shares and prio_ratio is capped; keep it >> slice."""

    slice: float = 0.010
    window: float = 1.0
    # Give a holder its whole run of consecutive slots (policy 2's w slices,
    # the wasted slots of policies 0 and 3) as one decision: the same shares
    # and switches, far fewer wake-ups. Settings changes still apply at once
    # (the daemon wakes its schedulers on every change).
    merge_runs: bool = False
    # Gated instances (libcgpu): under a controlled policy a process keeps at most this much GPU
    # work (s) queued ahead per stream, so a closing's drain lasts about this long
    # (docs/scheduler.md, "Queued work"). Each drain bound (max_slice) the processes that cannot
    # answer are given up on; one alive and draining is waited for up to drain_cap (s) if set:
    # libcgpu answers within its own drain bound whatever the application does, so only an older
    # library (no deadline on its drain) would need more. None (the default): one drain bound —
    # "draining" is what a slot of the page says, and the page is the tenant's to write
    # (docs/security.md, "Pages"): nothing it writes holds a neighbour past one bound.
    queue_budget: float = 0.002
    drain_cap: float | None = None
    # When the switcher opens the next gate: "drain" (once the stopped instance's queued work is
    # done), "ahead" (switch_lead before its drain is expected to end), "overlap" (at the closing;
    # docs/scheduler.md, "Switches").
    switch: str = "drain"
    switch_lead: float = 0.0005

    def __post_init__(self) -> None:
        if not (self.slice > 0 and math.isfinite(self.slice)):
            raise ValueError(f"slice must be a positive number of seconds, not {self.slice!r}")
        if not (0 < self.queue_budget <= 1):
            raise ValueError(f"queue_budget must be more than 0 and at most 1 s, not {self.queue_budget!r}")
        if self.switch not in ("drain", "ahead", "overlap"):
            raise ValueError(f"switch must be drain, ahead or overlap, not {self.switch!r}")
        if self.drain_cap is not None and not (self.drain_cap >= self.slice and math.isfinite(self.drain_cap)):
            raise ValueError(f"drain_cap ({self.drain_cap!r} s) must be at least a slice ({self.slice} s)")
        if not (self.window >= 2 * self.slice and math.isfinite(self.window)):
            raise ValueError(f"window ({self.window!r} s) must be at least two slices ({self.slice} s)")

    @cached_property  # (frozen: worked out once; read several times a slice)
    def min_slice(self) -> float:
        return self.slice / 4

    @cached_property
    def max_slice(self) -> float:
        return self.slice * 2

    @cached_property
    def drain_limit(self) -> float:
        """How long a closing's drain is waited for in all: one drain bound unless drain_cap says more."""
        return self.max_slice if self.drain_cap is None else max(self.drain_cap, self.max_slice)

    @cached_property
    def credit_bound(self) -> float:
        return self.slice * 2


@dataclass(frozen=True)
class Decision:
    """Who may use the GPU from `start` (the planning time) until `until`.

    running:    may use the GPU (for a ring slot: the holder, active or not).
    active:     the members of `running` that were active when planned: the
                ones really given GPU time (telemetry counts these).
    considered: every instance that was active with weight > 0 when planned
                (lets the planner notice newcomers mid-slice).
    """

    running: frozenset[str]
    until: float
    start: float
    kind: Kind
    group: str | None = None  # NORMAL or PRIO for ring and weak decisions
    holder: str | None = None  # the ring key for SLOT/WASTE (and ring-scheduled PRIO/FILL)
    active: frozenset[str] = frozenset()
    considered: frozenset[str] = frozenset()
    paused: frozenset[str] = frozenset()  # policy 4: active, over their share, held
    along: frozenset[str] = frozenset()  # high-priority instances let run beside a normal slot (light ones)

    @property
    def length(self) -> float:
        return self.until - self.start


@dataclass(eq=False)
class Ahead:
    """A decision planned ahead (Planner.plan_ahead): where the ring was
    before it, what planning it (and charging its planned length) changed
    its holder's credit by, its number (which one is the ring's latest), and
    the time charged for it so far: its length, and, once the next step is
    planned and is another holder's, the tail its queued work is expected
    to drain for after its slot (`tail`; `followed`: another holder's step
    was planned after it)."""

    decision: Decision
    position: tuple
    delta: float
    seq: int
    charged: float
    before: "Ahead | None" = None  # the step planned before it (whose tail planning it charged)
    tail: float = 0.0
    followed: bool = False
    absorbed: float = 0.0  # (policy 3: what planning it charged the wasted slots, Planner._absorb)
