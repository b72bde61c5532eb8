"""A setting's help text is written once, beside its field: the foreign front ends' rows take their field's
(or their own record's) docstring, no row restates a field's help or another row's, no --help line says
"(new)" (docs/training.md's flag table has a New column instead), and that table is current."""

import argparse
import re
from pathlib import Path

import pytest

from gpt2forge.core.flags import flag
from gpt2forge.frontends import graphcore, megatron, run_clm
from gpt2forge.frontends.flag_table import Flag
from gpt2forge.train.config import FIELD_SECTION, field_help

REPO = Path(__file__).resolve().parents[2]
FRONT_ENDS = (megatron.FRONT_END, run_clm.FRONT_END)


def _words(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def restatements(rows: list[tuple[str, Flag]]) -> list[str]:
    """Rows (front end, row) whose own help or note restates a TrainConfig field's help: equal to it, or one
    holding the other (three words or more)."""
    fields = {name: _words(field_help(name)) for name in FIELD_SECTION}
    found = []
    for prog, row in rows:
        for text in filter(None, (row.help, row.note)):
            words = _words(text)
            for name, help_words in fields.items():
                contained = len(words.split()) >= 3 and words in help_words
                contains = len(help_words.split()) >= 3 and help_words in words
                if words == help_words or contained or contains:
                    found.append(f"{prog} {row.name}: {text!r} restates --{flag(name)}'s help")
    return found


def _rows() -> list[tuple[str, Flag]]:
    return [(front_end.prog, row) for front_end in FRONT_ENDS for row in front_end.flags]


def test_no_row_restates_a_fields_help():
    assert not restatements(_rows())


def test_the_check_catches_a_restated_help():
    row = Flag(name="--lr", field="learning_rate", help="peak learning rate")
    assert "pretrain_gpt.py --lr: 'peak learning rate' restates --learning-rate's help" in \
        restatements([("pretrain_gpt.py", row)])


def test_no_two_rows_say_the_same():
    said: dict[str, set[str]] = {}
    for prog, row in _rows():
        for text in filter(None, (row.help, row.note)):
            said.setdefault(_words(text), set()).add(f"{prog} {row.name}")
    assert not {text: rows for text, rows in said.items() if len(rows) > 1}


def test_a_field_row_has_its_fields_help_and_type():
    text = megatron.build_parser().format_help()
    assert f"{field_help('learning_rate')} (train_gpt2.py --learning-rate)" in " ".join(text.split())
    given = megatron.FRONT_END.parse(["--lr", "3e-4", "--kfac-skip-layers", "wte", "lm_head"]).values
    assert given == {"learning_rate": 3e-4, "kfac_skip_layers": ["wte", "lm_head"]}


@pytest.mark.parametrize("parser", [graphcore.build_parser, megatron.build_parser, run_clm.build_parser],
                         ids=["train_gpt2", "pretrain_gpt", "train_clm"])
def test_no_help_line_says_new(parser):
    said = [a.option_strings[0] for a in parser()._actions
            if a.help and a.help != argparse.SUPPRESS and a.help.startswith("(new)")]
    assert not said, f"--help texts opening with (new) (the New column of docs/training.md says it): {said}"


def test_docs_training_has_the_current_flag_table():
    text = (REPO / "docs" / "training.md").read_text()
    table = graphcore.flag_file_table()
    missing = [line for line in table if line not in text]
    assert not missing, "docs/training.md's flag table is behind; paste:\n" + "\n".join(table)
    assert len(table) == 2 + 3 + len(FIELD_SECTION)
