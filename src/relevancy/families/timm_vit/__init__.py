"""timm VisionTransformer family: adapter and relevance rule map."""
