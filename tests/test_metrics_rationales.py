import json
from collections import defaultdict

import pytest
import torch

from relevancy.evaluation.metrics import TOP_K, RationaleTest, token_prf, top_k_tokens, word_scores
from relevancy.evaluation.metrics.rationales import Annotation, Evidence, load_annotations, load_documents, load_eraser


def _f1(p, r):
    return 0 if p == 0 or r == 0 else 2 * p * r / (p + r)


def _reference_token_prf(truth, pred):
    """ERASER ``score_hard_rationale_predictions`` on token-level (ann_id, docid, token) triples."""
    truth, pred = set(truth), set(pred)
    micro_p = len(truth & pred) / len(pred)
    micro_r = len(truth & pred) / len(truth)
    by_key_t, by_key_p = defaultdict(set), defaultdict(set)
    for a, d, t in truth:
        by_key_t[(a, d)].add((a, d, t))
    for a, d, t in pred:
        by_key_p[(a, d)].add((a, d, t))
    scores = []
    for k in set(by_key_t) | set(by_key_p):
        p = len(by_key_t.get(k, set()) & by_key_p[k]) / len(by_key_p[k]) if by_key_p.get(k) else 0
        r = len(by_key_t[k] & by_key_p.get(k, set())) / len(by_key_t[k]) if by_key_t.get(k) else 0
        scores.append((p, r, _f1(p, r)))
    n = len(scores)
    return {
        "micro": {"p": micro_p, "r": micro_r, "f1": _f1(micro_p, micro_r)},
        "macro": {"p": sum(s[0] for s in scores) / n, "r": sum(s[1] for s in scores) / n,
                  "f1": sum(s[2] for s in scores) / n},
    }


def _write_eraser(root):
    (root / "docs").mkdir()
    words0 = [f"w{i}" for i in range(100)]
    words1 = [f"v{i}" for i in range(90)]
    (root / "docs" / "negR_000.txt").write_text(" ".join(words0[:50]) + "\n" + " ".join(words0[50:]) + "\n")
    (root / "docs" / "posR_001.txt").write_text(" ".join(words1) + "\n")
    anns = [
        {"annotation_id": "negR_000.txt", "classification": "NEG", "query": "What is the sentiment?",
         "query_type": None, "evidences": [
             [{"docid": "negR_000.txt", "start_token": 2, "end_token": 6, "text": "w2 w3 w4 w5",
               "start_sentence": 0, "end_sentence": 1}],
             [{"docid": "negR_000.txt", "start_token": 60, "end_token": 62, "text": "w60 w61",
               "start_sentence": 1, "end_sentence": 2}]]},
        {"annotation_id": "posR_001.txt", "classification": "POS", "query": "What is the sentiment?",
         "evidences": [[{"docid": "posR_001.txt", "start_token": 10, "end_token": 20, "text": "..."}]]},
    ]
    with open(root / "test.jsonl", "w") as f:
        for a in anns:
            f.write(json.dumps(a) + "\n")
    return words0, words1


def test_top_k_list_is_the_reference_range():
    assert TOP_K == (5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60, 65, 70, 75, 80)


def test_eraser_loader(tmp_path):
    words0, words1 = _write_eraser(tmp_path)
    anns, docs = load_eraser(tmp_path, "test")
    assert [a.annotation_id for a in anns] == ["negR_000.txt", "posR_001.txt"]
    assert anns[0].classification == "NEG" and anns[0].docid == "negR_000.txt"
    assert anns[0].evidences[1][0] == Evidence("w60 w61", "negR_000.txt", 60, 62, 1, 2)
    assert anns[0].truth() == {"negR_000.txt": {2, 3, 4, 5, 60, 61}}
    assert docs == {"negR_000.txt": words0, "posR_001.txt": words1}
    assert load_documents(tmp_path) == docs
    assert load_annotations(tmp_path / "test.jsonl") == anns


def test_docs_jsonl(tmp_path):
    with open(tmp_path / "docs.jsonl", "w") as f:
        f.write(json.dumps({"docid": "a", "document": "x y\nz"}) + "\n")
        f.write(json.dumps({"docid": "b", "document": "q"}) + "\n")
    assert load_documents(tmp_path, ["a"]) == {"a": ["x", "y", "z"]}


def test_word_scores_from_pieces():
    words = ["the", "unbelievable", "movie", "rocks"]
    pieces = ["[CLS]", "the", "un", "##believ", "##able", "movie", "[SEP]"]  # truncated before "rocks"
    scores = torch.tensor([9.0, 0.1, 0.2, 0.7, 0.3, 0.5, 9.0])
    assert word_scores(words, pieces, scores).tolist() == pytest.approx([0.1, 0.7, 0.5])
    with pytest.raises(ValueError):
        word_scores(["then", "x"], ["[CLS]", "the", "x"], torch.ones(3))


def test_top_k_tokens_is_cumulative_and_clamped():
    scores = torch.tensor([0.9, 0.8, -1.0, 0.7, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    sets = top_k_tokens(scores, ks=(2, 4, 20))
    assert sets[0] == {0, 1}
    assert {0, 1, 3} < sets[1] and len(sets[1]) >= 4  # ties at 0 (the -1 clamps to 0 too)
    assert sets[2] == set(range(12))  # k past the length is clamped
    # The union with earlier k: what the reference's never-cleared list gives, as sets.
    ref, acc = [], set()
    for k in (2, 4, 20):
        acc |= set(torch.topk(scores.clamp(min=0), min(k, 12)).indices.tolist())
        ref.append(set(acc))
    assert sets == ref


def test_token_prf_matches_eraser_scorer():
    truth = [{1, 2, 3, 4}, {7}, set(), {0, 1}]
    pred = [{1, 2, 9}, set(), {5}, {0, 1, 2, 3}]
    got = token_prf(truth, pred)
    t = [(str(i), "d", x) for i, s in enumerate(truth) for x in s]
    p = [(str(i), "d", x) for i, s in enumerate(pred) for x in s]
    want = _reference_token_prf(t, p)
    for avg in ("micro", "macro"):
        assert got[avg] == pytest.approx(want[avg])


def test_accumulator_matches_scorer_and_merges(tmp_path):
    words0, words1 = _write_eraser(tmp_path)
    anns, docs = load_eraser(tmp_path)
    g = torch.Generator().manual_seed(0)
    scores = [torch.randn(len(docs[a.docid]), generator=g) for a in anns]
    single = RationaleTest()
    single.update(anns, scores)
    out = single.compute()
    assert out["num_instances"] == 2
    for i, k in enumerate(TOP_K):
        t, p = [], []
        for a, s in zip(anns, scores):
            t += [(a.annotation_id, a.docid, x) for x in a.truth()[a.docid]]
            p += [(a.annotation_id, a.docid, x) for x in top_k_tokens(s)[i]]
        assert out["scores"][k]["micro"] == pytest.approx(_reference_token_prf(t, p)["micro"])
        assert out["scores"][k]["macro"] == pytest.approx(_reference_token_prf(t, p)["macro"])
    a, b = RationaleTest(), RationaleTest()
    a.update(anns[:1], scores[:1])
    b.update(anns[1:], [{anns[1].docid: scores[1]}])
    assert RationaleTest.from_state(b.state_dict()).merge(a).compute() == out
    with pytest.raises(ValueError):
        a.merge(a)  # the same instances twice


def test_perfect_rationale_scores_one():
    ann = Annotation("x", "", ((Evidence("", "d", 0, 5),),), "POS")
    scores = torch.zeros(30)
    scores[:5] = 1.0
    acc = RationaleTest(ks=(5,))
    acc.update([ann], [scores])
    assert acc.compute()["scores"][5]["macro"] == {"p": 1.0, "r": 1.0, "f1": 1.0}


def test_annotation_without_evidence_uses_docids():
    ann = Annotation("y", "", (), "NEG", docids=("doc",))
    assert ann.docid == "doc" and ann.truth() == {}
    acc = RationaleTest(ks=(5,))
    acc.update([ann], [torch.ones(10)])
    assert acc.compute()["scores"][5]["macro"] == {"p": 0.0, "r": 0.0, "f1": 0.0}
    with pytest.raises(ValueError):
        _ = Annotation("z", "", (), "NEG").docid
