"""What the apps share, below them: the command line (`relevancy.apps.cli`) and the web page (`relevancy.apps.serve`) both
import this package and never each other (`tests/test_apps_layer.py` reads their imports).

`common`: usage errors, warnings, the range checks and limits every app applies, and the method names the help
shows without importing torch; `catalogue`: the models shipped with relevancy, one row each, that both name and load.
Neither imports torch at import time, so `relevancy --help` stays fast.
"""
