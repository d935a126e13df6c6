"""`python -m experiments.default_recipe`: the study of this folder (its README; the code in study.py)."""

import sys

from experiments.default_recipe.study import main

sys.exit(main(sys.argv[1:]))
