"""`python -m pdserve ...`: the same as the `pdserve` command."""

import sys

from pdserve.cli import main

sys.exit(main())
