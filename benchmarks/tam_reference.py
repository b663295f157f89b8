"""Make tests/golden/tam_reference.pt: the TAM authors' own maps (github.com/xmed-lab/TAM, `tam.py`'s `TAM()` as
their eval.py calls it, round by round, `save_fn=''`: the eval-only path) on tiny random float64 vision-language
decoders, for `tests/test_token_activation_map.py`:

    git -C /work/.mirror/xmed-lab+TAM/repo archive HEAD | tar -x -C /tmp/TAM
    python3 -m venv /tmp/tamenv && /tmp/tamenv/bin/pip install --no-deps opencv-python-headless scipy pymupdf numpy
    echo <relevancy's venv>/lib/python3.11/site-packages > /tmp/tamenv/lib/python3.11/site-packages/relevancy.pth
    /tmp/tamenv/bin/python benchmarks/tam_reference.py --tam /tmp/TAM [--out tests/golden/tam_reference.pt]

Their code is imported as it is; the script only
- builds the inputs their `special_ids` bookkeeping reads: the image's placeholders first (`img_id`: every
  placeholder), then the prompt's words, then the two tokens that end the prompt (`prompt_id` ends at the last,
  `answer_id` starts after the pair), so their prompt span is every text token before the generation;
- gives a stand-in processor whose token i is the word "t<i>" (their word lists are then the token ids);
- makes their `logit_list` as `model.generate(output_hidden_states=True)` does, from one forward over the prompt
  and a fixed continuation (the prompt's positions, then one position per generated token), each through
  `lm_head` as their demo does;
- keeps their numbers in float64: their `TAM` casts the scores with `.float()`, which the logits' tensor class
  answers with float64 here (`KeepsFloat64`);
- records what their `rank_guassian_filter` takes and gives (the float maps before their x 255 uint8
  quantisation) and what their `least_squares` (scipy's Brent minimiser) returns, by replacing those two module
  functions with recording wrappers of themselves.
Round 0 of their `TAM()` runs once per prompt word (`[0, t]`) and returns the map of the first, the model's
prediction there (their eval's map of the first generated token); its last, `t = len(prompt)`, is the map of the
next token after the prompt with its class read at the last prompt position, i.e. the last prompt token's id:
`explain` with that token as target gives it (their repeated-word check compares the first continuation token
instead, which no earlier word of these prompts is, as none is the last prompt token; in the first case the
continuation starts with that token). Rounds 1.. are the maps of the generated tokens 1.. . Everything is recorded
twice: with their `least_squares`, and (`_exact`) with it answering the least-squares scale `<a, b> / <b, b>` that
their scipy Brent search finds to its tolerance. A case is one entry of `CASES` (the family's name in
`tests/vlm_models.py` or `tests/qwen_vl_models.py`, its image tokens' grid, a continuation); the Qwen2-VL's, Gemma 3's
and InternVL's prompts hold the image between its start and end tokens, as their processors write it, which their
Qwen2-VL demo's special ids locate it by (`ENCLOSED`).
LLaVA-NeXT's image is two grids, the base tile's and the tiles' (their `vision_shape` as a list, the way their code
takes several images: normalised together, filtered apart); the newline after each row of the tiles' grid is no
cell of it, so those positions are taken out of the tokens and the logits their code reads (`NEWLINES`), the choice
relevancy makes; their records are then the grids' maps flattened one after the other. InternVL's tiles are seven
grids the same way, each tile's tokens (the thumbnail's last); its `image_sizes`, which only relevancy reads, go to
the model's forward too, which leaves them unread.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]

import qwen_vl_models  # noqa: E402
import vlm_models  # noqa: E402
from vlm_models import IMAGE_TOKEN, checksum  # noqa: E402

#: the two tokens that end every prompt (their `prompt_id` end, their `answer_id` start): in no prompt or
#: continuation (the Qwen2-VL's own pair: 92 is its vision start)
END = [91, 92]
QWEN_END = [90, 91]
#: the words of the prompt (a repeated word, and words the continuations repeat: their repeated-word exclusion)
PROMPT = [17, 40, 52, 40, 66, 8]
#: name -> (family of `vlm_models` or `qwen_vl_models`, their vision_shape: the image tokens' grid, the
#: continuation); the image, its further inputs and its placeholders' count are those of the family's `inputs`
#: (new cases go last: a case's image is drawn from its place in this order)
CASES = {
    "llava_next_token": ("llava", (4, 4), [92, 40, 71, 17, 71, 30, 8]),  # starts with the prompt's last token
    "llava": ("llava", (4, 4), [33, 40, 71, 17, 71, 30, 8]),
    "gemma3": ("gemma3", (2, 2), [33, 40, 71, 17, 71, 30]),
    "idefics3": ("idefics3", (2, 2), [33, 52, 71, 17, 71, 5]),
    # the image's 4 x 6 patches merged 2 x 2: their demo's vision_shape (h // 2, w // 2)
    "qwen2_vl": ("qwen2_vl", (2, 3), [33, 40, 71, 17, 71, 30, 8]),
    "qwen3_vl": ("qwen3_vl", (2, 3), [33, 40, 71, 17, 71, 30, 8]),  # DeepStack: as for Qwen2-VL, their code reads logits only
    "paligemma": ("paligemma", (4, 4), [33, 40, 71, 17, 71, 30, 8]),
    "internvl": ("internvl", (2, 2), [33, 40, 71, 17, 71, 30, 8]),  # the 4 x 4 patches pixel-shuffled 2 x 2
    # the base tile's 4 x 4 tokens, then the tiles' 6 x 8 (a 24 x 32 image's 2 x 2 tiles, unpadded)
    "llava_next": ("llava_next", ((4, 4), (6, 8)), [33, 40, 71, 17, 71, 30, 8]),
    # InternVL's 2 x 3 tiles and thumbnail, each its 2 x 2 pixel-shuffled tokens: seven grids, in the processor's order
    "internvl_tiles": ("internvl_tiles", ((2, 2),) * 7, [33, 40, 71, 17, 71, 30, 8]),
}
#: the image's placeholders that are no cell of its grids, by family: LLaVA-NeXT's newline after each of the tiles'
#: grid's 6 rows of 8 tokens (after the base tile's 16)
NEWLINES = {"llava_next": [16 + 9 * row + 8 for row in range(6)]}
#: what a family's forward reads beside its processor's output, from the tokens and the prompt's length, as
#: relevancy's adapter passes it (Gemma 3: each image's tokens attend to each other; Qwen2-VL: which tokens are the
#: image's, as its processor marks them; PaliGemma: the prompt a prefix, 0, the continuation after it, 1, as its
#: generate types it)
FORWARD_EXTRAS = {"gemma3": lambda ids, _: {"token_type_ids": (ids == IMAGE_TOKEN).long()},
                  **{family: lambda ids, _: {"mm_token_type_ids": (ids == IMAGE_TOKEN).int()} for family in ("qwen2_vl", "qwen3_vl")},
                  "paligemma": lambda ids, prompt: {"token_type_ids": (torch.arange(ids.shape[1]) >= prompt).long()[None]}}


#: the families whose processor writes a token before the image's placeholders and one after (`ImageSpan`'s
#: before and after), their ids in the tiny models: Gemma 3's begin and end of image (its config's), InternVL's
#: `<img>` and `</img>` (no config names them)
ENCLOSED = {"gemma3": (93, 94), "internvl": (93, 94), "internvl_tiles": (93, 94)}


def layout(family: str) -> tuple[object, list[int], list[int], dict]:
    """`(the family's models module, the prompt's tokens before PROMPT, the two end tokens, their special_ids)`:
    LLaVA and the others the image's placeholders alone (`img_id` every placeholder); Qwen2-VL, Gemma 3 and InternVL
    their placeholders between the image's start and end tokens, located by those two as their Qwen2-VL demo does."""
    if family in qwen_vl_models.FAMILIES:
        start, end = qwen_vl_models.VISION_START, qwen_vl_models.VISION_END
        count = qwen_vl_models.image_tokens()
        return (qwen_vl_models, [start] + [IMAGE_TOKEN] * count + [end], QWEN_END,
                {"img_id": [start, end], "prompt_id": [end, QWEN_END[1]], "answer_id": [QWEN_END, -1]})
    count = int((vlm_models.inputs(family, lengths=(1,))["input_ids"] == IMAGE_TOKEN).sum())
    if family in ENCLOSED:
        start, end = ENCLOSED[family]
        return (vlm_models, [start] + [IMAGE_TOKEN] * count + [end], END,
                {"img_id": [start, end], "prompt_id": [end, END[1]], "answer_id": [END, -1]})
    return vlm_models, [IMAGE_TOKEN] * count, END, {"img_id": [IMAGE_TOKEN], "prompt_id": [[IMAGE_TOKEN], END[1]], "answer_id": [END, -1]}


class KeepsFloat64(torch.Tensor):
    """A tensor whose `.float()` is `.double()`: their scores stay float64 through `TAM`'s cast."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.float:
            func = torch.Tensor.double
        return super().__torch_function__(func, types, args, kwargs or {})


class Words:
    """A processor stand-in for their decoding: token i is the word "t<i>", a text splits at its spaces."""

    def __init__(self) -> None:
        self.tokenizer = self

    @staticmethod
    def batch_decode(rows, **_options) -> list[str]:
        return [" ".join(f"t{int(token)}" for token in row) for row in rows]

    @staticmethod
    def tokenize(text: str) -> list[str]:
        return text.split()


def their_maps(tam, family: str, shape: tuple, continuation: list[int], seed: int) -> dict:
    """Their maps of every round on one random image, the inputs and the records of the two wrapped functions; then
    (`exact`) the same with their `least_squares` answered by the least-squares scale itself, `<a, b> / <b, b>`
    (0 for an all-zero `b`), which their Brent search approximates to its tolerance (1.48e-8 of the scale). The
    positions of `NEWLINES` are left out of what their code reads (the record's `input_ids` keep them)."""
    models, head, end, special = layout(family)
    model = models.build(family)
    processed = models.inputs(family, lengths=(1,), seed=seed)
    image = {key: value for key, value in processed.items() if key not in ("input_ids", "attention_mask", "token_type_ids")}
    prompt = head + PROMPT + end
    tokens = prompt + continuation
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True, **image, **FORWARD_EXTRAS.get(family, lambda *_: {})(ids, len(prompt)))
        logits = model.lm_head(out.hidden_states[-1])
    assert torch.allclose(logits, out.logits, atol=0, rtol=1e-12)  # their logits are the model's
    kept = [k for k in range(len(prompt)) if k not in NEWLINES.get(family, [])]  # the placeholders come first
    steps = [logits[:, kept]] + [logits[:, len(prompt) + g - 1:len(prompt) + g] for g in range(1, len(continuation))]
    steps = [step.as_subclass(KeepsFloat64) for step in steps]
    read = [tokens[k] for k in kept] + continuation
    record = {"family": family, "checksum": checksum(model), "input_ids": ids, "prompt_length": len(prompt), "image": image}
    runs = {"": tam.least_squares, "_exact": lambda a, b: float(np.dot(a, b) / np.dot(b, b)) if np.dot(b, b) > 0 else 0.0}
    for suffix, least_squares in runs.items():
        record.update({f"{name}{suffix}": value for name, value in their_rounds(tam, least_squares, read, shape, steps, special).items()})
    return record


def their_rounds(tam, least_squares, tokens: list[int], shape: tuple, steps: list[torch.Tensor], special: dict) -> dict:
    """Their `TAM()` round by round, as their eval.py runs it, `least_squares` in place of theirs: the float maps
    their `rank_guassian_filter` gave (the next token's, the generated tokens' from the second on) and took (the
    generated tokens'), their uint8 maps, and the scales `least_squares` gave beside `<a, b> / <b, b>`. `shape`
    a list of grids (several images to their code): each map the grids' flattened one after the other."""
    grids = len(shape) if isinstance(shape[0], tuple) else 1
    filtered, scales = [], []
    filter_, their_least_squares = tam.rank_guassian_filter, tam.least_squares

    def recording_filter(img, kernel_size=3):
        out = filter_(img, kernel_size)
        filtered.append((torch.from_numpy(np.array(img, dtype=np.float64)), torch.from_numpy(np.array(out, dtype=np.float64))))
        return out

    def recording_least_squares(map1, map2):
        scale = least_squares(map1, map2)
        energy = np.dot(map2, map2)
        scales.append((float(scale), float(np.dot(map1, map2) / energy) if energy > 0 else 0.0))
        return scale

    tam.rank_guassian_filter, tam.least_squares = recording_filter, recording_least_squares
    try:
        picture = np.zeros((16, 16, 3), dtype=np.uint8)  # read by their visualisation only
        pictures = picture if grids == 1 else [picture] * grids
        history: list = []
        quantised = [joined(tam.TAM(tokens, shape, steps, special, pictures, Words(), "", g, history, False), grids)
                     for g in range(len(steps))]
    finally:
        tam.rank_guassian_filter, tam.least_squares = filter_, their_least_squares
    words = len(PROMPT) + len(END)  # their round 0: a map per word of their prompt (PROMPT, END[0]) and the next token's
    assert len(filtered) == grids * (words + len(steps) - 1), (len(filtered), words, len(steps))
    if grids > 1:  # one record per map: the grids' filter calls joined
        filtered = [tuple(torch.cat([pair[k].flatten() for pair in filtered[at:at + grids]]) for k in range(2))
                    for at in range(0, len(filtered), grids)]
    return {"next_token": torch.stack([out for _, out in filtered[:words]])[-1],
            "generated": torch.stack([out for _, out in filtered[words:]]),  # generated tokens 1..
            "generated_unfiltered": torch.stack([img for img, _ in filtered[words:]]),
            "uint8": torch.stack(quantised), "scales": torch.tensor(scales, dtype=torch.float64)}


def joined(maps: object, grids: int) -> torch.Tensor:
    """One map of their code as a tensor: the grids' maps (a list, `grids` > 1) flattened one after the other."""
    if grids == 1:
        return torch.from_numpy(np.array(maps))
    return torch.cat([torch.from_numpy(np.array(one)).flatten() for one in maps])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tam", type=Path, default=Path("/tmp/TAM"), help="the authors' repository (its tam.py)")
    parser.add_argument("--out", type=Path, default=ROOT / "tests/golden/tam_reference.pt")
    args = parser.parse_args()
    sys.path.insert(0, str(args.tam))
    import scipy
    import tam

    from importlib.metadata import version

    golden = {"versions": {"torch": str(torch.__version__), "numpy": np.__version__, "scipy": scipy.__version__,
                           "opencv": version("opencv-python-headless")},
              "cases": {name: their_maps(tam, *case, seed=k) for k, (name, case) in enumerate(CASES.items())}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(golden, args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} kB)")


if __name__ == "__main__":
    main()
