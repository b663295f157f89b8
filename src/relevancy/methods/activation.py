"""TAM, the token activation map (Li et al., ICCV 2025, "Token Activation Map to Visually Explain Multimodal LLMs";
the authors' code github.com/xmed-lab/TAM): where a vision-language decoder's logit of a token is high, read at
every position of one forward (each last hidden state through the output embeddings, no gradient), cleared of the
part the earlier text tokens' own maps explain (estimated causal inference) and denoised on the image's token grid
(the rank Gaussian filter). The bookkeeping of which earlier token stands for which map follows the authors'
`tam.TAM` exactly (docs/methods.md); `benchmarks/tam_reference.py` runs their code for the comparison."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..families.base import Adapter
from .targets import resolve_target

#: the stabiliser of the authors' interference weights, `w / (w.sum() + 1e-8)`
WEIGHT_EPSILON = 1e-8
#: the rank Gaussian filter's window side (the authors' `kernel_size=3`)
WINDOW = 3


@dataclass(frozen=True)
class History:
    """What one sequence's TAM reads for every token it explains: the positions of the image's grid tokens (the
    grids one after the other, each laid out as its `grid_shapes` entry, rows x columns) and of the text tokens (real, neither the image's nor its delimiters), and per text position the token its map is left out for (`keys`) and
    that map, the clipped logit of the token it stands for at each grid token (`maps` `(grid, text)`)."""

    grid: torch.Tensor
    grid_shapes: tuple[tuple[int, int], ...]
    text: torch.Tensor
    keys: torch.Tensor
    maps: torch.Tensor


def token_activation_map(adapter: Adapter, inputs: Any, target: Any, causal_inference: bool = True,
                         rank_filter: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TAM of the token after each row's last real token (`target`: its id; None: the predicted one): `(B, N)`,
    the image's tokens holding the map on their grid (min-max normalised with the text scores, then filtered;
    before the authors' x 255 uint8 quantisation), the earlier text tokens their normalised scores.
    `causal_inference`: subtract the interference of the earlier text tokens' maps (the authors' ECI, on by
    default as theirs); `rank_filter`: the rank Gaussian filter on the grid (on by default as theirs)."""
    mask = inputs.attention_mask
    rows = torch.arange(len(mask), device=mask.device)
    with torch.no_grad():
        hidden = adapter.hidden_of(inputs, inputs.input_ids, mask, inputs.pixel_values, rows)
        ends = adapter.streams(inputs)["text"].readout + 1  # each row's last real token reads the explained one
        logits = adapter.head(hidden[rows, ends - 1])
        indices = resolve_target(target, logits)
        if (indices < 0).any():
            raise ValueError("token_activation_map explains a token (a token id per row, or None for the predicted one), "
                             "not a function of the logits")
        scores = []
        for b, end in enumerate(ends.tolist()):
            read = history(adapter, hidden[b], inputs.input_ids[b], mask[b].bool(), end, adapter.image_token_grids(inputs))
            scores.append(activation_row(adapter, hidden[b], read, end, int(indices[b]), causal_inference, rank_filter))
    return torch.stack(scores), indices, logits


def token_activation_generation(adapter: Adapter, ids: torch.Tensor, mask: torch.Tensor, prompt_length: int, inputs: Any
                                ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """`explain_generation`'s TAM from one forward over the sequences `ids` `(B, N)` (prompts left-padded to
    `prompt_length`, the generated tokens after): `(text scores (B, G, N), explained logits (B, G), {"patches":
    (B, G, rows, cols)})`, row `g` the map of generated token `g` with the earlier generated tokens in its causal
    inference as the authors' rounds have them (rows past a sequence's end hold 0)."""
    rows = torch.arange(len(ids), device=ids.device)
    steps = ids.shape[1] - prompt_length
    with torch.no_grad():
        hidden = adapter.hidden_of(inputs, ids[:, :-1], mask[:, :-1], inputs.pixel_values, rows)
        explained = adapter.picked_logits(hidden[:, prompt_length - 1:], ids[:, prompt_length:])
        scores = torch.zeros(len(ids), steps, ids.shape[1], dtype=torch.promote_types(hidden.dtype, torch.float32), device=hidden.device)
        for b in range(len(ids)):
            read = history(adapter, hidden[b], ids[b, :-1], mask[b, :-1].bool(), prompt_length, adapter.image_token_grids(inputs))
            for g in range(steps):
                if mask[b, prompt_length + g]:
                    scores[b, g, :-1] = activation_row(adapter, hidden[b], read, prompt_length + g, int(ids[b, prompt_length + g]), True, True)
    image = ids == adapter.image_token
    on_tokens = scores[image[:, None].expand_as(scores)].view(len(ids), steps, -1)
    patches = adapter.image_token_map(on_tokens.flatten(0, 1), inputs).unflatten(0, (len(ids), steps))
    return scores.masked_fill(image[:, None], 0), explained, {"patches": patches}


def history(adapter: Adapter, hidden: torch.Tensor, ids: torch.Tensor, real: torch.Tensor, prompt_length: int,
            grids: tuple[tuple[torch.Tensor, tuple[int, int]], ...]) -> History:
    """One sequence's `History` (`hidden` `(N, D)` its last hidden states, `ids` and `real` `(N,)` its tokens and real
    ones; the generated tokens start at `prompt_length`; `grids` the adapter's `image_token_grids`: which of the
    image's placeholders each grid holds and its rows and columns; placeholders in no grid, LLaVA's kept [CLS] and
    LLaVA-NeXT's newlines, are neither grid nor text). Which token a text position stands for is the authors'
    bookkeeping: a prompt token its own id (the first one the model's prediction there, the argmax of its logits), a
    generated token's position the token generated after it; its key is its own id up to the position before the
    last prompt token and the next token from there on (their word list moves on to the answer at the last prompt
    position, which keeps its own id's map). A map is left out where its key is the explained token."""
    image = (ids == adapter.image_token) & real
    placeholders = image.nonzero()[:, 0]
    grid = placeholders[torch.cat([cells for cells, _ in grids]).to(placeholders.device)]
    delimiter = torch.isin(ids, torch.tensor(adapter.image_delimiters, dtype=ids.dtype, device=ids.device))
    text = (~image & ~delimiter & real).nonzero()[:, 0]
    following = ids.roll(-1)[text]  # the next token (the last position's, wrapped round, is never read)
    stands_for = torch.where(text >= prompt_length, following, ids[text])
    stands_for[:1] = adapter.head(hidden[text[:1]]).argmax(-1)
    keys = torch.where(text >= prompt_length - 1, following, ids[text])
    return History(grid, tuple(shape for _, shape in grids), text, keys, at_least_float32(adapter.class_logits(hidden[grid], stands_for)).clamp_min(0))


def activation_row(adapter: Adapter, hidden: torch.Tensor, read: History, explained_at: int, token: int,
                   causal_inference: bool, rank_filter: bool) -> torch.Tensor:
    """One row's TAM `(N,)` of `token` at position `explained_at`, read from the positions before it (`hidden` the
    row's last hidden states, `read` its `History`): the image's grid tokens get the map, the context's text tokens
    (those before the last position read, which reads the token itself) their scores normalised with it, every grid
    together (the authors' several images), each grid filtered apart."""
    count = int((read.text < explained_at - 1).sum())
    context = read.text[:count]
    activation = at_least_float32(adapter.picked_logits(hidden[:explained_at], read.text.new_full((explained_at,), token))).clamp_min(0)
    on_image, on_text = activation[read.grid], activation[context]
    if causal_inference and count:
        on_image = without_interference(on_image, on_text, read.maps[:, :count], read.keys[:count] != token)
    both = torch.cat([on_image, on_text])
    span = both.max() - both.min()
    both = (both - both.min()) / span if span > 0 else torch.zeros_like(both)
    on_image, on_text = both[:len(read.grid)], both[len(read.grid):]
    if rank_filter:
        cells = [rows * cols for rows, cols in read.grid_shapes]
        on_image = torch.cat([rank_gaussian_filter(part.view(shape)).flatten() for part, shape in zip(on_image.split(cells), read.grid_shapes)])
    row = torch.zeros(len(hidden), dtype=activation.dtype, device=activation.device)
    row[context], row[read.grid] = on_text, on_image
    return row


def at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    """Logits of a half-precision model in float32 for the arithmetic after them (float64 stays float64)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def without_interference(on_image: torch.Tensor, on_text: torch.Tensor, maps: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """Estimated causal inference: the image map less the least-squares multiple of the interference map, the
    context's `kept` maps `(grid, context)` weighted by the explained token's scores at them (divided by their sum),
    then clipped at 0. Nothing kept (every context token a repeat of the explained one): the map as it is."""
    if not kept.any():
        return on_image
    weights = on_text[kept] / (on_text[kept].sum() + WEIGHT_EPSILON)
    interference = maps[:, kept] @ weights
    energy = interference @ interference
    scale = (on_image @ interference) / energy if energy > 0 else 0.0
    return (on_image - scale * interference).clamp_min(0)


def rank_gaussian_filter(grid: torch.Tensor) -> torch.Tensor:
    """The authors' rank Gaussian filter on a `(rows, cols)` map: each cell's 3 x 3 window (reflected at the edges)
    sorted, weighted by a Gaussian over the ranks centred on the median whose width is the window's coefficient of
    variation (std / mean), 0 where the window's mean is not positive; a constant window keeps its value (the limit
    of a vanishing width, where the authors' code divides 0 by 0)."""
    padded = F.pad(grid[None, None], (WINDOW // 2,) * 4, mode="reflect")
    ranked = F.unfold(padded, WINDOW)[0].T.sort(-1).values  # (cells, 9)
    mean = ranked.mean(-1, keepdim=True)
    sigma = ranked.std(-1, correction=0, keepdim=True) / mean
    offsets = torch.arange(WINDOW ** 2, dtype=grid.dtype, device=grid.device) - WINDOW ** 2 // 2
    kernel = torch.exp(-offsets ** 2 / (2 * sigma ** 2))
    value = (ranked * kernel).sum(-1) / kernel.sum(-1)
    value = torch.where(sigma[:, 0] > 0, value, ranked[:, WINDOW ** 2 // 2])
    return torch.where(mean[:, 0] > 0, value, torch.zeros_like(value)).view_as(grid)
