"""`python -m arbiterd`, the same as the `arbiterd` command."""

import sys

from arbiterd.cli.main import main

sys.exit(main())
