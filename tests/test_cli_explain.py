"""`relevancy explain` end to end on a local checkpoint, and every bad input with a clear error and no output."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

import relevancy
from relevancy.families import UnsupportedModelError
from relevancy.apps.cli import main
from relevancy.families.base import SEED_METHODS
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
    (tmp_path / "folder.png").mkdir()
    expect_error(capsys, "explain", photo, tmp_path / "missing.png", "--out", out, match="does not exist")
    expect_error(capsys, "explain", photo, tmp_path / "folder.png", "--out", out, match="is a folder, not an image file")
    expect_error(capsys, "explain", photo, not_image, "--out", out, match="not a readable image")
    expect_error(capsys, "explain", photo, "--target", -1, "--out", out, match="--target must be a class index (0 or more) or a class name, got")
    expect_error(capsys, "explain", photo, "--target", 99, "--out", out, match="out of range: the model has 5 classes (valid: 0..4)")
    expect_error(capsys, "explain", photo, "--method", "rolout", "--out", out, match="Did you mean 'rollout'?")
    assert not out.exists()


def test_model_loading_errors(tmp_path, photo, capsys):
    out = tmp_path / "out"
    expect_error(capsys, "explain", photo, "--model", tmp_path / "missing.pth", "--arch", ARCH, "--out", out, match="does not exist")
    ckpt = tmp_path / "m.pth"
    torch.save({}, ckpt)
    expect_error(capsys, "explain", photo, "--model", ckpt, "--out", out, match="pass --arch")
    expect_error(capsys, "explain", photo, "--model", "vit_not_a_model", "--out", out, match="unknown --model 'vit_not_a_model'")
    expect_error(capsys, "explain", photo, "--model", photo, "--arch", ARCH, "--out", out,
                 match=f"--model {photo} is not a weights file: it takes a checkpoint (.pth, .pt, .bin, .safetensors)")
    expect_error(capsys, "explain", photo, "--model", tmp_path, "--arch", ARCH, "--out", out, match="is a folder")
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"\x89PNG not a checkpoint")
    expect_error(capsys, "explain", photo, "--model", garbage, "--arch", ARCH, "--out", out,
                 match=f"could not read {garbage} as a PyTorch or safetensors checkpoint")
    expect_error(capsys, "explain", photo, "--model", ckpt, "--arch", ARCH, "--out", out, match="holds no state dict")
    assert not out.exists()


def test_a_checkpoint_of_another_architecture_is_one_line(tmp_path, checkpoint, photo, capsys):
    assert run("explain", photo, "--model", checkpoint, "--arch", "vit_small_patch16_224", "--out", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"checkpoint {checkpoint} does not fit --arch vit_small_patch16_224: tensors" in err and "of another shape" in err


def test_offline_hub_names_fail_in_seconds(tmp_path, photo, capsys, monkeypatch):
    """No connection to the Hub and nothing cached: the message comes at once, not after a minute of retries."""
    import time

    from huggingface_hub import constants

    monkeypatch.setattr("relevancy.models.hub_reachable", lambda: False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    started = time.perf_counter()
    assert run("explain", photo, "--model", "vit_tiny_patch16_224", "--out", tmp_path / "out") == 2
    assert time.perf_counter() - started < 15
    err = capsys.readouterr().err
    assert "could not load pretrained weights for 'vit_tiny_patch16_224'" in err and "cannot be reached" in err
    assert "pass a local checkpoint file with --arch" in err
    assert constants.HF_HUB_OFFLINE is False  # offline only for the call


def test_hub_reachability_is_bounded_by_its_timeout(monkeypatch):
    """A name lookup or connection that hangs (socket timeouts do not bound name lookups) counts as offline."""
    import socket
    import time

    from relevancy.models import hub_reachable

    def hangs(address, timeout):
        time.sleep(3)
        raise TimeoutError("timed out")

    monkeypatch.setattr(socket, "create_connection", hangs)
    started = time.perf_counter()
    assert hub_reachable(timeout=0.5) is False
    assert time.perf_counter() - started < 2

    def refused(address, timeout):
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(socket, "create_connection", refused)
    assert hub_reachable(timeout=0.5) is False


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
    from relevancy.results.viz import color_limits

    low, high = color_limits(torch.tensor([[-1.0, 3.0]]), signed=True)
    assert low == -high
    assert color_limits(torch.tensor([[0.0, 2.0]]), signed=False)[0] == 0.0
    assert np.isclose(color_limits(torch.tensor([[0.0, 2.0]]), signed=False)[1], 2.0, atol=0.02)


def test_a_concept_needs_examples():
    with pytest.raises(ValueError, match="at least one example"):
        relevancy.Concept(tiny_vit(), torch.zeros(0, 3, 32, 32))


# ------------------------------------------------------------------------------------- outputs before work


@pytest.fixture()
def no_work(forbid):
    """Fail the test if the command loads a model or explains anything."""
    forbid("relevancy.models.load_image_model", "relevancy.api.explain")


@pytest.fixture()
def unwritable(tmp_path):
    """A folder this process cannot create files in: a read-only folder, or /proc where permissions do not bind (root)."""
    import tempfile

    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError:
        yield folder
    else:
        yield Path("/proc")
    folder.chmod(0o755)


def test_outputs_are_checked_before_any_work(tmp_path, photo, capsys, no_work, unwritable):
    a_file = tmp_path / "taken"
    a_file.write_text("keep me")
    expect_error(capsys, "explain", photo, "--out", a_file, match=f"{a_file} exists and is not a folder")
    expect_error(capsys, "explain", photo, "--out", a_file / "sub", match=f"cannot create the folder {a_file / 'sub'}: {a_file} is a file")
    expect_error(capsys, "explain", photo, "--out", unwritable / "maps", match="is not writable")
    occupied = tmp_path / "occupied"
    (occupied / "cat_rollout.png").mkdir(parents=True)
    expect_error(capsys, "explain", photo, "--method", "rollout", "--out", occupied, match="cat_rollout.png: it is a folder")
    assert a_file.read_text() == "keep me" and not (unwritable / "maps").exists()


def test_inputs_with_the_same_name_get_their_own_outputs(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("relevancy.models.load_image_model", lambda name, arch: tiny_vit())
    paths = [tmp_path / "a" / "cat.png", tmp_path / "b" / "cat.png", tmp_path / "c" / "Cat.png"]
    for k, path in enumerate(paths):
        path.parent.mkdir()
        Image.fromarray(np.full((32, 32, 3), 60 * k, dtype=np.uint8)).save(path)
    out = tmp_path / "out"
    assert run("explain", *paths, "--method", "raw_attention", "--out", out) == 0
    names = ["cat_raw_attention.png", "cat-2_raw_attention.png", "Cat-3_raw_attention.png"]
    assert sorted(p.name for p in out.iterdir()) == sorted(names)
    assert [line.split("/")[-1] for line in capsys.readouterr().out.split()[1::2]] == names


def test_a_failed_write_leaves_no_partial_file(tmp_path, photo, capsys, monkeypatch):
    monkeypatch.setattr("relevancy.models.load_image_model", lambda name, arch: tiny_vit())

    def disk_full(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("matplotlib.figure.Figure.savefig", disk_full)
    out = tmp_path / "out"
    out.mkdir()
    expect_error(capsys, "explain", photo, "--method", "rollout", "--out", out, match="No space left on device")
    assert list(out.iterdir()) == []


def test_json_prints_the_numbers(tmp_path, photo, capsys, monkeypatch):
    import json

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("relevancy.models.load_image_model", lambda name, arch: tiny_vit())  # 32 px, patch 8, 5 classes
    assert run("explain", photo, photo, "--method", "all", "--target", 3, "--json") == 0
    captured = capsys.readouterr()
    results = json.loads(captured.out)  # one to_json() per method, each over both images
    assert not (tmp_path / "relevancy-out").exists()  # --json alone writes no PNGs
    assert [result["method"] for result in results] == list(SEED_METHODS)
    for result in results:
        assert result["kind"] == "ImageExplanation" and result["target"] == [3, 3] and result["class_names"] is None
        assert len(result["logits"]) == 2 and all(len(row) == 5 for row in result["logits"])
        size = [32, 32] if result["method"] == "lrp" else [4, 4]
        assert result["tensors"]["scores/image"]["shape"] == [2, *size]
        assert result["signed"] is (result["method"] in ("lrp", "cdam", "token_ablation"))
    out = tmp_path / "maps"
    assert run("explain", photo, "--method", "rollout", "--json", "--out", out) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)[0]["target"][0] in range(5)
    assert f"wrote {out / 'cat_rollout.png'}" in captured.err  # stdout holds only the JSON


# ------------------------------------------------------------------------------------------- image reading


def pixels(picture) -> np.ndarray:
    return np.asarray(picture)


def test_16_bit_pngs_are_scaled_not_clipped(tmp_path):
    from relevancy.apps.cli import read_image

    values = np.array([[0, 1028, 32896], [49344, 65535, 257]], dtype=np.uint16)  # 257 * (0, 4, 128, 192, 255, 1)
    path = tmp_path / "deep.png"
    Image.fromarray(values).save(path)
    with Image.open(path) as image:
        assert image.mode == "I;16"
    picture = read_image(str(path))
    assert picture.mode == "RGB" and picture.size == (3, 2)
    assert pixels(picture)[..., 0].tolist() == [[0, 4, 128], [192, 255, 1]]
    assert (pixels(picture)[..., 0] == pixels(picture)[..., 2]).all()


def test_float_tiffs_are_scaled_by_their_range(tmp_path):
    from relevancy.apps.cli import read_image

    unit = tmp_path / "unit.tiff"
    Image.fromarray(np.array([[0.0, 0.5], [0.25, 1.0]], dtype=np.float32)).save(unit)
    assert pixels(read_image(str(unit)))[..., 1].tolist() == [[0, 128], [64, 255]]
    wide = tmp_path / "wide.tiff"
    Image.fromarray(np.array([[-3.0, 1.0], [5.0, 2.0]], dtype=np.float32)).save(wide)
    assert pixels(read_image(str(wide)))[..., 1].tolist() == [[0, 128], [255, 159]]
    broken = tmp_path / "nan.tiff"
    Image.fromarray(np.array([[np.nan, 1.0]], dtype=np.float32)).save(broken)
    with pytest.raises(Exception, match="NaN or infinite"):
        read_image(str(broken))


def test_exif_orientation_is_applied(tmp_path):
    from relevancy.apps.cli import read_image

    array = np.zeros((20, 40, 3), dtype=np.uint8)
    array[:, :20] = 255  # white left half, stored landscape
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    path = tmp_path / "phone.jpg"
    Image.fromarray(array).save(path, exif=exif, quality=95)
    picture = pixels(read_image(str(path)))
    assert picture.shape == (40, 20, 3)  # shown portrait
    assert picture[:15].mean() > 200 and picture[25:].mean() < 50  # the white half on top


def test_animations_use_their_first_frame_and_say_so(tmp_path, capsys):
    from relevancy.apps.cli import read_image

    frames = [Image.new("RGB", (16, 16), colour) for colour in ("red", "lime", "blue")]
    path = tmp_path / "spin.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:])
    assert pixels(read_image(str(path)))[0, 0].tolist() == [255, 0, 0]
    assert f"warning: {path} is animated: uses frame 1 of 3" in capsys.readouterr().err


def bomb(path, width: int, height: int):
    """A small PNG made by Pillow whose header claims `width` x `height` pixels."""
    import struct
    import zlib

    Image.new("L", (8, 8)).save(path)
    data = bytearray(path.read_bytes())
    header = b"IHDR" + struct.pack(">II", width, height) + bytes(data[24:29])
    data[12:29] = header
    data[29:33] = struct.pack(">I", zlib.crc32(header))
    path.write_bytes(bytes(data))
    return path


def test_oversized_images_are_refused_in_one_line(tmp_path, capsys, no_work):
    from relevancy.apps.cli import MAX_IMAGE_PIXELS

    assert MAX_IMAGE_PIXELS == 100_000_000
    large = bomb(tmp_path / "large.png", 12_000, 10_000)  # 120 Mpixel: over our limit, under PIL's error
    expect_error(capsys, "explain", large, "--out", tmp_path / "out", match=f"image {large} is too large: 12000x10000 pixels, the limit is 100,000,000")
    huge = bomb(tmp_path / "huge.png", 20_000, 20_000)  # 400 Mpixel: PIL's DecompressionBombError
    assert run("explain", huge, "--out", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err == f"relevancy explain: error: image {huge} is too large: more than 100,000,000 pixels\n"
    assert not (tmp_path / "out").exists()


def test_a_16_bit_scan_is_explained_end_to_end(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("relevancy.models.load_image_model", lambda name, arch: tiny_vit())
    path = tmp_path / "scan.png"
    Image.fromarray((np.arange(48 * 48).reshape(48, 48) * 28).astype(np.uint16)).save(path)
    assert run("explain", path, "--method", "cdam", "--out", tmp_path / "out") == 0
    assert (tmp_path / "out" / "scan_cdam.png").stat().st_size > 1000


def test_a_scene_the_demo_saved_enlarged_is_explained_as_the_scene_without_a_warning(tmp_path, capsys):
    """`relevancy demo` saves its scenes enlarged (each pixel a block): the shipped model reads such a picture as the
    scene itself, with no warning about photographs; a picture that is not a scene still gets the warning."""
    import json

    from relevancy.worlds import make_scenes
    from relevancy.worlds.scenes import IMAGE_SIZE

    scene = Image.fromarray(make_scenes(1, seed=5).pixels[0])
    scene.save(tmp_path / "scene.png")
    scene.resize((IMAGE_SIZE * 4, IMAGE_SIZE * 4), Image.NEAREST).save(tmp_path / "enlarged.png")
    assert run("explain", tmp_path / "scene.png", tmp_path / "enlarged.png", "--method", "rollout", "--json") == 0
    captured = capsys.readouterr()
    first, second = json.loads(captured.out)[0]["logits"]
    assert first == second and "photograph" not in captured.err
    Image.fromarray(np.full((96, 96, 3), 128, dtype=np.uint8)).save(tmp_path / "grey.png")
    assert run("explain", tmp_path / "grey.png", "--method", "rollout", "--json") == 0
    assert "say nothing about a photograph" in capsys.readouterr().err
