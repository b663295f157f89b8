"""`python -m relevancy.cli`: the command line."""
from . import main

raise SystemExit(main())
