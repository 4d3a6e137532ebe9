"""``python -m serving.router``: `serving.router.cli.main`."""

import sys

from serving.router.cli import main

sys.exit(main())
