"""`python -m experiments.side_by_side`: the study of this folder (its README; the code in study.py)."""

import sys

from experiments.side_by_side.study import main

sys.exit(main(sys.argv[1:]))
