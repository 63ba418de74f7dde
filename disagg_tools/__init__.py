"""The tools around the router, in one namespace so that installing the project adds no generic
top-level names (`bench`, `sim`, ...) to site-packages: the simulated GPU worker (`sim`), the
cluster simulator (`simcluster`), the benchmarks, the `disagg-router` command with its local
cluster and demo (`launcher`), and the uvloop start-up the tool processes share (`uvrun`).

The product is `router` (with `policies` and `state`); nothing in it imports this package.
"""
