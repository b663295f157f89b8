"""relevancy: what a transformer looked at. Relevance maps for timm and Hugging Face transformers."""
from .api import explain
from .explanation import Explanation
from .methods import REGISTRY as _REGISTRY
from .targets import Concept

METHODS: tuple[str, ...] = tuple(_REGISTRY)

__all__ = ["explain", "Explanation", "Concept", "METHODS"]
__version__ = "0.1.0"
