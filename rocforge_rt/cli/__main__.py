"""`python -m rocforge_rt.cli`: the `rocforge` command without the console script's early
SIGTERM handler (rocforge_rt/__main__.py)."""

import sys

from rocforge_rt.cli import main

sys.exit(main())
