"""The replay bench: replays a request trace open loop against any OpenAI-compatible endpoint
and reports latency, SLO attainment and goodput (docs/benchmarks.md).

    disagg-router bench --url URL --trace FILE [--rate-scale X] [--search] ...
    python -m disagg_tools.replay.replay_cli ...       the same, without the umbrella CLI

    replay_cli     the command line and the live goodput search (`add_bench_arguments`,
                   `run_bench`: `disagg_tools.launcher.main` mounts them)
    replayer       the open-loop replayer, one record per request
    replay_report  summaries, Markdown and text tables, CDF and attainment plots
    calibration    what the simulator's validation against a live replay needs from this side
                   (`disagg_tools.launcher.validate` runs it)

The traces are `disagg_tools.traces`, the search `disagg_tools.goodput`. It imports nothing of
the router.
"""
