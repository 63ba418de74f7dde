"""One request's path through the router, a module per stage, in the order a request needs
them (docs/design.md §2):

    lifecycle   RequestFlow: the deadline and the one retry/resume loop over the stages
    attempt     what the stages share: the request (`Call`), one try's ask and holdings
    quota       the request's share of its tenant's quota: taken once, settled at its end
    reserve     estimate, place, queue, reserve decode room (and the stranded-KV entry)
    legs        the prefill leg, the KV handoff, the decode leg
    respond     the answer to the client: streamed, whole, or assembled (`assemble`)
    resume      the ask that continues a stream that broke mid-answer
    release     give back what a try holds and feed the estimator

It owns a request from the parsed body to its last byte; it uses the relay (`router.relay`) to
move bytes and the worker pools (`router.workers`) to know who serves.
"""
