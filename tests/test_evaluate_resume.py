"""Resumable, sharded evaluation (`relevancy.evaluation.shards`): the record files, every benchmark stopped after
its first chunk and run again equal to an uninterrupted run, and two gloo processes of which one is killed with
SIGKILL midway, then run again: nothing lost, nothing counted twice."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers

from relevancy.apps.cli import main
from relevancy.evaluation.shards import PARTIAL, Shards

from test_evaluate import shapes_checkpoint  # noqa: F401  (a fixture)
from test_shapes_detection_benchmark import cli_detector  # noqa: F401  (a fixture)
from test_shapes_vqa_benchmark import tiny_checkpoint  # noqa: F401  (a fixture)
from test_llm_retrieval import tokenizer  # noqa: F401  (a fixture)


class Stop(Exception):
    """Stands for a kill between two chunks."""


def without_timings(value):
    """`value` without the timings and the process count (they differ between runs)."""
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items()
                if "seconds" not in k and k not in ("time_ratio", "world_size")}
    if isinstance(value, list):
        return [without_timings(v) for v in value]
    return value


def records(folder: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(folder.glob(f"{PARTIAL}/*/rank-*.jsonl"))
            for line in path.read_text().splitlines()]


# ---------------------------------------------------------------------------------------------- the records
def test_records_survive_a_torn_line_and_count_once(tmp_path):
    shards = Shards.at(tmp_path, {"benchmark": "x", "n": 3})
    assert shards.pending(3) == [0, 1, 2] and not (tmp_path / PARTIAL).exists()  # nothing made before a record
    shards.save(0, {"values": torch.tensor([0.1, 1 / 3], dtype=torch.float64), "nan": float("nan"), "ints": [1, 2]})
    with open(shards.path, "ab") as f:  # a kill inside the second write
        f.write(b'{"chunk": 1, "record": {"val')
    again = Shards.at(tmp_path, {"benchmark": "x", "n": 3})
    assert again.pending(3) == [1, 2]
    again.save(1, {"values": torch.zeros(0, 2)})
    again.save(2, {"values": torch.ones(1, dtype=torch.bool)})
    (got0, got1, got2) = again.collect(3)
    assert torch.equal(got0["values"], torch.tensor([0.1, 1 / 3], dtype=torch.float64)) and got0["ints"] == [1, 2]
    assert got0["nan"] != got0["nan"] and got1["values"].shape == (0, 2) and got2["values"].dtype == torch.bool
    assert len(shards.path.read_text().splitlines()) == 3  # the torn line was cut, not kept
    other = Shards.at(tmp_path, {"benchmark": "x", "n": 4})
    assert other.folder != again.folder and other.pending(4) == [0, 1, 2, 3]  # another command's records are its own
    again.finish()
    assert not (tmp_path / PARTIAL).exists()


def test_a_damaged_record_is_named(tmp_path):
    shards = Shards.at(tmp_path, {"n": 1})
    shards.save(0, {"a": 1})
    with open(shards.path, "ab") as f:
        f.write(b"not json\n")
    with pytest.raises(ValueError, match="line 2 is not a record"):
        shards.pending(2)


# ---------------------------------------------------------------------------------------------- every benchmark
@pytest.fixture(scope="module")
def retrieval_model(tmp_path_factory, tokenizer):  # noqa: F811
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=256, tie_word_embeddings=True)
    folder = tmp_path_factory.mktemp("llama")
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def eraser_data(tmp_path_factory) -> Path:
    from relevancy.evaluation.text_rationales import make_rationale_set, write_eraser

    folder = tmp_path_factory.mktemp("eraser")
    write_eraser(make_rationale_set(6, seed=3), folder, split="test")
    return folder


@pytest.fixture()
def commands(shapes_checkpoint, cli_detector, tiny_checkpoint, retrieval_model, eraser_data):  # noqa: F811
    return {
        "shapes": ["--model", shapes_checkpoint, "--arch", "shapes", "--methods", "rollout,cdam", "-n", 3, "--batch-size", 1],
        "shapes-clip": ["--methods", "rollout,generic_attention", "-n", 3, "--batch-size", 1],
        "shapes-detection": ["--model", cli_detector, "--methods", "rollout", "-n", 3, "--batch-size", 1],
        "shapes-vqa": ["--model", tiny_checkpoint, "--methods", "rollout", "-n", 3, "--batch-size", 1, "--perturbation-n", 2],
        "llm-retrieval": ["--model", retrieval_model, "--methods", "attnlrp,raw_attention", "-n", 3, "--batch-size", 1],
        "eraser": ["--data", eraser_data, "--methods", "raw_attention", "-n", 3, "--batch-size", 1],
    }


@pytest.mark.parametrize("benchmark", ["shapes", "shapes-clip", "shapes-detection", "shapes-vqa", "llm-retrieval", "eraser"])
def test_a_run_stopped_after_a_chunk_continues_to_the_uninterrupted_numbers(benchmark, commands, tmp_path, monkeypatch, capsys):
    argv = ["evaluate", "--benchmark", benchmark, "--threads", "1", "--quiet", *map(str, commands[benchmark])]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert main([*argv, "--out", str(whole)]) == 0
    save = Shards.save

    def save_then_stop(self, chunk, record):
        save(self, chunk, record)
        raise Stop

    monkeypatch.setattr(Shards, "save", save_then_stop)
    with pytest.raises(Stop):
        main([*argv, "--out", str(parts)])
    assert [r["chunk"] for r in records(parts)] == [0] and not (parts / "results.json").exists()
    monkeypatch.undo()
    computed = []
    monkeypatch.setattr(Shards, "save", lambda self, chunk, record: (computed.append(chunk), save(self, chunk, record)))
    assert main([*argv, "--out", str(parts)]) == 0
    assert computed == [1, 2] or (benchmark == "shapes" and computed == [1, 2, 3])  # shapes: 3 + 1 scenes
    assert not (parts / PARTIAL).exists()
    one, resumed = (json.loads((folder / "results.json").read_text()) for folder in (whole, parts))
    assert without_timings(resumed) == without_timings(one)


# ---------------------------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv: list[str], rank: int, port: int, log: Path) -> subprocess.Popen:
    """One process of a two-process gloo run, as torchrun starts it (its environment variables)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    return subprocess.Popen([sys.executable, "-m", "relevancy", *argv], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def test_two_processes_one_killed_midway_then_run_again(tmp_path, shapes_checkpoint):  # noqa: F811
    argv = ["evaluate", "--model", str(shapes_checkpoint), "--arch", "shapes", "--threads", "1", "--quiet",
            "--methods", "rollout,cdam", "-n", "8", "--batch-size", "1"]
    single, double = tmp_path / "single", tmp_path / "double"
    assert main([*argv, "--out", str(single)]) == 0
    port = free_port()
    first = [start([*argv, "--out", str(double)], rank, port, tmp_path / f"first{rank}.log") for rank in range(2)]
    rank1 = double / PARTIAL
    deadline = time.monotonic() + 240
    while not any(len(p.read_text().splitlines()) >= 2 for p in rank1.glob("*/rank-1-of-2.jsonl")):
        assert time.monotonic() < deadline and first[1].poll() is None, (tmp_path / "first1.log").read_text()[-2000:]
        time.sleep(0.05)
    first[1].send_signal(signal.SIGKILL)  # midway: rank 1 has recorded two of its six batches
    first[1].wait()
    first[0].kill()  # as torchrun ends the others when one process dies
    first[0].wait()
    before = records(double)
    assert 2 <= len([r for r in before if r["chunk"] % 2 == 1]) < 6 and not (double / "results.json").exists()
    port = free_port()
    again = [start([*argv, "--out", str(double)], rank, port, tmp_path / f"again{rank}.log") for rank in range(2)]
    for rank, process in enumerate(again):
        assert process.wait(timeout=300) == 0, (tmp_path / f"again{rank}.log").read_text()[-3000:]
    one = json.loads((single / "results.json").read_text())
    two = json.loads((double / "results.json").read_text())
    assert two["settings"]["world_size"] == 2 and not (double / PARTIAL).exists()
    assert without_timings(two) == without_timings(one)  # nothing lost, nothing counted twice
    assert two["methods"]["cdam"]["maps"] == one["methods"]["cdam"]["maps"]
