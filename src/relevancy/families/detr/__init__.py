"""DETR (transformers `DetrForObjectDetection`): an image stream encoded by self-attention and a queries stream
that attends to it; one explained object per row."""

from ...results.explanation import DetectionExplanation
from .adapter import Detection, DetrAdapter, detect
from .batch import DetectionBatch

__all__ = ["Detection", "DetectionBatch", "DetectionExplanation", "DetrAdapter", "detect"]
