"""TAM, the token activation map (Li et al., ICCV 2025, "Token Activation Map to Visually Explain Multimodal LLMs";
the authors' code github.com/xmed-lab/TAM): where a vision-language decoder's logit of a token is high, read at
every position of one forward (each last hidden state through the output embeddings, no gradient), cleared of the
part the earlier text tokens' own maps explain (estimated causal inference) and denoised on the image's token grid
(the rank Gaussian filter). The bookkeeping of which earlier token stands for which map follows the authors'
`tam.TAM` exactly (docs/methods.md); `benchmarks/tam_reference.py` runs their code for the comparison."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..families.base import Adapter
from .targets import resolve_target

#: the stabiliser of the authors' interference weights, `w / (w.sum() + 1e-8)`
WEIGHT_EPSILON = 1e-8
#: the rank Gaussian filter's window side (the authors' `kernel_size=3`)
WINDOW = 3


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
        scores = torch.stack([activation_row(adapter, hidden[b], inputs.input_ids[b], mask[b].bool(), int(ends[b]), int(ends[b]),
                                             int(indices[b]), causal_inference, rank_filter) for b in range(len(mask))])
    return scores, indices, logits


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
        scores = torch.zeros(len(ids), steps, ids.shape[1], dtype=hidden.dtype, device=hidden.device)
        for b in range(len(ids)):
            for g in range(steps):
                if mask[b, prompt_length + g]:
                    scores[b, g] = activation_row(adapter, hidden[b], ids[b], mask[b].bool(), prompt_length + g, prompt_length,
                                                  int(ids[b, prompt_length + g]), True, True)
    image = ids == adapter.image_token
    on_tokens = scores[image[:, None].expand_as(scores)].view(len(ids), steps, -1)
    patches = adapter.image_token_map(on_tokens.flatten(0, 1)).unflatten(0, (len(ids), steps))
    return scores.masked_fill(image[:, None], 0), explained, {"patches": patches}


def activation_row(adapter: Adapter, hidden: torch.Tensor, ids: torch.Tensor, real: torch.Tensor, explained_at: int,
                   prompt_length: int, token: int, causal_inference: bool, rank_filter: bool) -> torch.Tensor:
    """One row's TAM `(N,)` of `token` at position `explained_at` (read from the positions before it; `hidden`
    `(N', D)` the row's last hidden states, `real` its real tokens; the generated tokens start at `prompt_length`).
    The image's grid tokens get the map, the context's text tokens (real, not the image's, before the last
    position read) their scores normalised with it."""
    image = (ids == adapter.image_token) & real
    grid = image.nonzero()[adapter.image_prefix:, 0]  # LLaVA's kept [CLS] is no cell of the grid
    context = ((~image & real).nonzero()[:, 0])
    context = context[context < explained_at - 1]  # the position that reads the token itself is left out
    activation = adapter.picked_logits(hidden[:explained_at], ids.new_full((explained_at,), token)).clamp_min(0)
    on_image, on_text = activation[grid], activation[context]
    if causal_inference and len(context):
        on_image = without_interference(adapter, hidden, ids, grid, context, prompt_length, token, on_image, on_text)
    both = torch.cat([on_image, on_text])
    span = both.max() - both.min()
    both = (both - both.min()) / span if span > 0 else torch.zeros_like(both)
    on_image, on_text = both[:len(grid)], both[len(grid):]
    if rank_filter:
        side = int(len(grid) ** 0.5)
        on_image = rank_gaussian_filter(on_image.view(side, side)).flatten()
    row = torch.zeros(len(ids), dtype=activation.dtype, device=activation.device)
    row[context], row[grid] = on_text, on_image
    return row


def without_interference(adapter: Adapter, hidden: torch.Tensor, ids: torch.Tensor, grid: torch.Tensor, context: torch.Tensor,
                         prompt_length: int, token: int, on_image: torch.Tensor, on_text: torch.Tensor) -> torch.Tensor:
    """Estimated causal inference: the image map less the least-squares multiple of the interference map, the mean of
    the context tokens' maps weighted by the explained token's scores at them, then ReLU. As in the authors' history
    of maps: a prompt token stands for the map of its own id (the first one for the model's prediction there), a
    generated token's position for the map of the token generated after it; the last prompt token's position keeps
    its own id's map but is left out as the first generated token is (their word list there moves on to the answer),
    and every position whose token is the explained one's is left out (no repeated word explains itself)."""
    after = (context >= prompt_length).long()
    classes = ids[context + after]
    classes[0] = adapter.head(hidden[context[0]]).argmax()
    keys = ids[context + (context >= prompt_length - 1).long()]
    kept = keys != token
    if not kept.any():
        return on_image
    weights = on_text[kept] / (on_text[kept].sum() + WEIGHT_EPSILON)
    maps = adapter.picked_logits(hidden[grid][:, None], classes[kept][None]).clamp_min(0)  # (grid, kept)
    interference = maps @ weights
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
