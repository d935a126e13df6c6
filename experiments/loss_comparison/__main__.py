"""`python -m experiments.loss_comparison`: the study of this folder (its README; the code in study.py)."""

import sys

from experiments.loss_comparison.study import main

sys.exit(main(sys.argv[1:]))
