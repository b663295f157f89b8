"""The retrieval world's small decoders (`relevancy.worlds.retrieval_models`): the world's word-level tokenizer reads
every prompt without an unknown word and gives the benchmark one answer token after each prompt; each mixer's model
builds over it and is mapped by relevancy; the trainer runs."""
from __future__ import annotations

import pytest
from relevancy.evaluation.llm_retrieval import answer_ids, encode
from relevancy.families.causal_lm import CausalLMAdapter
from relevancy.worlds import language, retrieval_models
from relevancy.worlds.retrieval_models import ARCHITECTURES


def test_the_tokenizer_reads_every_prompt_and_answer():
    tokenizer = retrieval_models.world_tokenizer()
    items = language.prompts("train", 50) + language.prompts("test", 50, n_people=3)
    for item in items:
        ids = tokenizer(item.text + item.answer)["input_ids"]
        assert tokenizer.unk_token_id not in ids
    inputs, context, evidence = encode(tokenizer, items[:8])
    answers = answer_ids(tokenizer, items[:8], inputs)
    assert [tokenizer.convert_ids_to_tokens(int(a)) for a in answers] == [item.answer.strip() for item in items[:8]]
    assert (evidence <= context).all() and evidence.any(1).all()


@pytest.mark.parametrize("mixer", list(ARCHITECTURES))
def test_each_mixer_builds_and_is_mapped(mixer):
    """Attention only (Llama), gated DeltaNet beside attention (Qwen3.5), Mamba-2 beside attention (Falcon-H1)."""
    model = retrieval_models.build(mixer)
    adapter = CausalLMAdapter(model)
    assert adapter.layout.name == {"attention": "llama", "deltanet": "qwen3_next", "mamba2": "falcon_h1"}[mixer]
    assert sum(p.numel() for p in model.parameters()) < 300_000


def test_an_unknown_mixer_is_named():
    with pytest.raises(ValueError, match="unknown mixer 'lstm'; the retrieval models: attention, deltanet, mamba2"):
        retrieval_models.build("lstm")



def test_the_trainer_runs_and_saves_a_loadable_model(tmp_path):
    """Two steps of the trainer write a transformers folder (model and tokenizer) that loads and answers."""
    from training.retrieval_models import accuracy, main

    main(["--mixer", "mamba2", "--steps", "2", "--out", str(tmp_path), "--threads", "1", "--val-n", "10", "--batch-size", "4"])
    model, tokenizer = retrieval_models.load_folder(tmp_path)
    assert set(accuracy(model, tokenizer, 10, seed=0)) == {"overall", *language.KINDS}
