"""Hugging Face vision transformers (ViT, DeiT, DINOv2, DINOv2 with registers): adapter and relevance rule map."""
