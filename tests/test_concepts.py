"""Concepts given by examples: the plain mean latent and the contrasted one (issue 24 item 9)."""
from __future__ import annotations

import pytest
import torch

import relevancy
from models import tiny_vit
from relevancy.methods.targets import CONCEPT_KINDS, LDA_SHRINKAGE, example_latents

GENERATOR = torch.Generator().manual_seed(0)
CATS, CUPS, BIRDS = (torch.randn(3, 3, 32, 32, generator=GENERATOR) for _ in range(3))


def latents(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """Each image's pre-logits latent, one forward each (the arithmetic is checked against these)."""
    return torch.cat([example_latents(model, image[None]) for image in images])


def test_a_concept_without_reference_is_the_plain_mean_latent():
    model = tiny_vit()
    concept = relevancy.Concept(model, CATS)
    assert concept.kind == "plain"
    torch.testing.assert_close(concept.vector, latents(model, CATS).mean(0))


def test_a_concept_with_reference_images_is_the_difference_of_the_means():
    model = tiny_vit()
    concept = relevancy.Concept(model, CATS, reference=torch.cat([CUPS, BIRDS]), kind="contrast")
    assert concept.kind == "contrast"
    expected = latents(model, CATS).mean(0) - latents(model, torch.cat([CUPS, BIRDS])).mean(0)
    torch.testing.assert_close(concept.vector, expected)
    plain = relevancy.Concept(model, CATS, reference=CUPS, kind="plain")
    torch.testing.assert_close(plain.vector, latents(model, CATS).mean(0))


def test_reference_concepts_weigh_the_same_whatever_their_number_of_examples():
    model = tiny_vit()
    cups, birds = relevancy.Concept(model, CUPS), relevancy.Concept(model, BIRDS[:1])
    concept = relevancy.Concept(model, CATS, reference=[cups, birds], kind="contrast")
    expected = latents(model, CATS).mean(0) - (latents(model, CUPS).mean(0) + latents(model, BIRDS[:1]).mean(0)) / 2
    torch.testing.assert_close(concept.vector, expected)


def test_a_contrasted_set_takes_each_mean_minus_the_mean_of_the_others():
    model = tiny_vit()
    means = {name: latents(model, images).mean(0) for name, images in (("cat", CATS), ("cup", CUPS), ("bird", BIRDS))}
    found = {name: relevancy.Concept(model, images) for name, images in (("cat", CATS), ("cup", CUPS), ("bird", BIRDS))}
    contrasted = relevancy.Concept.contrasted(found, kind="contrast")
    for name, mean in means.items():
        others = torch.stack([m for n, m in means.items() if n != name]).mean(0)
        torch.testing.assert_close(contrasted[name].vector, mean - others)
        assert contrasted[name].kind == "contrast"
    plain = relevancy.Concept.contrasted(found, kind="plain")
    for name, mean in means.items():
        torch.testing.assert_close(plain[name].vector, mean)
    assert {name: c.vector for name, c in found.items()}.keys() == means.keys()  # the inputs are left as they were
    torch.testing.assert_close(found["cat"].vector, means["cat"])


def test_a_contrast_concept_explains_like_its_vector():
    model = tiny_vit()
    concept = relevancy.Concept(model, CATS, reference=CUPS, kind="contrast")
    restored = relevancy.Concept.from_vector(concept.vector)
    a = relevancy.explain(model, BIRDS, method="cdam", target=concept).scores
    b = relevancy.explain(model, BIRDS, method="cdam", target=restored).scores
    torch.testing.assert_close(a, b)


def fisher(groups: list[torch.Tensor], target: int) -> torch.Tensor:
    """Fisher's direction written out: the target group's mean minus the others' mean (each group weighs the same),
    through the pooled within-group covariance shrunk towards trace / D times the identity."""
    deviations = torch.cat([g - g.mean(0) for g in groups]).double()
    covariance = deviations.T @ deviations / len(deviations)
    dims = covariance.shape[0]
    shrunk = (1 - LDA_SHRINKAGE) * covariance + LDA_SHRINKAGE * covariance.trace() / dims * torch.eye(dims, dtype=torch.float64)
    others = torch.stack([g.mean(0) for k, g in enumerate(groups) if k != target]).mean(0)
    return (torch.linalg.inv(shrunk) @ (groups[target].mean(0) - others).double()).float()


def test_an_lda_concept_is_fishers_direction_with_the_shrunk_covariance():
    model = tiny_vit()
    groups = [latents(model, images) for images in (CATS, CUPS, BIRDS)]
    concept = relevancy.Concept(model, CATS, reference=torch.cat([CUPS, BIRDS]), kind="lda")
    torch.testing.assert_close(concept.vector, fisher([groups[0], torch.cat(groups[1:])], 0), rtol=1e-4, atol=1e-4)
    found = {name: relevancy.Concept(model, images) for name, images in (("cat", CATS), ("cup", CUPS), ("bird", BIRDS))}
    contrasted = relevancy.Concept.contrasted(found, kind="lda")
    for k, name in enumerate(found):
        torch.testing.assert_close(contrasted[name].vector, fisher(groups, k), rtol=1e-4, atol=1e-4)
        assert contrasted[name].kind == "lda"


def test_lda_is_the_default_wherever_there_is_a_reference():
    model = tiny_vit()
    found = {name: relevancy.Concept(model, images) for name, images in (("cat", CATS), ("cup", CUPS))}
    assert {c.kind for c in relevancy.Concept.contrasted(found).values()} == {"lda"}
    with_reference = relevancy.Concept(model, CATS, reference=CUPS)
    torch.testing.assert_close(with_reference.vector, relevancy.Concept(model, CATS, reference=CUPS, kind="lda").vector)
    assert with_reference.kind == "lda" and relevancy.Concept(model, CATS).kind == "plain"


def test_an_lda_concept_of_single_examples_is_the_contrast():
    model = tiny_vit()
    found = {name: relevancy.Concept(model, images[:1]) for name, images in (("cat", CATS), ("cup", CUPS))}
    lda, contrast = relevancy.Concept.contrasted(found, kind="lda"), relevancy.Concept.contrasted(found, kind="contrast")
    torch.testing.assert_close(lda["cat"].vector, contrast["cat"].vector)


@pytest.mark.parametrize("kind", ["contrasts", "Plain", "LDA", 1])
def test_a_misspelt_kind_names_the_valid_ones(kind):
    with pytest.raises(ValueError) as error:
        relevancy.Concept(tiny_vit(), CATS, reference=CUPS, kind=kind)
    message = str(error.value)
    assert "\n" not in message and repr(kind) in message and all(repr(k) in message for k in CONCEPT_KINDS)
    with pytest.raises(ValueError, match="concept kind must be one of"):
        relevancy.Concept.contrasted({"a": relevancy.Concept(tiny_vit(), CATS), "b": relevancy.Concept(tiny_vit(), CUPS)}, kind=kind)


def test_contrast_without_anything_to_contrast_with_is_refused():
    model = tiny_vit()
    for kind in ("contrast", "lda"):
        with pytest.raises(ValueError, match=f"kind='{kind}' needs a reference"):
            relevancy.Concept(model, CATS, kind=kind)
    with pytest.raises(ValueError, match="at least two concepts"):
        relevancy.Concept.contrasted({"cat": relevancy.Concept(model, CATS)})
    with pytest.raises(ValueError, match="made from a vector"):
        relevancy.Concept(model, CATS, reference=[relevancy.Concept.from_vector(torch.randn(32))])
    with pytest.raises(TypeError, match="concept 'cup' must be a Concept"):
        relevancy.Concept.contrasted({"cat": relevancy.Concept(model, CATS), "cup": CUPS})


def test_a_reference_of_another_model_is_refused_naming_both_sizes():
    other = relevancy.Concept(tiny_vit(embed_dim=48), CUPS)
    with pytest.raises(ValueError, match="the reference's latents have 48 dimensions but the examples' have 32"):
        relevancy.Concept(tiny_vit(), CATS, reference=[other])
