"""`relevancy explain-corpus` killed at a chosen point: the driver of the kill tests in tests/test_corpus.py.

    RELEVANCY_TEST_RUN=<token> [RELEVANCY_TEST_KILL=<point>] \\
        torchrun --standalone --nproc-per-node K tests/corpus_driver.py PROMPTS --model FOLDER --out DIR ...

Runs the command (process group, plan, part files, lock, report); with `RELEVANCY_TEST_KILL`, one process sends SIGKILL
to every process whose environment holds ``RELEVANCY_TEST_RUN=<token>`` (torchrun's agent, every worker, itself):

- ``start``: rank 0 beginning the run, before any part file;
- ``mid-batch``: the last rank inside the write of its second part file (its temporary file half written);
- ``saved``: rank 0 just after writing its second part file, the others at work;
- ``report``: rank 0 about to write the report, every part file written.
"""
from __future__ import annotations

import os
import random
import sys

from relevancy import corpus
from relevancy.apps.cli import main
from relevancy.results import corpus_report

from processes import kill_all

#: the points `RELEVANCY_TEST_KILL` names
POINTS = ("start", "mid-batch", "saved", "report")
WORDS = "the cat sat on mat dog ran to park a red ball and blue box where does live ?".split()


def corpus_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` short prompts of the tiny tokenizer's words, 2 to 14 words each."""
    draw = random.Random(seed)
    return [" ".join(draw.choice(WORDS) for _ in range(draw.randint(2, 14))) for _ in range(n)]


def arm(point: str) -> None:
    """Patch the corpus run so that it is killed at `point`."""
    if point not in POINTS:
        raise SystemExit(f"RELEVANCY_TEST_KILL must be one of {', '.join(POINTS)}, got {point!r}")
    begin, save, report = corpus._Parts._begin, corpus._Parts.save, corpus_report.write_report
    saves = {"n": 0}

    def killing_begin(self, count):
        if point == "start" and self.rank == 0:
            kill_all()
        return begin(self, count)

    def killing_save(self, chunk, columns):
        saves["n"] += 1
        if point == "mid-batch" and self.rank == self.world - 1 and saves["n"] == 2:
            (self.folder / corpus.SHARDS / f".part-{chunk:05d}.parquet.x1y2z3.tmp").write_bytes(b"PAR1\0\0")
            kill_all()
        save(self, chunk, columns)
        if point == "saved" and self.rank == 0 and saves["n"] == 2:
            kill_all()

    def killing_report(*args, **kwargs):
        if point == "report":
            kill_all()
        return report(*args, **kwargs)

    corpus._Parts._begin, corpus._Parts.save, corpus_report.write_report = killing_begin, killing_save, killing_report


if __name__ == "__main__":
    if os.environ.get("RELEVANCY_TEST_KILL"):
        arm(os.environ["RELEVANCY_TEST_KILL"])
    raise SystemExit(main(["explain-corpus", *sys.argv[1:]]))
