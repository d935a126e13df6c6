"""`python -m experiments.long_context`: the study of this folder (its README; the code in study.py)."""

import sys

from experiments.long_context.study import main

sys.exit(main(sys.argv[1:]))
