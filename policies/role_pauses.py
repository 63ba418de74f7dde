"""How long a `both` worker is out of both pools between its drain and its first work in the new
role, by engine kind: one table for the live role manager (router/control/role_manager.py, which
holds
the worker out that long) and the simulator (disagg_tools/simcluster), so the policy is tuned on
the pause it will meet (issue 26).

- **vllm** (kv_both): 0. Both roles are served by the same engine; a role is the router's
  per-request choice of which leg to send, so nothing restarts.
- **sglang**: SGLang's `POST /pd_role_switch` (sglang 0.5.23, `--enable-pd-role-switch`)
  rebuilds the scheduler's disaggregation side and the bootstrap registration: 1.3-1.5 s
  measured on CPU with a tiny model (docs/real-sglang.md, "the runtime role switch"); on a GPU
  the KV pool and CUDA graphs are re-made, so a few seconds: 2 s here, to be set per
  deployment from `disagg_router_engine_role_switch_seconds`.
- **sim** (the simulated worker): 0 unless a test asks for more; **mooncake** as vllm.

Configured as `roles.reconfig_pause_s`: a number for every kind, or {kind: seconds} over these.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

__all__ = ["ENGINE_RECONFIG_PAUSE_S", "reconfig_pauses"]

ENGINE_RECONFIG_PAUSE_S: Mapping[str, float] = {
    "vllm": 0.0,
    "sglang": 2.0,
    "sim": 0.0,
    "mooncake": 0.0,
}


def reconfig_pauses(given: object) -> dict[str, float]:
    """The table in force: the defaults, overridden by `given` (None, a number for every kind,
    or {kind: seconds}). Raises ValueError for a negative, non-finite or non-number pause."""
    table = dict(ENGINE_RECONFIG_PAUSE_S)
    if given is None:
        return table
    if isinstance(given, Mapping):
        updates = {str(k): _seconds(v, f"reconfig_pause_s.{k}") for k, v in given.items()}
        return table | updates
    pause = _seconds(given, "reconfig_pause_s")
    return {kind: pause for kind in table}


def _seconds(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"roles: {name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"roles: {name} must be >= 0 and finite, got {value!r}")
    return float(value)
