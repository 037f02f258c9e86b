"""`python -m pdserve ...`: the same as the `pdserve` command."""

import sys

from deploy.cli import main

sys.exit(main())
