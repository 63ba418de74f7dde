"""disagg-router: sim — the simulated GPU worker (an HTTP server) and its deterministic toy model.

Import what you need from its modules (`disagg_tools.sim.worker`, `disagg_tools.sim.textgen`,
`disagg_tools.sim.worker_config`, ...):
this package imports nothing eagerly, so the pure parts (`disagg_tools.sim.textgen`) load without
aiohttp.
"""
