"""`python3 -m pd_verify`: the command line (cli.main).

Exit 0: every enforced step passed; 1: a step failed; 2: bad input.
"""

import sys

from .cli import main

sys.exit(main())
