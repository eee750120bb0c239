"""`python -m arbiterd.worker --fd N --config JSON`: how the daemon starts a worker."""

import sys

from arbiterd.worker.loop import main

sys.exit(main())
