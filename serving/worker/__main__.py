"""``python -m serving.worker``: `serving.worker.cli.main`."""

import sys

from serving.worker.cli import main

sys.exit(main())
