"""Hostile probes of the command line and the Python API (issue 24 items 3, 6 and 7): each gets a clear one-line
error that names the problem and the limit or the valid choices, and writes nothing; or the right result."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import relevancy
from models import tiny_vit
from relevancy.apps.cli import main
from relevancy.apps.cli.common import MAX_FILES

IMAGES = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
LONGEST_ERROR = 1_000  # characters: an error quotes what the user typed, shortened


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message and len(message) < LONGEST_ERROR
    return message


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A scene of the shapes world, files that are not what they claim, and model folders that are not DETRs."""
    from relevancy.worlds import make_scenes

    root = tmp_path_factory.mktemp("probes")
    Image.fromarray(make_scenes(1, seed=3, objects=2).pixels[0]).save(root / "scene.png")
    (root / "notes.txt").write_text("not an image, not a model\n")
    (root / "notes.png").write_text("not an image\n")
    (root / "empty.png").write_bytes(b"")
    (root / "folder.png").mkdir()
    (root / "a_file").write_text("x")
    torch.save({}, root / "empty.pth")
    (root / "bert").mkdir()
    (root / "bert" / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertForSequenceClassification"]}))
    (root / "detr").mkdir()
    (root / "detr" / "config.json").write_text(json.dumps({"model_type": "detr", "architectures": ["DetrForObjectDetection"]}))
    (root / "no_config").mkdir()
    return root


TEN_THOUSAND = " ".join(["zebra"] * 10_000)
CLI_PROBES = [
    # explain (the shipped ViT, shapes CLIP, timm names and checkpoints)
    (["explain", "{scene}", "--target", "99999999999999999999"], "target 99999999999999999999 is out of range: the model has 12 classes"),
    (["explain", "{scene}", "--target", ""], "--target must be a class index (0 or more) or a class name"),
    (["explain", "{scene}", "--target", "-3"], "--target must be a class index (0 or more) or a class name, got '-3'"),
    (["explain", "{scene}", "--target", "zebra"], "unknown target 'zebra': the model's classes are circle (0), square (1)"),
    (["explain", *["{scene}"] * (MAX_FILES + 1)], f"{MAX_FILES + 1} images given; the limit is {MAX_FILES} per run"),
    (["explain", "{root}/missing.png"], "does not exist"),
    (["explain", "{root}/folder.png"], "is a folder, not an image file"),
    (["explain", "{root}/notes.png"], "is not a readable image"),
    (["explain", "{root}/empty.png"], "is not a readable image"),
    (["explain", "{scene}", "--method", "rolout"], "Did you mean 'rollout'?"),
    (["explain", "{scene}", *["--text", "a star"] * 17], "17 --text captions given; the limit is 16 per run"),
    (["explain", "{scene}", "--text", "a" * 1_001], "--text caption 0 has 1,001 characters; the limit is 1,000"),
    (["explain", "{scene}", "--text", TEN_THOUSAND], "has 59,999 characters; the limit is 1,000"),
    (["explain", "{scene}", "--text", " ".join(["zebra"] * 150)], "unknown words 'zebra' in 'zebra zebra"),
    (["explain", *["{scene}"] * 17, *["--text", "a star"] * 16], "17 images x 16 texts = 272 pairs; the limit is 256"),
    (["explain", "{scene}", "--text", "a star", "--model", "open_clip:ViT-S-32"], "names no weights, and untrained weights explain nothing"),
    (["explain", "{scene}", "--text", "a star", "--model", "./missing_clip_dir"], "--model ./missing_clip_dir: no such folder"),
    (["explain", "{scene}", "--model", "{root}/empty.pth", "--arch", "not_an_arch"], "unknown --arch 'not_an_arch': not a timm architecture; timm names such as vit_base_patch16_224"),
    (["explain", "{scene}", "--model", "vit_bse_patch16_224"], "close timm names: vit_base_patch16_224"),
    (["explain", "{scene}", "--model", "{root}/notes.txt"], "is not a weights file"),
    (["explain", "{scene}", "--out", "{root}/a_file"], "exists and is not a folder"),
    (["explain", "{scene}", "--arch", "vit_tiny_patch16_224"], "--arch names the architecture of a local checkpoint file"),
    (["explain", "{scene}", "--text", "a star", "--model", "{root}/bert"], "holds a BertForSequenceClassification; this command takes a transformers CLIPModel"),
    # explain-text (the shipped sentiment classifier)
    (["explain-text", "good", "--model", "./missing_dir"], "--model ./missing_dir: no such folder"),
    (["explain-text", *["good"] * 101], "101 texts given; the limit is 100 per run"),
    (["explain-text", "a" * 100_001], "text 0 has 100,001 characters; the limit is 100,000"),
    (["explain-text", "good", "--target", "99999999999999999999"], "target 99999999999999999999 is out of range: the model has 2 classes"),
    (["explain-text", "good", "--target", "happy"], "unknown target 'happy': the model's classes are"),
    (["explain-text", "good", "--max-length", "2"], "--max-length must be at least 3"),
    (["explain-text", "   "], "text 0 is empty"),
    (["explain-text", "good", "--model", "{root}/no_config"], "holds no readable config.json"),
    (["explain-text", "good", "--model", "{root}/detr"], "holds a DetrForObjectDetection; this command takes a BERT-family sequence classifier"),
    # explain-detections
    (["explain-detections", "{scene}", "--model", "{root}/bert", "--threshold", "1.5"], "--threshold must be a probability in [0, 1), got 1.5"),
    (["explain-detections", "{scene}", "--model", "{root}/bert", "--threshold", "nan"], "--threshold must be a probability in [0, 1), got nan"),
    (["explain-detections", "{scene}", "--model", "{root}/bert", "--max-objects", "0"], "--max-objects must be between 1 and 30, got 0"),
    (["explain-detections", "{scene}", "--model", "{root}/bert", "--max-objects", "31"], "--max-objects must be between 1 and 30, got 31"),
    (["explain-detections", "{scene}", "--model", "{root}/nowhere"], "--model must be a local folder of a transformers DetrForObjectDetection"),
    (["explain-detections", "{scene}", "--model", "{root}/bert"], "holds a 'bert' model; explain-detections takes a DetrForObjectDetection"),
    (["explain-detections", "{scene}", "--model", "{root}/no_config"], "holds no transformers model (no readable config.json)"),
    (["explain-detections", "{scene}", "--model", "{root}/bert", "--method", "all"], "takes one method"),
    (["explain-detections", *["{scene}"] * (MAX_FILES + 1), "--model", "{root}/bert"], f"the limit is {MAX_FILES} per run"),
    # explain-question
    (["explain-question", "--question", "what color is the star", "--scene", "-1"], "--scene must be in 0.."),
    (["explain-question", "--n", "0"], "--n must be in 1..1000, got 0"),
    (["explain-question", *["--question", "is there a star"] * 1_001], "1,001 questions given; the limit is 1,000 per run"),
    (["explain-question", "--question", "star " * 41], "question 0 has 205 characters; the limit is 200"),
    # demo
    (["demo", "--singles", "100000"], "--singles must be between 0 and 100, got 100,000"),
    (["demo", "--pairs", "-1"], "--pairs must be between 0 and 100, got -1"),
    (["demo", "--singles", "0", "--pairs", "0"], "there is no scene to explain"),
    # evaluate
    (["evaluate", "--batch-size", "100000"], "--batch-size must be between 1 and 1,024, got 100,000"),
    (["evaluate", "--threads", "5000"], "--threads must be between 1 and 1024, got 5,000"),
    (["evaluate", "--workers", "1000"], "--workers must be between 0 and 64, got 1,000"),
    (["evaluate", "--benchmark", "imagenet-seg", "--data", "{root}/notes.txt"], "notes.txt is not an HDF5 (MATLAB v7.3) file: ImageNet-Segmentation needs gtsegs_ijcv.mat"),
    (["evaluate", "--benchmark", "imagenette"], "Did you mean 'imagenet'?"),
    (["evaluate", "--benchmark", "imagenet", "--data", "{root}/no_config"], "holds no class folders"),
    (["evaluate", "--benchmark", "coco-detr", "--data", "{root}/notes.txt", "--model", "{root}/bert"], "is not a COCO instances annotation file: not JSON"),
    (["evaluate", "--benchmark", "coco-detr", "--data", "{root}/bert/config.json", "--model", "{root}/bert"], "it has no images, annotations, categories"),
    # serve
    (["serve", "--max-running", "100000"], "--max-running must be between 1 and 64, got 100,000"),
    (["serve", "--time-limit", "nan"], "--time-limit must be between 0.1 and 3,600, got nan"),
    (["serve", "--max-pixels", "1000000000000"], "--max-pixels must be between 1 and 100,000,000"),
]


@pytest.mark.parametrize("argv, message", CLI_PROBES, ids=lambda v: " ".join(v)[:60] if isinstance(v, list) else None)
def test_the_command_line_refuses_in_one_line_and_writes_nothing(files, tmp_path, capsys, argv, message):
    out = tmp_path / "out"
    given = [a.format(scene=files / "scene.png", root=files) for a in argv]
    if "--out" not in given and given[0] != "serve":
        given += ["--out", str(out / "page.html" if given[0] == "explain-text" else out)]
    assert main(given) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"relevancy {given[0]}: error:") and len(lines[-1]) < LONGEST_ERROR, err
    assert message in lines[-1], lines[-1]
    assert not out.exists() or not any(out.iterdir())


def test_a_question_about_an_object_the_scene_lacks_is_answered_with_a_warning(capsys):
    assert main(["explain-question", "--question", "what color is the star", "--question", "is there a star", "--json"]) == 0
    captured = capsys.readouterr()
    (result,) = json.loads(captured.out)  # generic_attention's to_json(): both questions
    assert len(result["target"]) == 2 and result["tokens"][0][1:5] == ["what", "color", "is", "the"]
    err = captured.err
    assert ("warning: 'what color is the star' asks about a star, which scene 0 does not hold (it holds a blue H-shape, "
            "an orange square and a blue triangle): the answer is a guess") in err
    assert "is there a star' asks" not in err  # an existence question is answerable either way


def test_library_warnings_are_one_line_of_the_command(capsys):
    assert main(["explain-text", "good " * 600, "--json", "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "relevancy explain-text: warning: text 0 has 602 tokens; only its first 512" in err
    assert "UserWarning" not in err and ".py:" not in err


# -- Python API ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", [None, 3, ["rollout"]])
def test_a_method_that_is_not_a_name_is_refused_naming_the_methods(method):
    with pytest.raises(ValueError, match="method must be a method name") as error:
        relevancy.explain(tiny_vit(), IMAGES, method=method)
    assert "rollout" in one_line(error)


def test_a_very_long_method_name_is_quoted_short():
    with pytest.raises(ValueError, match=r"unknown method 'xxx.*\.\.\. \(10,000 characters\)\. Valid methods: raw_attention") as error:
        relevancy.explain(tiny_vit(), IMAGES, method="x" * 10_000)
    one_line(error)


@pytest.mark.parametrize("method, options, message", [
    ("rollout", {"bogus": 1}, "method 'rollout' has no option 'bogus'; its options: start_layer, cls_entry, row_normalize"),
    ("rollout", {"start_layer": "a"}, "option start_layer of method 'rollout' must be int, got str 'a'"),
    ("rollout", {"start_layer": True}, "option start_layer of method 'rollout' must be int, got bool True"),
    ("attention_gradcam", {"normalize": "yes"}, "option normalize of method 'attention_gradcam' must be bool or None, got str 'yes'"),
    ("lrp", {"exact": 1}, "option exact of method 'lrp' must be bool, got int 1"),
    ("generic_attention", {"weights": 3}, "option weights of method 'generic_attention' must be str, got int 3"),
    ("cdam", {"start_layer": 0}, "method 'cdam' has no option 'start_layer'; its options: none"),
])
def test_options_are_checked_against_the_method(method, options, message):
    with pytest.raises(ValueError) as error:
        relevancy.explain(tiny_vit(), IMAGES, method=method, **options)
    assert message in one_line(error)


def test_integer_options_of_numpy_type_are_taken():
    expected = relevancy.explain(tiny_vit(), IMAGES, method="rollout", start_layer=1).scores
    torch.testing.assert_close(relevancy.explain(tiny_vit(), IMAGES, method="rollout", start_layer=np.int64(1)).scores, expected)


def test_a_target_beyond_int64_is_out_of_range():
    with pytest.raises(ValueError, match=r"target 100000000000000000000 is out of range: the model has 5 classes \(valid: 0..4\)") as error:
        relevancy.explain(tiny_vit(), IMAGES, method="rollout", target=10**20)
    one_line(error)


def test_a_long_target_name_is_quoted_short_and_a_nameless_model_says_so():
    with pytest.raises(ValueError, match=r"\(10,000 characters\): the model names no classes; give a class index") as error:
        relevancy.explain(tiny_vit(), IMAGES, method="rollout", target="x" * 10_000)
    one_line(error)


def test_class_names_are_taken_as_the_command_line_takes_them():
    from relevancy.worlds import load_model, make_scenes

    model, images = load_model(), make_scenes(2, seed=1).images
    by_index = relevancy.explain(model, images, method="rollout", target=[5, 11])
    for target in (["star", "heart"], [" Star ", "HEART"], ["star", 11], ["5", "heart"]):
        expl = relevancy.explain(model, images, method="rollout", target=target)
        assert expl.target.tolist() == [5, 11]
        torch.testing.assert_close(expl.scores, by_index.scores)
    with pytest.raises(ValueError, match="unknown target 'elephant': the model's classes are circle \\(0\\)") as error:
        relevancy.explain(model, images, method="rollout", target="elephant")
    one_line(error)


def test_many_class_names_are_summarised_with_the_closest():
    from relevancy.core.class_names import unknown_class

    names = [f"class number {i}" for i in range(1_000)]
    message = unknown_class("class numbr 7", names)
    assert message.startswith("unknown target 'class numbr 7': not one of the model's 1000 class names; close names:")
    assert len(message) < 200


def test_a_concept_batch_size_must_be_a_positive_whole_number():
    for size in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="batch_size must be a whole number of examples, 1 or more") as error:
            relevancy.Concept(tiny_vit(), IMAGES, batch_size=size)
        one_line(error)


def test_detect_names_the_model_it_takes_and_the_threshold_range():
    with pytest.raises(TypeError, match="detect takes a transformers DetrForObjectDetection, got VisionTransformer"):
        relevancy.detect(tiny_vit(), IMAGES)
    from relevancy.worlds.detection import detector_inputs, load_detector

    for threshold in (1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match=r"threshold must be a probability in \[0, 1\)"):
            relevancy.detect(load_detector(), detector_inputs(torch.zeros(1, 3, 64, 64)), threshold)


def test_loading_by_name_names_a_missing_folder_and_a_missing_tag():
    from relevancy.models import load_clip_model, load_text_classifier

    with pytest.raises(FileNotFoundError, match="--model ./nope/: no such folder"):
        load_text_classifier("./nope/")
    with pytest.raises(FileNotFoundError, match="--model ../a/b: no such folder"):
        load_clip_model("../a/b")
    with pytest.raises(ValueError, match=r"ViT-S-32:TAG; .*':random' to explain untrained weights on purpose"):
        load_clip_model("open_clip:ViT-S-32")


def test_pictures_name_the_file_and_the_problem(files):
    from relevancy.core.pictures import PictureError, read_image

    for name, message in (("notes.png", "is not a readable image"), ("folder.png", "is a folder"), ("missing.png", "does not exist")):
        with pytest.raises(PictureError, match=message) as error:
            read_image(str(files / name))
        assert name in one_line(error)


def test_imagenet_segmentation_names_a_file_that_is_not_its_data(files, tmp_path):
    import h5py

    from relevancy.evaluation.datasets import ImageNetSegmentation

    with pytest.raises(ValueError, match="is not an HDF5 \\(MATLAB v7.3\\) file"):
        ImageNetSegmentation(files / "notes.txt")
    with h5py.File(tmp_path / "other.mat", "w") as f:
        f["x"] = [1]
    with pytest.raises(ValueError, match="is an HDF5 file without /value/img"):
        ImageNetSegmentation(tmp_path / "other.mat")


@pytest.fixture(scope="module")
def random_detr(tmp_path_factory):
    """An untrained DETR of the shapes detector's size with 40 queries and 91 classes (not the shapes detector)."""
    from transformers import DetrConfig, DetrForObjectDetection

    from relevancy.worlds.detection import DETECTOR_CONFIG

    torch.manual_seed(0)
    config = {**DETECTOR_CONFIG, "num_queries": 40, "num_labels": 91, "id2label": None, "label2id": None}
    folder = tmp_path_factory.mktemp("random_detr")
    DetrForObjectDetection(DetrConfig(**config)).save_pretrained(folder)
    return folder


def test_a_picture_giving_too_many_image_tokens_is_refused_before_any_work(files, random_detr, tmp_path, capsys):
    """Without an image processor beside it, a stride-8 DETR sees a 64 px scene at COCO's 800 px: 10,000 tokens."""
    out = tmp_path / "out"
    assert main(["explain-detections", str(files / "scene.png"), "--model", str(random_detr), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "warning: " in err and "has no preprocessor_config.json: preprocessing as COCO DETR" in err
    assert "gives 100x100 = 10,000 image tokens; the limit is 8,192" in err.strip().splitlines()[-1]
    assert not out.exists()


def test_every_object_at_threshold_0_gives_a_bounded_png(files, random_detr, tmp_path, capsys):
    from transformers import DetrImageProcessor

    from relevancy.apps.cli.detections import MAX_OBJECTS

    folder = tmp_path / "detr"
    folder.mkdir()
    for path in random_detr.iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    DetrImageProcessor(size={"height": 64, "width": 64}, do_pad=False).save_pretrained(folder)
    out = tmp_path / "out"
    assert main(["explain-detections", str(files / "scene.png"), "--model", str(folder), "--threshold", "0",
                 "--max-objects", str(MAX_OBJECTS), "--out", str(out)]) == 0
    assert f"40 objects above --threshold 0.0; explaining the {MAX_OBJECTS} most probable" in capsys.readouterr().err
    with Image.open(out / "scene_detections.png") as picture:
        assert picture.width <= 2_400 and picture.height <= 2_000  # 30 panels in 5 rows of 6


def test_the_world_s_own_questions_never_ask_about_an_absent_object():
    from relevancy.worlds.questions import make_questions
    from relevancy.apps.demos.questions import absent_objects

    batch = make_questions(300, seed=7, features=False)
    assert absent_objects(batch) == [None] * 300
