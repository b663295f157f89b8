"""Make tests/golden/llm_lxt_reference.pt: lxt's own AttnLRP and CP-LRP maps on tiny random decoders, in float64.

    python benchmarks/llm_lxt_reference.py [--out tests/golden/llm_lxt_reference.pt]

Needs lxt 2.1 (the `bench` extra; never a dependency of relevancy itself). How the file is made:
- two models with random weights (fixed seeds), float64, eval: a `LlamaForCausalLM` (2 layers, width 32, 4 query
  heads sharing 2 key/value heads, gated SiLU MLP of width 48, RMSNorm, RoPE, tied embeddings) and a
  `GPT2LMHeadModel` (2 layers, width 32, 4 heads, LayerNorm, GELU MLP); vocabulary 96, `initializer_range` 0.2 so
  that the maps are not dominated by one token;
- a batch of three sequences of 7, 5 and 3 tokens (ids drawn from a seeded generator, pad id 0), right padded and
  left padded to 7, and each sequence alone unpadded; position ids count the real tokens only
  (`attention_mask.cumsum(-1) - 1`, 0 at padding), so that a padded row is the same computation as the row alone;
- the target of each row is the model's most probable next token after its last real token;
- lxt's efficient implementation (the `attnLRP` and `cp_LRP` patch maps of `lxt.efficient.models.llama` / `gpt2`,
  applied as `lxt.efficient.monkey_patch` applies them; see `lxt_models` for why the package's `__init__` is
  skipped) patches transformers' classes; the model then runs from `inputs_embeds` (the token
  embeddings, requiring grad), the target logit of each row is summed and back-propagated, and the map is
  `(inputs_embeds * inputs_embeds.grad).sum(-1)`, lxt's input x relevance, `(B, T)`;
- attention runs with transformers' `sdpa` (in float64 on the CPU exactly the float64 softmax; transformers' own
  `eager` computes the softmax in float32). lxt 2.1 replaces `ALL_ATTENTION_FUNCTIONS` of the modeling module
  with a plain dict of its wrapped functions, which transformers 5 can no longer look up (`get_interface`); this
  script puts lxt's same wrapped functions back into an `AttentionInterface`, nothing else. Every patch is undone
  after each run, so the two variants do not mix. The eager maps are checked against the saved ones (printed).
The file holds each model's config and state dict, the inputs and the maps (a few hundred kB).
"""
from __future__ import annotations

import argparse
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

LENGTHS = (7, 5, 3)
VOCAB = 96
PAD = 0
SEEDS = {"llama": 0, "gpt2": 1}


def build(arch: str) -> torch.nn.Module:
    """The tiny random float64 model of `arch` ("llama" or "gpt2")."""
    import transformers

    torch.manual_seed(SEEDS[arch])
    if arch == "llama":
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=True, initializer_range=0.2,
        )
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
            attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0,
        )
        model = transformers.GPT2LMHeadModel(config)
    return model.double().eval()


def batches() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`{"right": (ids, mask), "left": ..., "single0": ..., ...}`: the three sequences padded both ways and alone."""
    generator = torch.Generator().manual_seed(2)
    sequences = [torch.randint(1, VOCAB, (n,), generator=generator) for n in LENGTHS]
    width = max(LENGTHS)
    out = {}
    for side in ("right", "left"):
        ids = torch.full((len(sequences), width), PAD)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            span = slice(0, len(sequence)) if side == "right" else slice(width - len(sequence), width)
            ids[row, span], mask[row, span] = sequence, 1
        out[side] = (ids, mask)
    for row, sequence in enumerate(sequences):
        out[f"single{row}"] = (sequence[None], torch.ones((1, len(sequence)), dtype=torch.long))
    return out


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids counting real tokens only, 0 at padding."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def last_real(mask: torch.Tensor) -> torch.Tensor:
    """The index of each row's last real token (left or right padding)."""
    return mask.shape[1] - 1 - mask.flip(-1).argmax(-1)


def lxt_models(name: str) -> object:
    """lxt's patch-map module `lxt.efficient.models.<name>`. The `lxt.efficient` package's `__init__` imports every
    model lxt knows, and its BERT module imports a transformers 4 module that transformers 5 removed; so the two
    packages are entered as bare namespaces and only the model module asked for (and what it imports) is run."""
    import importlib
    import sys
    import types

    import lxt

    for package_name in ("lxt.efficient", "lxt.efficient.models"):
        if package_name not in sys.modules:
            package = types.ModuleType(package_name)
            package.__path__ = [str(Path(lxt.__file__).parent.joinpath(*package_name.split(".")[1:]))]
            sys.modules[package_name] = package
    return importlib.import_module(f"lxt.efficient.models.{name}")


def restore_class_attributes(saved: dict[type, dict[str, object]]) -> None:
    """Each class's attributes as `saved` holds them (`cls.__dict__.get(name)` before a patch): set back, or removed
    where the class had none of its own."""
    for cls, attributes in saved.items():
        for name, value in attributes.items():
            if value is None and name in cls.__dict__:
                delattr(cls, name)
            elif value is not None:
                setattr(cls, name, value)


@contextmanager
def lxt_applied(module: object, patch_map: dict) -> Iterator[None]:
    """lxt's `patch_map` on transformers' modeling `module` applied, as `lxt.efficient.monkey_patch` applies it,
    and undone after."""
    from transformers.modeling_utils import AttentionInterface

    classes = [target for target in patch_map if isinstance(target, type)]
    saved_forwards = {cls: {name: cls.__dict__.get(name) for name in ("forward", "_norm")} for cls in classes}
    saved_eager, saved_interface = module.eager_attention_forward, module.ALL_ATTENTION_FUNCTIONS
    saved_local = dict(saved_interface._local_mapping)
    try:
        for target, patch in patch_map.items():
            if not patch(target):
                raise RuntimeError(f"lxt could not patch {target}")
        if not hasattr(module.ALL_ATTENTION_FUNCTIONS, "get_interface"):  # lxt 2.1 left a plain dict
            interface = AttentionInterface()
            interface._local_mapping = dict(module.ALL_ATTENTION_FUNCTIONS)
            module.ALL_ATTENTION_FUNCTIONS = interface
        yield
    finally:
        restore_class_attributes(saved_forwards)
        module.eager_attention_forward, module.ALL_ATTENTION_FUNCTIONS = saved_eager, saved_interface
        saved_interface._local_mapping = saved_local


@contextmanager
def lxt_patched(arch: str, variant: str) -> Iterator[None]:
    """lxt's patch map for `arch` and `variant` ("attnLRP" or "cp_LRP") applied, and undone after."""
    from transformers.models.gpt2 import modeling_gpt2
    from transformers.models.llama import modeling_llama

    module = modeling_llama if arch == "llama" else modeling_gpt2
    with lxt_applied(module, getattr(lxt_models(arch), variant)):
        yield


def targets(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The most probable next token after each row's last real token (plain model)."""
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=False).logits
    return logits[torch.arange(len(ids)), last_real(mask)].argmax(-1)


def lxt_map(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """lxt's input x relevance `(B, T)` for the target logits (lxt's patches must be applied)."""
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions(mask), use_cache=False).logits
    logits[torch.arange(len(ids)), last_real(mask), target].sum().backward()
    return (embeds * embeds.grad).sum(-1).detach()


def write_golden(golden: dict, out: Path) -> None:
    """Save a reference file (its folder made) and say its size and transformers' version."""
    import transformers

    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(golden, out)
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} kB) with transformers {transformers.__version__}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests/golden/llm_lxt_reference.pt")
    args = parser.parse_args()
    inputs = batches()
    golden: dict = {"inputs": inputs, "models": {}}
    for arch in SEEDS:
        model = build(arch)
        entry = {"config": model.config.to_dict(), "state_dict": {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"},  # tied
                 "targets": {}, "attnlrp": {}, "cp_lrp": {}}
        for name, (ids, mask) in inputs.items():
            entry["targets"][name] = targets(model, ids, mask)
        for variant, key in (("attnLRP", "attnlrp"), ("cp_LRP", "cp_lrp")):
            for implementation in ("sdpa", "eager"):
                model.config._attn_implementation = implementation
                with lxt_patched(arch, variant):
                    maps = {name: lxt_map(model, ids, mask, entry["targets"][name]) for name, (ids, mask) in inputs.items()}
                if implementation == "sdpa":
                    entry[key] = maps
                else:
                    worst = max(float((maps[n] - entry[key][n]).abs().max() / entry[key][n].abs().max()) for n in maps)
                    print(f"{arch} {key}: eager (float32 softmax) vs sdpa, largest difference / map maximum {worst:.1e}")
            model.config._attn_implementation = "sdpa"
            for row in range(len(LENGTHS)):
                single = entry[key][f"single{row}"][0]
                right = entry[key]["right"][row, : len(single)]
                left = entry[key]["left"][row, -len(single):]
                gap = max(float((right - single).abs().max()), float((left - single).abs().max())) / float(single.abs().max())
                assert gap < 1e-10, f"{arch} {key} row {row}: padded differs from single by {gap:.1e}"
        golden["models"][arch] = entry
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(golden, args.out)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} kB)")


if __name__ == "__main__":
    main()
