"""The compute scheduler (SPEC §5): pure policies here, the trio loop in
`cgpud.sched.loop`, the interfaces it plugs into in `cgpud.sched.enforce_api`.
Algorithms: docs/scheduler.md.

Importing this package imports only pure code (no trio, no I/O)."""
from cgpud.sched.policies import (
    EXCLUSIVE_POLICIES,
    POLICY_NAMES,
    Decision,
    GpuView,
    InstView,
    Kind,
    Params,
    Planner,
    Window,
    entitled_share,
)

__all__ = [
    "EXCLUSIVE_POLICIES",
    "POLICY_NAMES",
    "Decision",
    "GpuView",
    "InstView",
    "Kind",
    "Params",
    "Planner",
    "Window",
    "entitled_share",
]
