"""The fast fuzz tier of `make test`: a few dozen seeded cases per format (tests/fuzz/formats.py).

Every case must end in success or a one-line UsageError; a failure names the format and the seed
that reproduces it (`python tests/fuzz/run.py --format F --seed S`). Long runs: `make fuzz N=100000`.
"""

import pytest
from formats import FORMATS, pristine_files, run_case

CASES = 40


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_mutated_inputs_end_in_success_or_one_line_error(name, tmp_path):
    fmt = FORMATS[name]
    pristine = pristine_files(fmt, tmp_path / "valid")
    fmt.read([tmp_path / "valid" / name for name in sorted(pristine)])  # the valid instance reads cleanly
    failures = []
    for seed in range(CASES):
        problem = run_case(fmt, seed, tmp_path / "case", pristine)
        if problem:
            failures.append(f"seed {seed}: {problem}")
    assert not failures, f"{name}: {len(failures)} of {CASES} cases failed:\n" + "\n".join(failures[:10])


REGRESSIONS = [
    ("checkpoint", 7000317),  # a flipped bit renamed wte in the safetensors header: AttributeError, not "missing"
    ("tokenizer", 7002492),  # vocab.json skipping ids ("p": 95 of 34 tokens): encode gave ids >= vocab_size
]
"""Cases long runs (`make fuzz`) found, each a bug since fixed: they run in every `make test`."""


@pytest.mark.parametrize(("name", "seed"), REGRESSIONS)
def test_cases_long_runs_found_stay_fixed(name, seed, tmp_path):
    fmt = FORMATS[name]
    pristine = pristine_files(fmt, tmp_path / "valid")
    assert run_case(fmt, seed, tmp_path / "case", pristine) is None
