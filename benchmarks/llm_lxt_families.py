"""Make tests/golden/llm_lxt_families.pt: lxt's own AttnLRP and CP-LRP maps on tiny random Qwen3, Gemma 3 and
Qwen3-MoE decoders, in float64.

    python benchmarks/llm_lxt_families.py [--qwen3-moe PATH] [--out tests/golden/llm_lxt_families.pt]

Run it in a venv with lxt (never a dependency of relevancy): `python3 -m venv /work/venvs/lxt &&
/work/venvs/lxt/bin/pip install torch==2.14.1 lxt==2.1 transformers` (lxt 2.1 from PyPI, transformers 5.24.0 then).
lxt 2.1 maps Qwen3 and Gemma 3 (`lxt.efficient.models.qwen3` / `gemma3`, `attnLRP` and `cp_LRP`); its Qwen3-MoE
map (`attnLRP` only) is in lxt's repository after the 2.1 release (github.com/rachtibat/LRP-eXplains-Transformers,
`lxt/efficient/models/qwen3_moe.py`, commit 2ab094b, unchanged at f043441): `--qwen3-moe` names that file, which
is imported as the module `lxt.efficient.models.qwen3_moe` of the installed lxt (it imports nothing newer).

How the file is made, as `llm_lxt_reference.py` makes the Llama / GPT-2 one (same inputs, same targets, same map):
- the models are `tests/decoder_families.py`'s (a fixed seed and config per family, every norm's weight drawn at
  random too), float64, eval, attention through transformers' `sdpa`; the file holds no weights but each model's
  checksum (sha256 of its float64 weights), which the tests check after building the same model;
- the three sequences padded right, padded left and alone; each row's target the most probable next token; lxt's
  map `(inputs_embeds * grad).sum(-1)` at the token embeddings (Gemma 3's scaled ones: what its embedding returns);
- lxt's patch map on the family's modeling module (see `llm_lxt_reference.lxt_applied`), undone after each run.
lxt's maps of a padded row equal those of the row alone to 1e-10 (checked here).
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(Path(__file__).resolve().parent)]

from decoder_families import build, checksum  # noqa: E402
from llm_lxt_reference import LENGTHS, batches, lxt_applied, lxt_map, lxt_models, targets, write_golden  # noqa: E402

#: family -> lxt's variants of it (lxt 2.1 has no CP-LRP map of Qwen3-MoE)
VARIANTS = {"qwen3": ("attnLRP", "cp_LRP"), "gemma3": ("attnLRP", "cp_LRP"), "qwen3_moe": ("attnLRP",)}
KEYS = {"attnLRP": "attnlrp", "cp_LRP": "cp_lrp"}


def lxt_family(family: str, qwen3_moe: Path | None) -> object:
    """lxt's patch-map module of `family` (Qwen3-MoE's from the file `qwen3_moe`)."""
    if family != "qwen3_moe":
        return lxt_models(family)
    if qwen3_moe is None:
        raise SystemExit("--qwen3-moe: give lxt's lxt/efficient/models/qwen3_moe.py (see this script's docstring)")
    lxt_models("qwen3")  # the bare lxt.efficient.models namespace
    spec = importlib.util.spec_from_file_location("lxt.efficient.models.qwen3_moe", qwen3_moe)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--qwen3-moe", type=Path, help="lxt's qwen3_moe.py (lxt's repository, after 2.1)")
    parser.add_argument("--out", type=Path, default=ROOT / "tests/golden/llm_lxt_families.pt")
    args = parser.parse_args()
    import transformers

    inputs = batches()
    golden: dict = {"inputs": inputs, "transformers": transformers.__version__, "models": {}}
    for family, variants in VARIANTS.items():
        model = build(family)
        model.config._attn_implementation = "sdpa"
        modeling = importlib.import_module(type(model).__module__)
        entry = {"checksum": checksum(model), "targets": {name: targets(model, ids, mask) for name, (ids, mask) in inputs.items()}}
        for variant in variants:
            with lxt_applied(modeling, getattr(lxt_family(family, args.qwen3_moe), variant)):
                maps = {name: lxt_map(model, ids, mask, entry["targets"][name]) for name, (ids, mask) in inputs.items()}
            for row in range(len(LENGTHS)):
                single = maps[f"single{row}"][0]
                right, left = maps["right"][row, : len(single)], maps["left"][row, -len(single):]
                gap = max(float((right - single).abs().max()), float((left - single).abs().max())) / float(single.abs().max())
                assert gap < 1e-10, f"{family} {variant} row {row}: padded differs from single by {gap:.1e}"
            entry[KEYS[variant]] = maps
            print(f"{family} {variant}: map maxima {[round(float(m.abs().max()), 3) for m in maps.values()]}")
        golden["models"][family] = entry
    write_golden(golden, args.out)


if __name__ == "__main__":
    main()
