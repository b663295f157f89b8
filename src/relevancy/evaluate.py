"""`relevancy evaluate`: the papers' evaluation protocols in one command (see add_evaluate_parser)."""
from __future__ import annotations

import argparse


def add_evaluate_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("evaluate", help="run the papers' evaluation protocols")
    p.set_defaults(handler=lambda _args: (_ for _ in ()).throw(RuntimeError("evaluate is being built")))
