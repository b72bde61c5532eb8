"""The fast tier of the flag fuzzing (tests/fuzz/flags.py): every flag of train_gpt2.py and of
pretrain_gpt.py with each bad or extreme value ends in success or one `error:` line with exit code
2, through the checks the trainer makes before it allocates. The whole run per case: `python
tests/fuzz/flags.py --run`."""

import pytest
from flags import cases, run_case


@pytest.mark.parametrize(("front_end", "flags", "example"), [("train", 100, ("--learning-rate", "nan")),
                                                             ("megatron", 60, ("--micro-batch-size", "0"))])
def test_every_flag_with_every_bad_value_passes_the_preflight_or_is_one_line_error(front_end, flags, example,
                                                                                  tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    all_cases = cases(front_end)
    assert len({flag for flag, _ in all_cases}) > flags and example in all_cases
    failures = [f"{flag} {value!r}: {problem}" for flag, value in all_cases
                if (problem := run_case(flag, value, tmp_path, run=False, front_end=front_end))]
    assert not failures, f"{len(failures)} of {len(all_cases)} cases failed:\n" + "\n".join(failures[:10])


@pytest.mark.parametrize(("flag", "value", "refused"), [
    ("--learning-rate", "nan", True), ("--adam-eps", "inf", True), ("--max-len", "99999999999", True),
    ("--batch-size", "99999999999", True), ("--num-layers", "99999999999", True), ("--learning-rate", "0.5", False),
])
def test_the_values_that_once_escaped_are_refused_in_the_preflight(flag, value, refused, tmp_path, capsys):
    # each of these once ended in a traceback from torch (optimizer or allocator), or a 40 s hang
    from flags import base_argv, preflight

    assert preflight([*base_argv(tmp_path), f"{flag}={value}"]) == (2 if refused else 0)
    err = capsys.readouterr().err
    assert (err.count("\n") == 1 and err.startswith("error: ")) if refused else err == ""


@pytest.mark.parametrize("flag", ["--micro-batch-size", "--tensor-model-parallel-size",
                                  "--pipeline-model-parallel-size"])
def test_megatron_sizes_of_zero_are_refused_by_name(flag, tmp_path, capsys):
    # each was a ZeroDivisionError in the batch arithmetic of the Megatron front end
    from flags import base_argv, preflight

    assert preflight([*base_argv(tmp_path, "megatron"), f"{flag}=0"], "megatron") == 2
    assert capsys.readouterr().err == f"error: {flag} 0: must be >= 1" + (" (1: not split)" if "parallel" in flag
                                                                          else "") + "\n"
