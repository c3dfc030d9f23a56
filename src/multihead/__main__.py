"""`python -m multihead` runs the short tour (or any subcommand: `python -m multihead plan ...`)."""

import sys

from multihead.cli import main

sys.exit(main(sys.argv[1:] or ["tour"]))
