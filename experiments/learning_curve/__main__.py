"""`python -m experiments.learning_curve`: the study of this folder (its README; the code in study.py)."""

import sys

from experiments.learning_curve.study import main

sys.exit(main(sys.argv[1:]))
