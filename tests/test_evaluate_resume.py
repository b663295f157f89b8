"""Resumable, sharded evaluation (`relevancy.evaluation.shards`): the record files and their checks, the run's
identity compared on resume, the output folder's lock, every benchmark stopped after its first chunk and run again
equal to an uninterrupted run, runs under torchrun with 1, 2 and 3 processes killed (SIGKILL to every process) at
five points and run again equal to an uninterrupted run, and two torchrun nodes on this machine."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from relevancy.apps.cli import main
from relevancy.core import runs
from relevancy.core.files import read_regular
from relevancy.evaluation import shards as S
from relevancy.evaluation.shards import LOCK, PARTIAL, RUN_FILE, RunRefused, Shards, weights_digest

from processes import free_port, launch
from resume_driver import POINTS
from test_evaluate import TINY_SHAPES, shapes_checkpoint  # noqa: F401  (a fixture)
from test_shapes_detection_benchmark import cli_detector  # noqa: F401  (a fixture)
from test_shapes_vqa_benchmark import tiny_checkpoint  # noqa: F401  (a fixture)
from test_llm_retrieval import tokenizer  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parent.parent
DRIVER = Path(__file__).resolve().parent / "resume_driver.py"


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
    """The complete record lines under `folder` (a torn last line left out)."""
    texts = [path.read_text() for path in sorted(folder.glob(f"{PARTIAL}/*/rank-*.jsonl"))]
    return [json.loads(line) for text in texts for line in text[: text.rfind("\n") + 1].splitlines()]


def recorded(out: Path, identity: dict, chunks: dict[int, dict], benchmark: str = "x") -> Path:
    """A run's folder holding `chunks`' records (one process), released; its record file."""
    with Shards.at(out, benchmark, identity) as shards:
        shards.pending(len(chunks))
        for chunk, record in chunks.items():
            shards.save(chunk, record)
        assert shards.path is not None
        return shards.path


class within:
    """Fails the block (TimeoutError) after `seconds`: a read that would hang ends the test instead."""

    def __init__(self, seconds: int) -> None:
        self.seconds = seconds

    def __enter__(self) -> None:
        def expire(*_):
            raise TimeoutError(f"still running after {self.seconds} s")
        signal.signal(signal.SIGALRM, expire)
        signal.alarm(self.seconds)

    def __exit__(self, *exc) -> None:
        signal.alarm(0)


# ---------------------------------------------------------------------------------------------- the records
def test_records_survive_a_torn_line_and_count_once(tmp_path):
    key = {"n": 3}
    with Shards.at(tmp_path, "x", key) as shards:
        assert shards.pending(3) == [0, 1, 2] and not (tmp_path / PARTIAL).exists()  # nothing made before a record
        shards.save(0, {"values": torch.tensor([0.1, 1 / 3], dtype=torch.float64), "nan": float("nan"), "ints": [1, 2],
                        "half": torch.tensor([1 / 3], dtype=torch.bfloat16)})
    path = shards.path
    with open(path, "ab") as f:  # a kill inside the second write
        f.write(b'{"chunk": 1, "record": {"val')
    with Shards.at(tmp_path, "x", key) as again:
        assert again.pending(3) == [1, 2]
        again.save(1, {"values": torch.zeros(0, 2)})
        again.save(2, {"values": torch.ones(1, dtype=torch.bool)})
        (got0, got1, got2) = again.collect(3)
        assert torch.equal(got0["values"], torch.tensor([0.1, 1 / 3], dtype=torch.float64)) and got0["ints"] == [1, 2]
        assert got0["half"].dtype == torch.bfloat16 and got0["half"].item() == torch.tensor(1 / 3, dtype=torch.bfloat16).item()
        assert got0["nan"] != got0["nan"] and got1["values"].shape == (0, 2) and got2["values"].dtype == torch.bool
        assert len(path.read_text().splitlines()) == 3  # the torn line was cut, not kept
        again.finish()
    assert os.listdir(tmp_path) == []  # records, folder, partial/ and the lock file gone


def test_every_process_count_reads_every_other(tmp_path):
    """Records of a 3-process run continue under 2 processes (and 1): each reads every file."""
    for rank in range(3):
        with Shards(tmp_path / PARTIAL / "x", rank, 3, {"n": 6, "benchmark": "x"}) as shards:
            shards.save(rank, {"k": rank})  # chunks 0, 1, 2 done by three processes
    for rank, share in enumerate([[4], [3, 5]]):
        with Shards.at(tmp_path, "x", {"n": 6}, rank, 2) as two:
            assert two.pending(6) == share
    with Shards.at(tmp_path, "x", {"n": 6}) as one:
        assert one.pending(6) == [3, 4, 5]


def test_a_record_that_cannot_be_read_back_is_not_written(tmp_path):
    with Shards.at(tmp_path, "x", {"n": 1}) as shards:
        with pytest.raises(TypeError, match="dtype complex64; records hold float16"):
            shards.save(0, {"z": torch.zeros(2, dtype=torch.complex64)})
        with pytest.raises(TypeError, match="dict keys must be text"):
            shards.save(0, {"z": {1: 2}})
    assert os.listdir(tmp_path) == []


BAD_LINES = {
    "not JSON": (b"not json", "not JSON"),
    "an empty line": (b"", "not JSON"),
    "nested too deep": (b"[" * 100_000 + b"]" * 100_000, "not JSON|not a record"),
    "a list": (b"[1, 2]", "not a record"),
    "no chunk": (b'{"record": {}}', "not a record"),
    "no record": (b'{"chunk": 1}', "not a record"),
    "a chunk in text": (b'{"chunk": "1", "record": {}}', r'its chunk "1" is not a whole number >= 0 below 3'),
    "a negative chunk": (b'{"chunk": -1, "record": {}}', "its chunk -1 is not"),
    "a chunk out of range": (b'{"chunk": 3, "record": {}}', "its chunk 3 is not a whole number >= 0 below 3"),
    "a chunk that is a boolean": (b'{"chunk": true, "record": {}}', "its chunk true is not"),
    "a record that is a list": (b'{"chunk": 1, "record": [1]}', "its record is list"),
    "a dtype outside the list": (b'{"chunk": 1, "record": {"a": {"tensor": [1], "dtype": "load", "shape": [1]}}}',
                                 r'the tensor at record/a has dtype "load"; records hold float16'),
    "a shape not its data's": (b'{"chunk": 1, "record": {"a": {"tensor": [[1, 2]], "dtype": "int64", "shape": [3]}}}',
                               r"the tensor at record/a has shape \[3\] but its data \[1, 2\]"),
    "a negative size": (b'{"chunk": 1, "record": {"a": [{"tensor": [], "dtype": "int64", "shape": [-1]}]}}',
                        r"the tensor at record/a/0 has shape \[-1\]"),
    "ragged data": (b'{"chunk": 1, "record": {"a": {"tensor": [[1], [1, 2]], "dtype": "float32", "shape": [2, 1]}}}',
                    "the tensor at record/a holds no float32 array"),
}


@pytest.mark.parametrize("case", BAD_LINES)
def test_a_line_that_is_not_a_record_is_named_by_file_and_line(tmp_path, case):
    line, message = BAD_LINES[case]
    path = recorded(tmp_path, {"n": 3}, {0: {"a": 1}})
    with open(path, "ab") as f:
        f.write(line + b"\n")
    with Shards.at(tmp_path, "x", {"n": 3}) as shards:
        with pytest.raises(ValueError, match=f"{path} line 2 is not a record of this run: ({message})") as caught:
            shards.pending(3)
    assert f"remove {path.parent} to start this run afresh" in str(caught.value)
    assert not (tmp_path / LOCK).exists()  # refused: the lock let go


@pytest.mark.parametrize("kind", ["a link to /dev/zero", "a named pipe", "a folder", "a link to a record file"])
def test_a_record_file_that_is_not_a_regular_file_is_refused_at_once(tmp_path, kind):
    path = recorded(tmp_path, {"n": 3}, {0: {"a": 1}})
    odd = path.with_name("rank-1-of-2.jsonl")
    if kind == "a link to /dev/zero":
        odd.symlink_to("/dev/zero")
    elif kind == "a named pipe":
        os.mkfifo(odd)
    elif kind == "a folder":
        odd.mkdir()
    else:
        odd.symlink_to(path)
    with within(20), Shards.at(tmp_path, "x", {"n": 3}) as shards:
        with pytest.raises(ValueError, match=f"{odd} is a (symbolic link|named pipe|folder).*record files are regular files"):
            shards.pending(3)


def test_read_regular_reads_regular_files_only_and_within_the_bound(tmp_path):
    (tmp_path / "file").write_bytes(b"12345")
    assert read_regular(tmp_path / "file", 5) == b"12345"
    with pytest.raises(ValueError, match="holds 5 bytes, more than the 4 read here"):
        read_regular(tmp_path / "file", 4)
    (tmp_path / "link").symlink_to(tmp_path / "file")
    with pytest.raises(ValueError, match="link is a symbolic link"):
        read_regular(tmp_path / "link", 5)
    assert read_regular(tmp_path / "link", 5, links=True) == b"12345"
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "zero").symlink_to("/dev/zero")
    with within(20):
        for path, links, kind in ((tmp_path / "pipe", False, r"a named pipe \(FIFO\)"), (tmp_path / "zero", True, "a character device"),
                                  ("/dev/null", False, "a character device"), (tmp_path, False, "a folder")):
            with pytest.raises(ValueError, match=f"is {kind}, not a regular file"):
                read_regular(path, 10, links)
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "missing", 10)


# ---------------------------------------------------------------------------------------------- the identity
def test_the_weights_digest_sees_every_bit_and_the_vocabulary():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2).double(), torch.nn.BatchNorm1d(2).double())
    first = weights_digest(model)
    assert weights_digest(model) == first and len(first) == 64
    with torch.no_grad():
        model[0].weight[0, 0] = torch.nextafter(model[0].weight[0, 0], torch.tensor(2.0, dtype=torch.float64))
    assert weights_digest(model) != first  # the last bit of one float64
    second = weights_digest(model)
    model[1].running_mean += 1  # a buffer
    assert weights_digest(model) != second
    half = torch.nn.Linear(2, 2).to(torch.bfloat16)
    assert weights_digest(half) != weights_digest(half.float())  # the dtype counts
    assert weights_digest(half, type("T", (), {"vocab": ("a", "b")})()) != weights_digest(half, type("T", (), {"vocab": ("a", "c")})())
    with pytest.raises(TypeError, match="neither get_vocab"):
        weights_digest(half, object())


def refused(out: Path, identity: dict, weigh=None) -> str:
    """The message of the refusal of a run of `identity` (weighing the model `weigh`) into `out`."""
    with Shards.at(out, "x", identity) as shards:
        if weigh is not None:
            shards.weigh(weigh)
        with pytest.raises(RunRefused) as caught:
            shards.pending(3)
    return str(caught.value)


def test_records_of_another_run_are_refused_naming_each_difference(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    with Shards.at(tmp_path, "x", {"n": 3, "seed": 0, "model": "m.safetensors"}) as shards:
        shards.weigh(model)
        shards.pending(3)
        shards.save(0, {"a": 1})
    folder = tmp_path / PARTIAL / "x"
    message = refused(tmp_path, {"n": 4, "seed": 5, "model": "m.safetensors"}, model)
    assert f"{folder} holds the records of another run (n: 3 there, 4 here; seed: 0 there, 5 here)" in message
    assert f"remove {folder} to start this run afresh, or give another --out" in message
    assert "weights: [" in refused(tmp_path, {"n": 3, "seed": 0, "model": "m.safetensors"}, other)  # same path, other weights
    assert 'model: "m.safetensors" there, "n.safetensors" here' in refused(tmp_path, {"n": 3, "seed": 0, "model": "n.safetensors"}, model)
    installed = runs.library_versions()
    monkeypatch.setattr(runs, "library_versions", lambda: {**installed, "torch": "0.1"})
    assert "versions.torch: " in refused(tmp_path, {"n": 3, "seed": 0, "model": "m.safetensors"}, model)
    monkeypatch.undo()
    assert records(tmp_path) == [{"chunk": 0, "record": {"a": 1}}]  # nothing touched by the refusals
    with Shards.at(tmp_path, "x", {"n": 3, "seed": 0, "model": "m.safetensors"}) as same:
        same.weigh(model)
        assert same.pending(3) == [1, 2]
    with Shards.at(tmp_path, "y", {"n": 3, "seed": 5}) as another_benchmark:  # a folder of its own
        assert another_benchmark.pending(3) == [0, 1, 2]


def test_an_identity_without_records_is_replaced_and_records_without_one_refused(tmp_path):
    folder = tmp_path / PARTIAL / "x"
    folder.mkdir(parents=True)
    (folder / RUN_FILE).write_text('{"seed": 1}')  # killed between run.json and its first record
    with Shards.at(tmp_path, "x", {"n": 3}) as shards:
        assert shards.pending(3) == [0, 1, 2]
        shards.save(0, {"a": 1})
    assert json.loads((folder / RUN_FILE).read_text()) == {"benchmark": "x", "n": 3}
    (folder / RUN_FILE).unlink()
    assert f"{folder} holds records but no run.json" in refused(tmp_path, {"n": 3})
    (folder / RUN_FILE).write_text("[1,")
    assert f"{folder / RUN_FILE} is not a run's identity" in refused(tmp_path, {"n": 3})


def test_weigh_comes_first(tmp_path):
    with Shards.at(tmp_path, "x", {"n": 1}) as shards:
        shards.pending(1)
        with pytest.raises(RuntimeError, match="weigh comes before the first pending"):
            shards.weigh(torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="a benchmark's name names its records' folder"):
        Shards.at(tmp_path, "../x", {})


# ---------------------------------------------------------------------------------------------- the lock
def test_a_second_run_into_the_same_folder_is_refused_while_the_first_lives(tmp_path):
    with Shards.at(tmp_path / "out", "x", {"n": 2}) as first:
        first.pending(2)
        assert (tmp_path / "out" / LOCK).exists()
        with Shards.at(tmp_path / "out", "y", {"n": 2}) as second:  # another benchmark, the same --out
            with pytest.raises(RunRefused, match=f"another run is writing into {tmp_path / 'out'} \\(process {os.getpid()}"):
                second.pending(2)
        first.save(0, {"a": 1})
    assert os.listdir(tmp_path / "out") == [PARTIAL]  # the lock file gone, the records kept
    os.mkfifo(tmp_path / "out" / LOCK)
    with within(20), Shards.at(tmp_path / "out", "x", {"n": 2}) as odd:
        with pytest.raises(RunRefused, match=f"{LOCK} is not a regular file: remove it"):
            odd.pending(2)
    (tmp_path / "out" / LOCK).unlink()
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from relevancy.evaluation.shards import Shards\n"
        f"s = Shards.at({str(tmp_path / 'out')!r}, 'x', {{'n': 2}}); s.pending(2); print('held', flush=True); time.sleep(120)")],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])})
    try:
        assert holder.stdout.readline() == "held\n"
        with Shards.at(tmp_path / "out", "x", {"n": 2}) as second:
            with pytest.raises(RunRefused, match=f"process {holder.pid} on .* holds .*{LOCK}\\): wait until it ends, or give another --out"):
                second.pending(2)
        holder.kill()  # SIGKILL: the kernel drops the lock with the process
        holder.wait(timeout=30)
        with Shards.at(tmp_path / "out", "x", {"n": 2}) as third:
            assert third.pending(2) == [1]
    finally:
        holder.kill()
        holder.wait(timeout=30)


def test_a_run_that_fails_before_its_first_record_leaves_nothing(tmp_path):
    with pytest.raises(Stop):
        with Shards.at(tmp_path / "new" / "out", "x", {"n": 2}) as shards:
            shards.pending(2)
            assert (tmp_path / "new" / "out" / LOCK).exists()
            raise Stop
    assert os.listdir(tmp_path / "new") == []  # the output folder it made, removed


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
    stopped_after_one_chunk([*argv, "--out", str(parts)], monkeypatch)
    assert [r["chunk"] for r in records(parts)] == [0] and not (parts / "results.json").exists()
    save = Shards.save
    computed = []
    monkeypatch.setattr(Shards, "save", lambda self, chunk, record: (computed.append(chunk), save(self, chunk, record)))
    assert main([*argv, "--out", str(parts)]) == 0
    assert computed == [1, 2] or (benchmark == "shapes" and computed == [1, 2, 3])  # shapes: 3 + 1 scenes
    assert not (parts / PARTIAL).exists()
    one, resumed = (json.loads((folder / "results.json").read_text()) for folder in (whole, parts))
    assert without_timings(resumed) == without_timings(one)




def stopped_after_one_chunk(argv: list[str], monkeypatch) -> None:
    """`relevancy evaluate argv` stopped (an exception) once its first chunk is recorded."""
    save = Shards.save

    def save_then_stop(self, chunk, record):
        save(self, chunk, record)
        raise Stop

    monkeypatch.setattr(Shards, "save", save_then_stop)
    with pytest.raises(Stop):
        main(argv)
    monkeypatch.undo()


def test_the_command_refuses_records_of_another_seed_or_other_weights(tmp_path, monkeypatch, capsys):
    """issue 44: records of another --seed, or of the same --model path after its weights changed, were folded in."""
    checkpoint = tmp_path / "model.safetensors"

    def save_model(seed: int) -> None:
        from relevancy.worlds import build_model

        torch.manual_seed(seed)
        state = build_model(**TINY_SHAPES).state_dict()
        save_file({k: v.contiguous() for k, v in state.items()}, str(checkpoint),
                  metadata={"model_config": json.dumps(TINY_SHAPES), "steps": "0", "final": "false"})

    save_model(0)
    out = tmp_path / "out"
    argv = ["evaluate", "--model", str(checkpoint), "--arch", "shapes", "--threads", "1", "--quiet", "--methods", "rollout",
            "-n", "2", "--batch-size", "1", "--out", str(out)]
    stopped_after_one_chunk(argv, monkeypatch)
    before = records(out)
    capsys.readouterr()
    folder = out / PARTIAL / "shapes"
    assert main([*argv, "--seed", "5"]) == 2
    error = capsys.readouterr().err
    assert f"{folder} holds the records of another run (seed: 0 there, 5 here)" in error
    assert f"remove {folder} to start this run afresh, or give another --out" in error
    save_model(1)  # the same path, other weights
    assert main(argv) == 2
    assert "holds the records of another run (weights: [" in capsys.readouterr().err
    assert records(out) == before and sorted(os.listdir(out)) == [PARTIAL]  # nothing written, the lock let go
    save_model(0)
    assert main(argv) == 0 and sorted(os.listdir(out)) == ["perturbation.png", "report.md", "results.json"]


# ---------------------------------------------------------------------------------------------- processes
def test_processes_started_differently_refuse_together(tmp_path):
    """Two processes of one gloo run, one with another --seed: both refuse, naming the field and the ranks."""
    port, out = free_port(), tmp_path / "out"
    commands = [["env", f"RANK={rank}", f"LOCAL_RANK={rank}", "WORLD_SIZE=2", "LOCAL_WORLD_SIZE=2", "MASTER_ADDR=127.0.0.1",
                 f"MASTER_PORT={port}", sys.executable, str(DRIVER), "--out", str(out), "--seed", str(rank)] for rank in range(2)]
    assert launch(commands, tmp_path / "log", 120) == [2, 2]
    log = (tmp_path / "log").read_text()
    assert log.count("error: the processes of this run were started differently (seed: 0 on rank 0, 1 on rank 1; weights: [") == 2
    assert not out.exists()  # the folder it made for the lock, removed


def torchrun(processes: int, out: Path, log: Path, **extra: str) -> int:
    """`torchrun --standalone --nproc-per-node processes tests/resume_driver.py --out out`: the agent's status."""
    return launch([[sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes),
                    str(DRIVER), "--out", str(out)]], log, 240, **extra)[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The driver's results in one plain process, never killed."""
    out = tmp_path_factory.mktemp("uninterrupted")
    assert launch([[sys.executable, str(DRIVER), "--out", str(out)]], out / "log", 240) == [0], (out / "log").read_text()
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("processes", [1, 2, 3])
@pytest.mark.parametrize("point", POINTS)
def test_a_run_killed_anywhere_then_run_again_gives_the_uninterrupted_results(point, processes, tmp_path, uninterrupted):
    """SIGKILL to every process of the run (torchrun's agent included) at `point`, then the same command: the results of
    one uninterrupted process, exactly, and no records left."""
    out = tmp_path / "out"
    assert torchrun(processes, out, tmp_path / "killed.log", RELEVANCY_TEST_KILL=point) == -signal.SIGKILL
    torn = [path for path in out.glob(f"{PARTIAL}/*/rank-*.jsonl") if not path.read_bytes().endswith(b"\n")]
    assert (point == "mid-chunk") == bool(torn)  # a line cut by the kill
    assert (point == "cleanup") == (out / "results.json").exists()
    if point == "start":
        assert not out.exists()  # killed before the lock, the first file the run makes
    elif point != "cleanup":  # the cleanup may have removed every record
        assert records(out)
    status = torchrun(processes, out, tmp_path / "again.log")
    assert status == 0, (tmp_path / "again.log").read_text()[-3000:]
    assert json.loads((out / "results.json").read_text()) == uninterrupted
    assert os.listdir(out) == ["results.json"]  # no records, no lock file


def test_two_nodes_on_this_machine_give_the_single_process_results(tmp_path, shapes_checkpoint):  # noqa: F811
    """Two torchrun agents (`--nnodes 2`, one process each) meeting through a c10d rendezvous on localhost."""
    argv = ["evaluate", "--model", str(shapes_checkpoint), "--arch", "shapes", "--threads", "1", "--quiet",
            "--methods", "rollout,cdam", "-n", "3", "--batch-size", "1"]
    assert main([*argv, "--out", str(tmp_path / "single")]) == 0
    port = free_port()
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", uuid.uuid4().hex, "-m", "relevancy", *argv,
            "--out", str(tmp_path / "nodes")]
    assert launch([node, node], tmp_path / "nodes.log", 300) == [0, 0], (tmp_path / "nodes.log").read_text()[-3000:]
    one = json.loads((tmp_path / "single" / "results.json").read_text())
    two = json.loads((tmp_path / "nodes" / "results.json").read_text())
    assert two["settings"]["world_size"] == 2 and sorted(os.listdir(tmp_path / "nodes")) == ["perturbation.png", "report.md", "results.json"]
    assert without_timings(two) == without_timings(one)
    assert two["methods"]["cdam"]["maps"] == one["methods"]["cdam"]["maps"]
