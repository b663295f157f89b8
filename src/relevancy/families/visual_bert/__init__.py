"""Hugging Face VisualBERT: adapter (one stream of question tokens then regions) and typed batch."""
