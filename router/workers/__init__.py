"""The workers behind the router, as placement sees them.

    worker_spec      a worker's configuration (URL, role, model, layout, secrets masked)
    worker_state     one worker as this replica sees it (health, load, what is placed on it)
    membership       who is in the pools, joining and leaving, which pool each is in
    accounting       this replica's own count of what it puts on the workers
    placement_view   the snapshot placement policies decide on
    pools            the three above behind one name, for a request's stages
    loop_timing      when the background loops wake (a shared beat, the quiet cadence)
    health_probe     each worker's health and KV layout
    load_poller      the workers' own load reports
    registry         the registry sync: workers registered through any replica
    refresher        every replica's reservations and stranded KV, from the store
    store_loss       a store that lost its data, noticed and put back
    stranded_reaper  stranded KV past its lease, dropped
    discovery        what workers report about themselves (load, layout, facts)
    breaker          the per-worker circuit breaker (answers judged, not only statuses)
    drain            draining a worker out of rotation
    rotation         who is in rotation per pool, and why a worker is not
    prefixes         prompt prefix hashes for cache affinity
    kv_events        each worker's KV-event stream into its index (gaps, replays, restarts)
    kv_batches       one batch into an index, within the limits, sharing the loop
    kv_limits        what a worker's events may cost a replica (bounds, refusals, loop turns)
    kv_index         one worker's prefix cache by the router's block names, from its events
    kv_wire          vLLM's KV-event wire format, decoded
    role_signals     the live signals the role policy reads

Each loop is built where the app is assembled (router/edge/app.py) and given the pieces it uses;
none builds another.

It knows nothing of one request's path: the request package asks it who serves.
"""
