"""Load, soak and hostile runs: a crowd, hours of faults, or wrong length estimates through
the router on loopback, against simulated workers and a Redis, each with invariants that fail
the run (docs/reliability.md).

    python -m disagg_tools.loadgen.load --burst 2000        a crowd: every answer exact or 429
    python -m disagg_tools.loadgen.soak --minutes 10        trace traffic while things fail
    python -m disagg_tools.loadgen.hostile shift|hint-flood issue 20's reproduction

    load, soak, hostile  the three commands
    loadclient           the crowd's client: requests whose answers are known in advance
    load_cluster         workers + router + Redis for load and soak
    hostile_cluster      the hostile runs' cluster (replicas, `both` workers, the store sampler)
    hostile_clients      hogs, hint floods and the normal clients beside them
    hostile_report       the hostile runs' tables
    probes               the router's metrics, Redis counters, RSS samples, quiet waits
    entry                what every command does around its run (limits, report, exit code)

The router, the workers and Redis are subprocesses (`disagg_tools.procs.Child`): nothing here
imports the router.
"""
