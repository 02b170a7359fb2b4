"""`python -m trikv ...` is the `trikv` command."""

import sys

from .cli import main

sys.exit(main())
