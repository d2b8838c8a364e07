"""`python -m loader`: see `loader.cli.main`."""

import sys

from loader.cli.main import main

sys.exit(main())
