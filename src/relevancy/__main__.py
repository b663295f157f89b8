"""`python -m relevancy COMMAND ...`: the command line, as the `relevancy` script runs it (torchrun takes it as
`torchrun ... -m relevancy evaluate ...`)."""
from .apps.cli import entry_point

entry_point()
