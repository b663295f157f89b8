"""`relevancy evaluate --benchmark llm-retrieval`: the metrics on hand-made maps and a hand-made model, and one run
of the command on a tiny random Llama with a byte-level BPE tokenizer trained here (offline, fast)."""
from __future__ import annotations

import json
import types

import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from relevancy.worlds import language as llm_world
from relevancy.apps.cli import main
from relevancy.evaluation import llm_retrieval
from relevancy.evaluation.deletion import area
from relevancy.evaluation.llm_retrieval import deletion_curves, encode, evidence_scores


@pytest.fixture(scope="module")
def tokenizer():
    """A byte-level BPE of 300 tokens learnt from the world's train prompts (the answer's space starts a token)."""
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    texts = [item.text + item.answer for item in llm_world.prompts("train", 200)]
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe)


@pytest.fixture(scope="module")
def tiny_llama(tokenizer):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config).eval()


def test_a_map_on_the_evidence_alone_gets_share_and_pointing_one():
    context = torch.tensor([[False, True, True, True, True, False]] * 3)
    evidence = torch.tensor([[False, False, True, True, False, False]] * 3)
    scores = torch.tensor([[9.0, 0.0, 2.0, 1.0, -3.0, 9.0],    # all positive context relevance on the evidence
                           [0.0, 1.0, 1.0, 1.0, 1.0, 0.0],     # even: half the context is evidence; ties: the first
                           [0.0, 5.0, -1.0, -1.0, 0.0, 0.0]])  # none on the evidence
    result = evidence_scores(scores, context, evidence)
    assert result["share"].tolist() == [1.0, 0.5, 0.0]
    assert result["pointing"].tolist() == [1.0, 0.0, 0.0]
    assert evidence_scores(-scores.abs(), context, evidence)["share"].tolist() == [0.0, 0.0, 0.0]  # no positive value


class CountingModel(torch.nn.Module):
    """A hand-made 'language model': the answer's logit after a sequence is the number of evidence tokens in it
    (`evidence_ids`), every other logit 0, so deleting evidence tokens lowers the answer's log-probability."""

    def __init__(self, evidence_ids: set[int], answer: int, vocab: int = 50) -> None:
        super().__init__()
        self.evidence_ids, self.answer, self.vocab = evidence_ids, answer, vocab

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, use_cache: bool = False):
        hits = torch.isin(input_ids, torch.tensor(sorted(self.evidence_ids))) & attention_mask.bool()
        logits = torch.zeros(*input_ids.shape, self.vocab)
        logits[..., self.answer] = 3.0 * hits.cumsum(1)
        return types.SimpleNamespace(logits=logits)


def test_morf_with_perfect_scores_drops_faster_than_random_and_lerf_keeps_the_answer():
    evidence_ids, length = {7, 8, 9}, 24
    ids = torch.tensor([[1, 2, 7, 3, 4, 8, 5, 6, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 2, 1],
                        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 0, 0]])
    mask = torch.tensor([[1] * length, [1] * (length - 2) + [0, 0]])
    inputs = {"input_ids": ids, "attention_mask": mask}
    context = torch.zeros_like(ids, dtype=torch.bool)
    context[:, 1:21] = True  # the first and last real tokens stand for the question and the answer prefix
    perfect = torch.isin(ids, torch.tensor(sorted(evidence_ids))).double()
    random = torch.rand(ids.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    clean, curves = deletion_curves(CountingModel(evidence_ids, answer=40), inputs, context, torch.tensor([40, 40]),
                                    {"perfect": perfect, "random": random}, batch_size=5)
    areas = {name: {d: area(c) for d, c in by.items()} for name, by in curves.items()}
    assert (clean > -0.01).all() and (curves["perfect"]["morf"][:, 0] == 0).all()
    assert (areas["perfect"]["morf"] < areas["random"]["morf"] - 1).all()
    assert (areas["perfect"]["morf"] < areas["perfect"]["lerf"]).all()
    # least relevant first: the evidence goes only in the last steps, so the answer stays until then
    assert (curves["perfect"]["lerf"][:, :8].abs() < 1e-3).all() and (curves["perfect"]["lerf"][:, -1] < -3.5).all()
    assert torch.allclose(curves["perfect"]["morf"][:, -1], curves["random"]["lerf"][:, -1])  # all removed: one read


def test_the_facts_and_the_evidence_are_found_in_the_tokens(tokenizer):
    items = llm_world.prompts("test", 3)
    inputs, context, evidence = encode(tokenizer, items)
    for row, item in enumerate(items):
        tokens = inputs["input_ids"][row]
        assert tokenizer.decode(tokens[evidence[row]]).strip() == item.facts[item.evidence_fact]
        assert tokenizer.decode(tokens[context[row]]).strip() == " ".join(item.facts)
    assert (inputs["attention_mask"].sum(1) == torch.tensor([len(tokenizer(i.text)["input_ids"]) for i in items])).all()
    answers = llm_retrieval.answer_ids(tokenizer, items, inputs)
    assert [tokenizer.decode([a]) for a in answers.tolist()] == [tokenizer.decode(tokenizer(i.answer)["input_ids"][:1]) for i in items]


def test_the_command_writes_the_table_and_leaves_nothing_on_bad_input(tiny_llama, tokenizer, tmp_path, capsys):
    folder = tmp_path / "tiny"
    tiny_llama.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "eval"
    code = main(["evaluate", "--benchmark", "llm-retrieval", "--model", str(folder), "--n", "2", "--batch-size", "2",
                 "--methods", "attnlrp,raw_attention", "--out", str(out), "--json", "--quiet"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads((out / "results.json").read_text())
    assert printed == written and written["benchmark"] == "llm-retrieval" and written["n"] == 2
    assert 0.1 < written["chance"] < 0.3  # one fact of six
    assert list(written["methods"]) == ["attnlrp", "raw_attention", "random"]
    for name, entry in written["methods"].items():
        assert 0 <= entry["share"] <= 1 and entry["pointing"] in (0, 0.5, 1)
        assert entry["gap"] == pytest.approx(entry["lerf"] - entry["morf"])
        assert len(entry["curves"]["morf"]) == len(llm_retrieval.STEPS) and entry["curves"]["morf"][0] == 0
        assert (name == "random") != ("time_ratio" in entry)
    assert "| `attnlrp` |" in (out / "report.md").read_text()
    bad = tmp_path / "bad"
    assert main(["evaluate", "--benchmark", "llm-retrieval", "--model", str(folder), "--methods", "attn_lrp", "--out", str(bad)]) == 2
    assert "valid methods: attnlrp, cp_lrp" in capsys.readouterr().err and not bad.exists()
    assert main(["evaluate", "--benchmark", "llm-retrieval", "--model", str(tmp_path / "none"), "--out", str(bad)]) == 2
    assert "'smollm2'" in capsys.readouterr().err and not bad.exists()


def test_the_model_keeps_its_modes(tiny_llama, tokenizer):
    tiny_llama.train()
    tiny_llama.model.layers[0].eval()
    try:
        results = llm_retrieval.evaluate_llm_retrieval(tiny_llama, tokenizer, methods=("raw_attention",), n=1)
        assert tiny_llama.training and not tiny_llama.model.layers[0].training and tiny_llama.model.layers[1].training
    finally:
        tiny_llama.eval()
    assert list(results["methods"]) == ["raw_attention", "random"] and results["n"] == 1
    with pytest.raises(ValueError, match="batch sizes must be at least 1"):
        llm_retrieval.evaluate_llm_retrieval(tiny_llama, tokenizer, n=1, deletion_batch_size=0)
