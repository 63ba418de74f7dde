"""disagg-router: launcher — the umbrella command and the local-cluster tooling.

The top layer: `disagg-router serve | worker | demo | bench | simulate`
(`disagg_tools.launcher.main`), a local
cluster of child processes (`disagg_tools.launcher.localcluster`), the demo
(`disagg_tools.launcher.demo`) and the live
validation of the simulator (`disagg_tools.launcher.validate`). It may import every other package;
nothing
imports it (tests/architecture/test_layering.py).
"""
