"""Training of the shipped models, outside the library's import path: `python -m training.NAME` from the
repository's root (each module's docstring gives its command)."""
