"""The workers behind the router, as placement sees them.

    worker_spec   a worker's configuration (URL, role, model, layout, secrets masked)
    discovery     where the worker list comes from (static, a file, DNS)
    pools         membership, the registry sync, load polling and the placement snapshot
    health_probe  each worker's health and KV layout
    breaker       the per-worker circuit breaker (answers judged, not only statuses)
    drain         draining a worker out of rotation
    rotation      who is in rotation per pool, and why a worker is not
    prefixes      prompt prefix hashes for cache affinity
    role_signals  the live signals the role policy reads

It knows nothing of one request's path: the request package asks it who serves.
"""
