"""The simulator experiments: goodput of policies, admission modes, the simulator's scaling,
elastic roles and the estimate corrections, all in the cluster simulator
(docs/benchmarks.md, docs/elastic-roles.md).

    python -m disagg_tools.experiments policies|admission|scaling|all|tables|plots
    python -m disagg_tools.experiments.elastic_roles cells|mix|arrangements|tables|plots|...
    python -m disagg_tools.experiments.tradeoff [--workloads ...] [--tables]

    experiments_cli       the first command (`__main__` runs it)
    specs                 the traces, cluster shapes and policy cases the experiments share
    simruns               one simulator run of a case, and the sweeps over cases
    tables                their Markdown tables and plots
    elastic_roles         elastic prefill/decode roles against fixed splits
    elastic_roles_report  its tables and plots
    tradeoff              what the in-flight estimate corrections cost and buy (issue 20)

Runs go through `disagg_tools.simcluster`; goodput is `disagg_tools.goodput`, the search the
replay bench uses live.
"""
