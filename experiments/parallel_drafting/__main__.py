"""`python -m experiments.parallel_drafting`: the study of this folder (its README; the code in study.py)."""

import sys

from experiments.parallel_drafting.study import main

sys.exit(main(sys.argv[1:]))
