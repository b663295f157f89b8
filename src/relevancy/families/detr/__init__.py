"""DETR (transformers `DetrForObjectDetection`): an image stream encoded by self-attention and a queries stream
that attends to it; one explained object per row."""
