"""DETR (transformers `DetrForObjectDetection`): an image stream encoded by self-attention and a queries stream
that attends to it; one explained object per row."""

from .adapter import Detection, DetrAdapter, detect
from .batch import DetectionBatch
from .explanation import DetectionExplanation

__all__ = ["Detection", "DetectionBatch", "DetectionExplanation", "DetrAdapter", "detect"]
