"""Run a module as `python -m MODULE` would, with the arena's aging period set to AGING_S.

    aged.py AGING_S MODULE [ARG...]      e.g. aged.py 3 arbiterd run --priority batch -- CMD

Every process of an arena must order the queue with the same aging period
(arbiterd/arena/records.py), so a test that ages classes in seconds instead of minutes sets it
in each process it starts.
"""

from __future__ import annotations

import runpy
import sys

from arbiterd.arena import records


def main() -> None:
    records.PRIORITY_AGING_S = float(sys.argv[1])
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
