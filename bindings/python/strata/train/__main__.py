"""python -m strata.train: the strata-train command."""
import sys

from .loop import main

sys.exit(main())
