"""`python -m disagg_tools.experiments`: the policy, admission and scaling experiments and
their tables (`disagg_tools.experiments.experiments_cli`)."""

from disagg_tools.experiments.experiments_cli import main

if __name__ == "__main__":
    raise SystemExit(main())
