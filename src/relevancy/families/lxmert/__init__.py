"""Hugging Face LXMERT: adapter (question and regions streams, co-attention sites) and typed batch."""
