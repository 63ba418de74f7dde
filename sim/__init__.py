"""disagg-router: sim — the simulated GPU worker (an HTTP server) and its deterministic toy model.

Import what you need from its modules (`sim.worker`, `sim.textgen`, `sim.worker_config`, ...):
this package imports nothing eagerly, so the pure parts (`sim.textgen`) load without aiohttp.
"""
