"""`python -m dflash27b ...`: the `dflash27b` command (its entry point, so a Ctrl-C while it loads ends as one)."""
from ._entry import main

main()
