"""disagg-router: launcher — the umbrella command and the local-cluster tooling.

The top layer: `disagg-router serve | worker | demo | bench | simulate` (`launcher.cli`), a local
cluster of child processes (`launcher.localcluster`), the demo (`launcher.demo`) and the live
validation of the simulator (`launcher.validate`). It may import every other package; nothing
imports it (tests/test_layering.py).
"""
