"""Hugging Face BERT-family classifiers: adapter, typed text batch and relevance rule map."""
