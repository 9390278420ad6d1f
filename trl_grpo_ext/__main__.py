"""`python -m trl_grpo_ext ...`: the `trl-grpo-ext` command line (`cli.py`)."""

import sys

from .cli import main

sys.exit(main())
