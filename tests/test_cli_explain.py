"""`relevancy explain` end to end on a local checkpoint, and every bad input with a clear error and no output."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

import relevancy
from relevancy.adapters import UnsupportedModelError
from relevancy.cli import main
from models import tiny_vit

ARCH = "vit_tiny_patch16_224"


@pytest.fixture()
def checkpoint(tmp_path):
    """A local checkpoint of a timm architecture at its default size (the CLI builds `--arch` as timm names it)."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model(ARCH, pretrained=False, num_classes=7)
    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path


@pytest.fixture()
def photo(tmp_path):
    from skimage import data

    path = tmp_path / "cat.png"
    Image.fromarray(data.chelsea()).save(path)
    return path


def run(*argv: str) -> int:
    return main([str(a) for a in argv])


def test_explain_writes_one_png_per_image(tmp_path, checkpoint, photo, capsys):
    from skimage import data

    jpeg = tmp_path / "astronaut.jpg"
    Image.fromarray(data.astronaut()).save(jpeg)
    out = tmp_path / "out"
    assert run("explain", photo, jpeg, "--model", checkpoint, "--arch", ARCH, "--method", "transformer_attribution", "--out", out) == 0
    assert sorted(p.name for p in out.iterdir()) == ["astronaut_transformer_attribution.png", "cat_transformer_attribution.png"]
    assert capsys.readouterr().out.count("wrote") == 2


def test_explain_all_methods_side_by_side(tmp_path, photo, capsys, monkeypatch):
    model = tiny_vit()
    monkeypatch.setattr("relevancy.models.load_image_model", lambda name, arch: model)
    out = tmp_path / "out"
    assert run("explain", photo, "--method", "all", "--out", out) == 0
    assert sorted(p.name for p in out.iterdir()) == ["cat_all.png"]
    assert "wrote" in capsys.readouterr().out
    with Image.open(out / "cat_all.png") as image:
        assert image.width > 5 * image.height  # a row of panels


def test_explain_local_checkpoint(tmp_path, photo, monkeypatch):
    import timm

    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=7)
    path = tmp_path / "tiny.pth"
    torch.save({"state_dict": model.state_dict()}, path)
    out = tmp_path / "out"
    assert run("explain", photo, "--model", path, "--arch", "vit_tiny_patch16_224", "--method", "cdam", "--target", 6, "--out", out) == 0
    assert (out / "cat_cdam.png").stat().st_size > 1000


def expect_error(capsys, *argv, match: str) -> None:
    assert run(*argv) == 2
    err = capsys.readouterr().err
    assert match in err, err


def test_bad_inputs_give_clear_errors_and_write_nothing(tmp_path, photo, capsys, monkeypatch):
    monkeypatch.setattr("relevancy.models.load_image_model", lambda name, arch: tiny_vit())
    out = tmp_path / "out"
    not_image = tmp_path / "notes.png"
    not_image.write_text("not an image")
    expect_error(capsys, "explain", photo, tmp_path / "missing.png", "--out", out, match="does not exist")
    expect_error(capsys, "explain", photo, not_image, "--out", out, match="not a readable image")
    expect_error(capsys, "explain", photo, "--target", 99, "--out", out, match="out of range: the model has 5 classes (valid: 0..4)")
    expect_error(capsys, "explain", photo, "--method", "rolout", "--out", out, match="Did you mean 'rollout'?")
    assert not out.exists()


def test_model_loading_errors(tmp_path, photo, capsys):
    out = tmp_path / "out"
    expect_error(capsys, "explain", photo, "--model", tmp_path / "missing.pth", "--arch", ARCH, "--out", out, match="does not exist")
    ckpt = tmp_path / "m.pth"
    torch.save({}, ckpt)
    expect_error(capsys, "explain", photo, "--model", ckpt, "--out", out, match="pass --arch")
    expect_error(capsys, "explain", photo, "--model", "vit_not_a_model", "--out", out, match="unknown model")
    assert not out.exists()


def test_unsupported_model_lists_the_supported_families():
    with pytest.raises(UnsupportedModelError, match="Supported families: timm VisionTransformer"):
        relevancy.explain(torch.nn.Linear(3, 3), torch.randn(1, 3, 8, 8), method="rollout")


def test_unknown_method_suggests_the_closest_name():
    with pytest.raises(ValueError, match="Did you mean 'generic_attention'"):
        relevancy.explain(tiny_vit(), torch.randn(1, 3, 32, 32), method="generic_atention")


def test_bad_targets():
    model, images = tiny_vit(), torch.randn(2, 3, 32, 32)
    with pytest.raises(ValueError, match="out of range"):
        relevancy.explain(model, images, method="rollout", target=-1)
    with pytest.raises(ValueError, match="one per image"):
        relevancy.explain(model, images, method="rollout", target=[0, 1, 2])
    with pytest.raises(ValueError, match="explains classes, not a Concept"):
        relevancy.explain(model, images, method="rollout", target=relevancy.Concept(model, images))


def test_save_writes_a_png_and_leaves_no_partial_file_on_failure(tmp_path, monkeypatch):
    model, images = tiny_vit(), torch.randn(2, 3, 32, 32)
    expl = relevancy.explain(model, images, method="cdam")
    assert expl.save(tmp_path / "ok.png", images).stat().st_size > 1000

    def broken(*_a, **_k):
        raise OSError("disk full")

    monkeypatch.setattr("matplotlib.figure.Figure.savefig", broken)
    with pytest.raises(OSError):
        expl.save(tmp_path / "broken.png", images)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.png"]


def test_signed_maps_use_a_diverging_colormap_centred_on_zero():
    from relevancy.viz import color_limits

    low, high = color_limits(torch.tensor([[-1.0, 3.0]]), signed=True)
    assert low == -high
    assert color_limits(torch.tensor([[0.0, 2.0]]), signed=False)[0] == 0.0
    assert np.isclose(color_limits(torch.tensor([[0.0, 2.0]]), signed=False)[1], 2.0, atol=0.02)


def test_a_concept_needs_examples():
    with pytest.raises(ValueError, match="at least one example"):
        relevancy.Concept(tiny_vit(), torch.zeros(0, 3, 32, 32))
