"""disagg-router: simcluster — the discrete-event cluster simulator (pure: no sockets, no clock).

It runs the router's own policies and estimators (`policies/`) against simulated prefill and
decode pools; the entry points are `disagg_tools.simcluster.engine.simulate` and `disagg-router
simulate`
(`disagg_tools.simcluster.simulate_cli`). Importing it loads neither aiohttp, redis nor
prometheus_client
(tests/architecture/test_layering.py).
"""
