"""The overhead benchmark: what a router adds to TTFT, inter-token gaps and CPU, against a
client that makes the two PD calls itself, and what it costs idle (docs/benchmarks-overhead.md).

    python -m disagg_tools.overhead [--targets baseline,ours,ours_dropin,sglang,vllm] ...
                                      the ladder, the saturation phase, `--idle-s N` the idle
                                      phase too
    python -m disagg_tools.overhead.idle [--targets ours,ours_dropin,vllm]      the idle phase
    python -m disagg_tools.overhead.saturation [--targets ours_redis,ours_dropin,vllm]
                                      req/s one router core sustains at TTFT p99 <= 50 ms
                                      added (issue 36): open loop, ladder then bisection
    python -m disagg_tools.overhead.fixed_worker --role prefill|decode --port N the stand-in
                                      worker both start

    overhead_cli     the command line of the ladder
    ladder           the ladder and saturation phases, round by round over every target
    idle             the idle phase (its own command line too)
    saturation       the sustained rate (its own command line, the shared flags of overhead_cli)
    targets          starting the stand-in workers and each router under test
    measure          one measured run and the CPU around it; the summary over rounds
    overhead_client  the load generator (raw asyncio keep-alive HTTP/1.1)
    overhead_report  percentiles, deltas from the baseline, the Markdown tables
    fixed_worker     the stand-in worker: fixed token timing whatever the load

Routers and workers are subprocesses (`disagg_tools.procs.Child`): nothing here imports the
router.
"""
