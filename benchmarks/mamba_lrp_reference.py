"""Make tests/golden/mamba_lrp_reference.pt: MambaLRP's own relevance (FarnoushRJ/MambaLRP, Jafari et al., NeurIPS 2024)
of a tiny transformers `MambaForCausalLM` in float64, which relevancy's `attnlrp` on Mamba must equal:

    /tmp/mlrpenv/bin/python benchmarks/mamba_lrp_reference.py [--out tests/golden/mamba_lrp_reference.pt]

Run it in a venv where `mamba_lrp` imports (its repository on the path, with einops; never a dependency of
relevancy, nothing of it copied here). The model is `tests/state_space_models.py`'s "mamba", wrapped by MambaLRP's
`ModifiedMambaForCausalLM` on its slow (PyTorch) path, and explained as its `relevance_propagation` does: input x
gradient at the token embeddings of the last position's logit of each row's target.

Two of its choices are recorded apart, so that a comparison tests the rules rather than rounding:
- its code casts its norms and parts of its scan to float32 (`.float()`, `.to(torch.float32)`, written for float32
  and half-precision models): here those casts keep a float64 tensor in float64 (`Tensor.float` and `Tensor.to`
  widened for the recording only);
- its identity rule divides by the input plus 1e-6 times its sign (`stabilize`): recorded as published
  (`published`) and with that epsilon at 0 (`exact`), which is the rule relevancy states (`f(x) / x`).
"""
from __future__ import annotations

import argparse
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests")]

from state_space_models import build  # noqa: E402

#: the explained rows (no padding: MambaLRP runs whole rows) and each row's target token
PROMPTS = torch.tensor([[5, 9, 17, 3, 40, 22, 8, 61, 14, 30], [70, 2, 33, 33, 12, 90, 4, 18, 51, 7]])
TARGETS = torch.tensor([11, 42])


@contextmanager
def float64_kept():
    """`Tensor.float()` and `Tensor.to(torch.float32)` leave a float64 tensor in float64 (MambaLRP's casts, written
    for float32 models)."""
    own_float, own_to = torch.Tensor.float, torch.Tensor.to

    def float_kept(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self if self.dtype == torch.float64 else own_float(self, *args, **kwargs)

    def to_kept(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        narrowing = self.dtype == torch.float64 and (args[:1] == (torch.float32,) or kwargs.get("dtype") == torch.float32)
        return self if narrowing else own_to(self, *args, **kwargs)

    torch.Tensor.float, torch.Tensor.to = float_kept, to_kept
    try:
        yield
    finally:
        torch.Tensor.float, torch.Tensor.to = own_float, own_to


def relevance(model: torch.nn.Module, stabilised: bool) -> torch.Tensor:
    """MambaLRP's relevance `(rows, T)` of each row's target logit at the last position."""
    import mamba_lrp.lrp.core as core
    from mamba_lrp.model.mamba_huggingface import ModifiedMambaForCausalLM

    published = core.stabilize
    if not stabilised:
        core.stabilize = lambda z: z
    try:
        wrapped = ModifiedMambaForCausalLM(model, is_fast_forward_available=False)
        with float64_kept():
            embeddings = model.backbone.embeddings(PROMPTS).detach().requires_grad_(True)
            logits = wrapped(inputs_embeds=embeddings, return_dict=True, use_cache=False)[:, -1, :]
            logits.gather(1, TARGETS[:, None]).sum().backward()
        return (embeddings * embeddings.grad).sum(2).detach()
    finally:
        core.stabilize = published


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "golden" / "mamba_lrp_reference.pt")
    args = parser.parse_args()
    import transformers

    model = build("mamba")
    weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    record = {"prompts": PROMPTS, "targets": TARGETS, "weights": weights, "transformers": transformers.__version__,
              "exact": relevance(model, stabilised=False), "published": relevance(model, stabilised=True)}
    torch.save(record, args.out)
    print(f"wrote {args.out}: exact {record['exact'].tolist()}")


if __name__ == "__main__":
    main()
