"""Moving a worker's answer to the client: whole SSE events, counted, never cut mid-event.

    sse_cut        the pure event cutter (token counting inline)
    http_reader    the pure HTTP/1.1 response reader of the raw pool
    upstream_pool  the raw keep-alive connection pool to the decode workers (splice mode)
    splice         the relay on that pool: a worker's chunk goes to the client as it was framed
    aiohttp_relay  the same relay over an aiohttp response (the other mode, and the prefill)

It knows nothing of reservations or placement: it reports progress to an observer.
"""
