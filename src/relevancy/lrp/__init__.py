"""Relevance propagation on unmodified models: one rule vocabulary (`rule_sets`), one engine (`engine`), one
attention (`attention`)."""
from .engine import GRADIENT, RELEVANCE, MissingRuleError, Session, relevance_session
from .rule_sets import ATTNLRP, CP_LRP, PAPER, RULE_SETS, VANILLA, RuleSet

__all__ = ["ATTNLRP", "CP_LRP", "GRADIENT", "PAPER", "RELEVANCE", "RULE_SETS", "VANILLA", "MissingRuleError", "RuleSet",
           "Session", "relevance_session"]
