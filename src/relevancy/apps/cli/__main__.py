"""`python -m relevancy.apps.cli`: the command line."""
from . import entry_point

entry_point()
