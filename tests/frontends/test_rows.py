"""Every row of the foreign front ends says where its value goes: a TrainConfig field, a field of the
front end's typed record of the tool's own settings, a rule, or a refusal."""

import ast
import dataclasses
import inspect
import textwrap

import pytest

from gpt2forge.frontends import megatron, run_clm
from gpt2forge.frontends.flag_table import Own, Refused
from gpt2forge.train.config import FIELD_SECTION


@pytest.mark.parametrize("front_end", [megatron.FRONT_END, run_clm.FRONT_END], ids=lambda f: f.prog)
def test_every_row_targets_a_field_a_typed_setting_a_rule_or_a_refusal(front_end):
    own_fields = {f.name for f in dataclasses.fields(front_end.own)}
    wrong = []
    for row in front_end.flags:
        target = row.target
        if isinstance(target, str):
            ok = target in FIELD_SECTION
        elif isinstance(target, Own):
            ok = target.field in own_fields
        else:
            ok = isinstance(target, Refused) or callable(target)
        if not ok:
            wrong.append(f"{row.names[0]} -> {target!r}")
    assert not wrong, "rows whose target is neither a TrainConfig field nor a field of " \
                      f"{front_end.own.__name__}: {wrong}"


@pytest.mark.parametrize("front_end", [megatron.FRONT_END, run_clm.FRONT_END], ids=lambda f: f.prog)
def test_every_own_setting_has_a_row_and_a_docstring(front_end):
    stored = {row.target.field for row in front_end.flags if isinstance(row.target, Own)}
    fields = [f.name for f in dataclasses.fields(front_end.own)]
    assert sorted(stored) == sorted(fields)
    body = ast.parse(textwrap.dedent(inspect.getsource(front_end.own))).body[0].body
    documented = {node.target.id for node, after in zip(body, body[1:])
                  if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                  and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)}
    assert set(fields) <= documented, f"undocumented: {sorted(set(fields) - documented)}"


def test_an_own_setting_reaches_the_rule_that_reads_it():
    parsed = megatron.FRONT_END.parse(["--global-batch-size", "16", "--pipeline-model-parallel-size", "2"])
    assert (parsed.own.global_batch, parsed.own.pipeline) == (16, 2)
    assert "global_batch" not in parsed.values and parsed.set_by[Own("global_batch")] == "--global-batch-size"
    values = megatron.translate(["--micro-batch-size", "2", "--global-batch-size", "16", "--num-layers", "4",
                                 "--pipeline-model-parallel-size", "2"], world_size=2)
    assert values["gradient_accumulation"] == 8 and values["layers_per_ipu"] == [2, 2]
    assert not [k for k in values if k.startswith("_")]
