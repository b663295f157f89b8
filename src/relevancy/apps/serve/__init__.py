"""`relevancy serve`: explanations in a browser, and a JSON API under the page.

`create_app(catalog, samples, limits)` makes the FastAPI application (`app.py`); `load_catalog` loads the models it
explains (`catalog.py`, at start only); `make_samples` the sample pictures (`samples.py`); `Limits` holds what a
request may carry (`limits.py`); the bounded queue in front of the models is `queue.py`. Needs the `serve` extra
(FastAPI, uvicorn).
"""
from __future__ import annotations

from ...core.extras import require

for _module in ("fastapi", "uvicorn", "fastapi_offline"):  # a missing one is named in one line, with its extra
    require(_module, extra="serve")

from .app import create_app  # noqa: E402  (after the extra's check)
from .catalog import Catalog, load_catalog  # noqa: E402
from .limits import Limits  # noqa: E402
from .samples import make_samples  # noqa: E402

__all__ = ["Catalog", "Limits", "create_app", "load_catalog", "make_samples"]
