"""`python -m cli ...` is the `fedserve` command."""

import sys

from cli.main import main

sys.exit(main())
