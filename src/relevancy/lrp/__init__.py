"""Layer-wise relevance propagation on unmodified models, in one backward pass (see engine.py)."""
from .engine import GRADIENT, PAPER, RELEVANCE, VANILLA, MissingRuleError, RuleSet, Session, relevance_session

__all__ = ["GRADIENT", "PAPER", "RELEVANCE", "VANILLA", "MissingRuleError", "RuleSet", "Session", "relevance_session"]
