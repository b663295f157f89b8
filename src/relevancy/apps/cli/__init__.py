"""Command line: `relevancy explain | explain-text | explain-generation | explain-corpus | explain-detections | explain-question | demo | evaluate | serve`.

Every command's options are defined here, in a module that imports neither torch nor the model libraries, so
`relevancy --help` answers at once; each handler imports what it needs when it runs. Handlers check the request
(numbers, input files, output paths) before loading a model, so a bad request costs nothing and writes nothing.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, NoReturn, Sequence

from ... import __version__
from ...core.extras import MissingExtraError
from ...core.files import check_model_path
from ...core.pictures import MAX_IMAGE_PIXELS
from ..common import GENERATION_METHOD_NAMES, MAX_NEW_TOKENS, METHOD_NAMES, UsageError, warn
from .common import DEFAULT_OUT, read_image
from .images import run_demo, run_explain

#: what `--json` prints, in every explaining command's help
TO_JSON = "a list of the results' to_json() (the schema relevancy.explanation/1, docs/api.md; relevancy.load reads each back)"


def _lazy(module: str, function: str) -> Callable[[argparse.Namespace], list[Path]]:
    """A handler imported when its command runs: its module may import torch and the model libraries."""
    def handler(args: argparse.Namespace) -> list[Path]:
        return getattr(importlib.import_module(module), function)(args)

    return handler


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="relevancy", description="What a transformer looked at: relevance maps and their evaluation.")
    parser.add_argument("--version", action="version", version=f"relevancy {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    methods = f"one of {', '.join(METHOD_NAMES)}"

    p = commands.add_parser("explain", help="explain images with a timm Vision Transformer, or image-text pairs with CLIP (--text)",
                            description="Explain images with a timm Vision Transformer: one PNG per image (the "
                                        "methods side by side) and, with --json, the numbers on stdout. With --text, "
                                        "explain each image against each text with a CLIP model: per image a PNG (a row "
                                        "per text) and an HTML page of the coloured texts.")
    p.add_argument("images", nargs="+", help="image files (16-bit and float images are scaled by their range; "
                                             f"EXIF orientation is applied; animations use frame 1; at most {MAX_IMAGE_PIXELS:,} pixels)")
    p.add_argument("--model", default=None, help="timm model name (hub weights), local checkpoint (.pth/.pt/.bin/.safetensors, with --arch), "
                                             "'shapes' (the shipped ViT, default) or 'shapes-swin' (the shipped Swin). With --text: 'shapes-clip' (the shipped CLIP, default), "
                                             "'open_clip:ARCH:PRETRAINED' (a tag, a weights file, or 'random' for untrained weights), "
                                             "or a Hugging Face CLIP hub name or folder")
    p.add_argument("--text", action="append", default=None, metavar="TEXT",
                   help="a caption to explain each image against (repeat for several); switches to a CLIP model")
    p.add_argument("--arch", help="timm architecture of a local checkpoint")
    p.add_argument("--method", default="transformer_attribution", help=f"{methods}, or 'all' (side by side)")
    p.add_argument("--target", default=None, help="class to explain: an index or a class name, e.g. 'star' (default: the predicted class)")
    p.add_argument("--out", default=None, help=f"output folder for the PNGs (default {DEFAULT_OUT}; with --json, PNGs are written only when --out is given)")
    p.add_argument("--json", action="store_true", help=f"print the results as JSON on stdout: {TO_JSON}, one per method, "
                                                       "each over every image (or image-text pair) in the order given")
    p.set_defaults(handler=run_explain)

    p = commands.add_parser("explain-text", help="explain texts with a BERT-family text classifier",
                            description="Explain texts with a BERT-family text classifier: coloured words in a terminal, "
                                        "word and score columns when stdout is not a terminal, JSON with --json.")
    p.add_argument("texts", nargs="+", metavar="TEXT", help="one or more texts (quote each)")
    p.add_argument("--model", default=None,
                   help="hub name or local folder of a BERT/RoBERTa/DistilBERT sequence classifier "
                        "(default: the shipped drug-review sentiment model)")
    p.add_argument("--method", default="transformer_attribution", help=f"{methods}, or 'all'")
    p.add_argument("--target", default=None,
                   help="class to explain: an index or a label name, e.g. 'positive' (default: the predicted class)")
    p.add_argument("--out", default=None, help="write an HTML page of the coloured texts here (e.g. x.html)")
    p.add_argument("--max-length", type=int, default=None, help="truncate longer texts to this many tokens, [CLS] and [SEP] included (with a warning)")
    p.add_argument("--tokens", action="store_true", help="show word pieces instead of words")
    p.add_argument("--quiet", action="store_true", help="print nothing but --json's numbers")
    p.add_argument("--json", action="store_true", help=f"print the results as JSON on stdout: {TO_JSON}, one per method, "
                                                       "each over every text")
    p.set_defaults(handler=_lazy("relevancy.apps.cli.text", "run_explain_text"))

    p = commands.add_parser("explain-generation", help="explain every token a decoder language model (or, with --image, a "
                                                       "vision-language decoder) generates",
                            description="Generate greedily from a prompt with a decoder language model (or read a given "
                                        "continuation, --target) and explain every generated token over the prompt and "
                                        "the tokens before it: coloured rows in a terminal, token and score columns when "
                                        "stdout is not a terminal, JSON with --json, an HTML page with --out (choose a "
                                        "generated token to see what it read).")
    p.add_argument("prompt", metavar="PROMPT", help="the prompt (quote it)")
    p.add_argument("--model", default="smollm2", help="'smollm2' (SmolLM2-135M-Instruct, offline, see docs/smollm2.md; default), "
                                                      "'gemma3' (Gemma-3-270M, docs/gemma3.md) or a local folder of a decoder "
                                                      "language model (docs/language_models.md) with its tokenizer (save_pretrained)")
    p.add_argument("--method", default="attnlrp", help=f"one of {', '.join(GENERATION_METHOD_NAMES)} (default attnlrp)")
    p.add_argument("--max-new-tokens", type=int, default=32, help=f"tokens to generate, 1 to {MAX_NEW_TOKENS} (default 32; "
                                                                  "generation stops earlier after an end-of-text token)")
    p.add_argument("--target", default=None, metavar="TEXT", help="explain this continuation of the prompt instead of "
                                                                  f"generating (at most {MAX_NEW_TOKENS} tokens; mind the leading space)")
    p.add_argument("--image", default=None, metavar="PICTURE", help="an image file the prompt asks about: --model is then a "
                                                                   "local folder of a vision-language decoder whose generations "
                                                                   "relevancy explains (LLaVA, LLaVA-NeXT, LLaVA-OneVision, Gemma 3, "
                                                                   "Idefics3, PaliGemma, InternVL, Qwen2/2.5/3-VL; "
                                                                   "docs/vision_language.md) with its processor, which makes the "
                                                                   "model's inputs; each generated token's image map comes with "
                                                                   "its text relevance")
    p.add_argument("--out", default=None, help="write the HTML page here (e.g. generation.html)")
    p.add_argument("--json", action="store_true", help=f"print the result as JSON on stdout: {TO_JSON} (the tokens, the prompt "
                                                       "length, the generated ids and text, the (G, T + G) scores, the relevance totals)")
    p.set_defaults(handler=_lazy("relevancy.apps.cli.generation", "run_explain_generation"))

    p = commands.add_parser("explain-corpus", help="explain a corpus of prompts with a decoder language model: a resumable, "
                                                   "sharded run written as a Parquet dataset",
                            description="Explain every prompt of a file (JSON lines: a text, chat messages or an object "
                                        "per line; a text file: a prompt per line) or of a saved Hugging Face dataset "
                                        "(save_to_disk) with a decoder language model, in padded batches of similar "
                                        "length within --memory-budget. Writes OUT/shards/part-*.parquet (one row per "
                                        "prompt: relevancy.load_corpus(OUT), or datasets' \"parquet\" loader), "
                                        "OUT/run.json and OUT/report.md. Under torchrun every process takes its share; a "
                                        "killed run continues when the same command runs again (with any process count).")
    p.add_argument("prompts", metavar="PROMPTS", help="a .jsonl or text file of prompts, or a folder saved by datasets' save_to_disk")
    p.add_argument("--model", default="smollm2", help="'smollm2' (default, offline), 'gemma3', or a local folder of a decoder "
                                                      "language model and its tokenizer (save_pretrained)")
    p.add_argument("--method", default="attnlrp", help="a decoder method (default attnlrp; docs/language_models.md)")
    p.add_argument("--out", required=True, help="the output folder (continued where it holds this run's batches)")
    p.add_argument("--prompt-column", default="prompt", help="the prompt's column of JSON objects or dataset rows (default prompt)")
    p.add_argument("--target-column", default=None, help="a column holding each prompt's target: a token id, a text (one token "
                                                        "or an answer span, read teacher-forced) or a list of token ids "
                                                        "(default: each prompt's predicted next token)")
    p.add_argument("--id-column", default=None, help="a column holding each prompt's id (default: its index)")
    p.add_argument("--generate", action="store_true", help="explain the model's own continuation of each prompt (every "
                                                          "generated token, --max-new-tokens at most)")
    p.add_argument("--max-new-tokens", type=int, default=32, help=f"with --generate: tokens to generate, 1 to {MAX_NEW_TOKENS} (default 32)")
    p.add_argument("--latent", default=None, metavar="PARTS", help="also keep relevance inside the model: 'layers', 'heads' or "
                                                                 "'layers,heads'")
    p.add_argument("--memory-budget", default="1GiB", metavar="SIZE", help="the memory one batch may take, e.g. 512MiB, 8GiB "
                                                                          "(default 1GiB): batches are planned from it")
    p.add_argument("--max-batch", type=int, default=64, help="the most prompts in one batch (default 64)")
    p.add_argument("--dtype", default=None, choices=("float32", "float64", "bfloat16", "float16"),
                   help="run the model in this dtype (default: as loaded)")
    p.add_argument("--device", default="auto", help="'auto' (default: the process's GPU under torchrun, LOCAL_RANK, where "
                                                    "there is one; else the CPU), 'cpu', or a torch device such as cuda:1")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per process (default: torch's choice)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(handler=_lazy("relevancy.apps.cli.corpus", "run_explain_corpus"))

    p = commands.add_parser("explain-detections", help="explain every object a DETR model detects in each image",
                            description="Explain each object a transformers DetrForObjectDetection detects (best class "
                                        "probability above --threshold): per image a PNG with one panel per object (map, "
                                        "box, class) and, with --json, the boxes and score grids on stdout.")
    p.add_argument("images", nargs="+", help="image files")
    p.add_argument("--model", required=True, help="local folder of a transformers DetrForObjectDetection (save_pretrained); "
                                                   "pictures are preprocessed by its preprocessor_config.json, else as the "
                                                   "shapes detector where it is one, else as COCO DETR")
    p.add_argument("--method", default="generic_attention", help=f"{methods} (default generic_attention)")
    p.add_argument("--threshold", type=float, default=0.5, help="detection probability threshold (default 0.5, the authors')")
    p.add_argument("--max-objects", type=int, default=10, help="explain at most this many objects per image, the most "
                                                               "probable (default 10, at most 30)")
    p.add_argument("--out", default=None, help=f"output folder for the PNGs (default {DEFAULT_OUT}; with --json, PNGs are written only when --out is given)")
    p.add_argument("--json", action="store_true", help=f"print the results as JSON on stdout: {TO_JSON}, one per image with an "
                                                       "object (its objects' maps, classes, logits and boxes)")
    p.set_defaults(handler=_lazy("relevancy.apps.cli.detections", "run_explain_detections"))

    p = commands.add_parser("explain-question", help="explain the shapes LXMERT's answers to questions about generated scenes",
                            description="Explain the answers of the shapes visual-question LXMERT (offline): per question "
                                        "and method a PNG (the scene's regions drawn as boxes over it, each filled by its "
                                        "relevance) and an HTML page (the question's words coloured by theirs). Either N "
                                        "questions of the world about unseen scenes (--n, --seed; the true answers are "
                                        "known), or your own --question(s) about scene --scene. Each question's predicted "
                                        "answer is explained.")
    p.add_argument("--model", default="shapes", help="'shapes' (the shipped shapes LXMERT, default) or a shapes-LXMERT "
                                                     ".safetensors file with its .json beside it")
    p.add_argument("--question", action="append", default=None, metavar="TEXT",
                   help="a question about --scene (repeat for several), in the world's words, e.g. 'what color is the star'")
    p.add_argument("--scene", type=int, default=None, help="with --question: the scene, make_questions(1, seed=SCENE) (default 0)")
    p.add_argument("--n", "-n", dest="n", type=int, default=None, help="without --question: how many questions of the world (default 4)")
    p.add_argument("--seed", type=int, default=0, help="without --question: the questions of make_questions(n, VQA_TEST_SEED + 3 SEED), "
                                                       "0-999 (default 0; the scenes of evaluate --benchmark shapes-vqa --seed SEED with the same --n)")
    p.add_argument("--method", default="generic_attention", help=f"{methods}, or 'all' (every method that explains LXMERT; "
                                                                 "default generic_attention, the ICCV'21 method)")
    p.add_argument("--out", default=None, help=f"output folder (default {DEFAULT_OUT})")
    p.add_argument("--json", action="store_true", help=f"print the results as JSON on stdout: {TO_JSON}, one per method, "
                                                       "each over every question")
    p.set_defaults(handler=_lazy("relevancy.apps.cli.questions", "run_explain_question"))

    p = commands.add_parser("demo", help="explain generated scenes with the shipped model (offline) and write an HTML page")
    p.add_argument("--out", default="demo", help="output folder (default: demo)")
    p.add_argument("--singles", type=int, default=3, help="single-object scenes (default 3)")
    p.add_argument("--pairs", type=int, default=3, help="two-object scenes (default 3)")
    p.add_argument("--methods", default="all", help="'all' or a comma-separated list")
    p.add_argument("--photos", action="store_true",
                   help="instead: explain real photographs (scikit-image's) with a DINOv2-S/14 through concepts given by "
                        "example images, offline, and write OUT/photos.html; needs the 'photos' extra (--singles, --pairs "
                        "and --methods are for the shapes demo)")
    p.set_defaults(handler=run_demo)

    p = commands.add_parser(
        "evaluate",
        help="run the papers' evaluation protocols (perturbation, segmentation, discrimination, agreement)",
        description="Evaluate explanation methods: perturbation and segmentation tests (Chefer et al.), class "
                    "discrimination, agreement with token ablation (Brocki & Chung). Writes results.json (percentages "
                    "in percent), report.md and perturbation.png to --out. Run under `torchrun --nproc-per-node K` to "
                    "shard any benchmark's items over K processes (gloo); the results are the same. Each finished "
                    "batch is recorded in --out/partial/ as it goes: the same command run again after a kill "
                    "continues where it stopped.",
    )
    p.add_argument("--benchmark", default="shapes",
                   help="shapes (synthetic scenes with exact masks, offline; default), imagenet (perturbation on an "
                        "ImageFolder validation set), imagenet-seg (segmentation on gtsegs_ijcv.mat) or eraser "
                        "(token-F1 of a text classifier against ERASER rationales, e.g. Movie Reviews) or shapes-clip (grounding of "
                        "captions naming one object of two-object scenes by the shipped shapes CLIP: image and text side) or coco-detr "
                        "(the DETR segmentation test: Otsu masks of each detected object's map, COCO APs from IoU 0.2) or "
                        "shapes-detection (every object the shipped shapes DETR detects in generated scenes of 1-3 objects, "
                        "explained and scored against its exact mask: the DETR segmentation test, pointing game, shares of "
                        "relevance on the object, the other objects and the background) or shapes-vqa (the shipped shapes "
                        "LXMERT's answers to questions about generated scenes, explained on both sides and scored against "
                        "the regions and words of the object(s) each question is about: share of image relevance, pointing "
                        "game, token-F1, and the ICCV'21 perturbation AUCs) or llm-retrieval (a decoder language model's answers to "
                        "generated retrieval prompts, explained by every decoder method: share of relevance on the "
                        "supporting fact, pointing, deletion AUCs of the answer's log-probability, a random row) or vlm-shapes (the "
                        "shipped shapes LLaVA's words naming objects in its answers about generated scenes, explained by "
                        "every vision-language method: share of image relevance in the object's mask, pointing, patch "
                        "deletion AUCs of the word's log-probability, beside patch ablation and random scores)")
    p.add_argument("--data", help="imagenet: the validation folder (DIR/<wnid>/*.JPEG); imagenet-seg: gtsegs_ijcv.mat; "
                                  "coco-detr: a COCO instances annotation file")
    p.add_argument("--images", help="coco-detr: the folder the annotations' file names are relative to (default: the "
                                    "annotation file's folder)")
    p.add_argument("--model", default=None, help="'shapes' (the shipped model, default; for the shapes benchmark also "
                        "'shapes-swin', the shipped shapes Swin; for shapes-clip the shipped shapes CLIP, "
                        "for shapes-detection the shipped shapes DETR, for shapes-vqa the shipped shapes LXMERT), a timm model "
                        "name, or a local checkpoint (with --arch; for shapes-clip a shapes-CLIP .safetensors file; for "
                        "shapes-detection a shapes-DETR, for shapes-vqa a shapes-LXMERT .safetensors file with its .json beside it); "
                        "llm-retrieval: 'smollm2' (default), 'gemma3', 'retrieval-attention', 'retrieval-deltanet', 'retrieval-mamba2' (the "
                        "retrieval world's small decoders, those that ship) or a folder of a causal language model and its tokenizer; "
                        "vlm-shapes: 'shapes' (the shipped shapes LLaVA), 'shapes-qwen-vl' (the shipped shapes Qwen2.5-VL) or a shapes "
                        "model's .safetensors file with its .json")
    p.add_argument("--arch", help="timm architecture of a local checkpoint, or 'shapes' / 'shapes-swin' for a checkpoint of the shapes "
                                      "ViT / Swin (as training.shapes_vit / training.shapes_swin write them)")
    p.add_argument("--methods", default="all", help="'all' (default) or a comma-separated list of methods")
    p.add_argument("--n", "-n", "--num-images", dest="n", type=int, default=None,
                   help="images to evaluate (shapes: one-object scenes, default 500, plus n//2 two-object scenes; "
                        "shapes-clip, shapes-detection: default 200; shapes-vqa: questions, default 300; llm-retrieval: prompts, default 30; vlm-shapes: scenes, default 100; imagenet, "
                        "imagenet-seg: default all). Under torchrun write -n or --num-images: torchrun "
                        "reads --n as an abbreviation of its own options")
    p.add_argument("--batch-size", type=int, default=16, help="images (llm-retrieval: prompts, and the perturbed prompts read at once) explained together (default 16)")
    p.add_argument("--out", default="relevancy-eval", help="output folder (default relevancy-eval)")
    p.add_argument("--seed", type=int, default=0, help="shapes: which scenes; imagenet: which images; shapes-detection: "
                                                        "0-999, the scenes of seed DETECTION_TEST_SEED + S; shapes-vqa: 0-999, "
                                                        "the questions of seed VQA_TEST_SEED + 3 S; llm-retrieval: 0-99, the "
                                                        "test prompts of llm_world seed S; vlm-shapes: 0-299, the scenes of "
                                                        "seed VLM_TEST_SEED + 32 S (default 0)")
    p.add_argument("--threshold", type=float, default=None,
                   help="shapes-detection: the detection probability threshold (default 0.5, the authors')")
    p.add_argument("--perturbation-n", type=int, default=None,
                   help="shapes-vqa: the perturbation test (text and image, positive and negative) runs on the first P "
                        "questions (default min(n, 100): it costs 15 to 60 times the maps; 0: skip it)")
    p.add_argument("--paper-settings", action="store_true",
                   help="the authors' evaluation options: start_layer=1 for rollout and transformer_attribution, "
                        "normalised attention_gradcam, squash resize without crop for ImageNet")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per process (default: torch's choice)")
    p.add_argument("--workers", type=int, default=0, help="data-loading worker processes for the ImageNet benchmarks")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--split", default="test", help="eraser: which split's annotations (default test)")
    p.add_argument("--json", action="store_true", help="also print the summary metrics as JSON on stdout (results.json "
                                                       "without its lists: curves, per-class IoU)")
    p.set_defaults(handler=_lazy("relevancy.apps.cli.evaluate", "evaluate"))

    p = commands.add_parser("serve", help="serve a web page (and its JSON API) that explains images, texts, image-text pairs and generations",
                            description="Serve the web page: upload an image or pick a sample, choose methods and a target, "
                                        "see the maps; a text tab, an image-text (CLIP) tab and a text-generation tab; the JSON API under it is "
                                        "documented at /docs. Needs the 'serve' extra. Models load once, at start.")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0: any free port, printed at start)")
    p.add_argument("--model", action="append", default=None, metavar="NAME",
                   help="an image model to offer (repeat for several): 'shapes' (the shipped ViT), 'photo' (DINOv2 small, "
                        "when installed), or a timm model name (hub weights, loaded at start). Default: shapes, and photo where it loads")
    p.add_argument("--text-model", default=None, help="the text tab's model: hub name or folder of a BERT-family classifier, "
                                                      "or 'none' (default: the shipped sentiment model, with the 'text' extra)")
    p.add_argument("--clip-model", default=None, help="the image-text tab's model: as `explain --text --model`, or 'none' "
                                                      "(default: the shipped shapes CLIP, with the 'text' extra)")
    p.add_argument("--language-model", default=None, help="the generation tab's model: 'smollm2', a folder of a decoder "
                                                          "language model (as `explain-generation --model`), a folder of a "
                                                          "vision-language decoder and its processor (the tab then takes an "
                                                          "image upload, as `explain-generation --image`), or 'none' "
                                                          "(default: SmolLM2, see docs/smollm2.md)")
    p.add_argument("--max-running", type=int, default=2, help="explanations computed at once (default 2)")
    p.add_argument("--max-waiting", type=int, default=4, help="explanation requests that may wait for a slot; more are "
                                                              "answered 503 at once (default 4)")
    p.add_argument("--time-limit", type=float, default=30.0, help="seconds per explanation request, waiting included (default 30)")
    p.add_argument("--max-per-client", type=int, default=2, help="explanation requests one client address may have in flight; "
                                                                 "more are answered 429 at once (default 2)")
    p.add_argument("--body-timeout", type=float, default=10.0, help="seconds for a request body to arrive whole; a slower "
                                                                    "one is answered 408 (default 10)")
    p.add_argument("--max-memory-mb", type=int, default=4_096, help="memory the running explanations may take together, MiB; a "
                                                                  "request estimated over its share (this / --max-running) is answered "
                                                                  "413 before it starts (default 4,096; docs/serve.md)")
    p.add_argument("--max-image-mb", type=float, default=8.0, help="largest image file, MiB (default 8)")
    p.add_argument("--max-body-mb", type=float, default=16.0, help="largest request, MiB; images travel as base64 (default 16)")
    p.add_argument("--max-pixels", type=int, default=16_000_000, help="largest image, pixels, read before decoding (default 16,000,000)")
    p.add_argument("--max-text-chars", type=int, default=2_000, help="longest text, caption or prompt, characters (default 2,000)")
    p.add_argument("--max-new-tokens", type=int, default=32, help=f"most tokens a text-generation request may generate, 1 to "
                                                                  f"{MAX_NEW_TOKENS} (default 32; each costs a backward pass)")
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="longest text-generation prompt, tokens of the language "
                                                                      "model's tokenizer, 1 to 100,000 (default 512)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.set_defaults(handler=_lazy("relevancy.apps.serve.command", "run_serve"))
    return parser


#: the longest error message printed (a library may quote a whole input); longer ones are cut
MAX_ERROR_CHARS = 1_000


#: commands that run for minutes or for good: they keep Python's cycle collector running in their own process
LONG_RUNNING = ("evaluate", "explain-corpus", "serve")


@contextmanager
def _short_lived_process(command: str) -> Iterator[None]:
    """For a command that runs in a process of its own and ends soon: Python's cycle collector off while it imports
    and runs, and everything frozen at the end. Importing torch, timm and matplotlib builds millions of objects, and
    the collector would walk them again and again while they load and once more when the interpreter exits: about
    1.3 s of a 3.6 s `relevancy explain` (`benchmarks/cold_start.py`). Explanations make no reference cycles
    (`tests/test_cli.py`), so nothing waits uncollected."""
    if command in LONG_RUNNING:
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()  # the exit's last collection passes over frozen objects
        gc.enable()


#: the options that name a model (a name, a file or a folder), in every command that has them
MODEL_OPTIONS = ("model", "arch", "text_model", "clip_model", "language_model")


def check_model_options(args: argparse.Namespace) -> None:
    """Every model a command names that is a special file (a FIFO, a device) or a folder holding one, refused by
    what it is before any loader reads it (reading one may never end)."""
    for name in MODEL_OPTIONS:
        value = getattr(args, name, None)
        for each in value if isinstance(value, list) else [value]:
            if isinstance(each, (str, Path)):
                check_model_path(str(each), "--" + name.replace("_", "-"))


#: the arguments that are texts to explain or name (file names may hold any bytes; a text must be UTF-8)
TEXT_ARGUMENTS = {"texts": "TEXT", "prompt": "PROMPT", "text": "--text", "target": "--target", "question": "--question"}


def check_text_arguments(args: argparse.Namespace) -> None:
    """A UsageError naming the argument and the byte when a text on the command line is not UTF-8 (Python keeps
    such bytes as lone surrogates, which tokenizers refuse in their own words)."""
    for name, shown in TEXT_ARGUMENTS.items():
        value = getattr(args, name, None)
        for each in value if isinstance(value, list) else [value]:
            if not isinstance(each, str):
                continue
            try:
                each.encode("utf-8")
            except UnicodeEncodeError as error:
                code = ord(each[error.start])  # surrogateescape keeps a byte b that is not UTF-8 as U+DC00 + b
                what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
                raise UsageError(f"{shown} is not UTF-8 text: {what} at character {error.start + 1}; "
                                 "write the text in UTF-8 (as a terminal set to a UTF-8 locale does)") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the exit status (2 for a bad request, nothing written)."""
    args = build_parser().parse_args(argv)
    try:
        check_text_arguments(args)
        check_model_options(args)
        with warnings.catch_warnings():
            warnings.showwarning = lambda message, *_: warn(args.command, " ".join(str(message).split()))
            written = args.handler(args)
    except (UsageError, ValueError, TypeError, OSError, RuntimeError, MissingExtraError) as error:
        message = " ".join(str(error).split())  # one line, whatever the library wrote
        if len(message) > MAX_ERROR_CHARS:
            message = f"{message[: MAX_ERROR_CHARS - 20]}... ({len(message):,} characters)"
        print(f"relevancy {args.command}: error: {message}", file=sys.stderr)
        return 2
    stream = sys.stderr if getattr(args, "json", False) else sys.stdout  # stdout carries the JSON
    for path in written or []:
        print(f"wrote {path}", file=stream)
    return 0


def entry_point() -> NoReturn:
    """The `relevancy` command in a process of its own: `main`, with the collector set for a short-lived process."""
    args = sys.argv[1:]
    command = next((arg for arg in args if not arg.startswith("-")), "")
    with _short_lived_process(command):
        status = main(args)
    raise SystemExit(status)



__all__ = ["METHOD_NAMES", "MAX_IMAGE_PIXELS", "UsageError", "build_parser", "entry_point", "main", "read_image"]
