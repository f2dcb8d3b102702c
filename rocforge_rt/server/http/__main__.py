"""`python -m rocforge_rt.server.http`: the HTTP front (command.py)."""

import sys

from rocforge_rt.server.http.command import main

sys.exit(main())
