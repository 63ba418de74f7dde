"""`python -m disagg_tools.overhead`: the ladder, the saturation phase and (`--idle-s N`) the
idle phase, then the tables (`disagg_tools.overhead.overhead_cli`)."""

import sys

from disagg_tools.overhead.overhead_cli import main

if __name__ == "__main__":
    sys.exit(main())
