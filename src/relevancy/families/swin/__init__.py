"""timm's Swin Transformer family: shifted windows, patch merging, global average pooling."""
