"""The benchmark runner: regexp extraction, reductions, variants and derived metrics on canned output;
the shipped benchmarks.yml parses and its commands parse against the real parsers; the runner end
to end (exit codes, logs, results files, --profile) on tiny commands and one real CPU entry."""

import csv
import importlib.util
import json
import re
import shlex
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpt2forge.benchmark_runner.cli import main as bench_main
from gpt2forge.benchmark_runner.extract import MetricError, derive, extract, matches
from gpt2forge.benchmark_runner.spec import Metric, build_variants, expand_parameters, load_spec, select, variant_name
from gpt2forge.core.errors import UsageError
from gpt2forge.frontends.graphcore import parse_args

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "benchmarks.yml"

CANNED = textwrap.dedent("""\
    step 0 of epoch 0, loss: 10.5000, acc: 0.0100, lr: 1e-05, throughput: 1.00 samples/sec, tokens/s: 128.0,
    step 1 of epoch 0, loss: 9.0000, acc: 0.0200, lr: 2e-05, throughput: 4.00 samples/sec, tokens/s: 512.0,
    step 2 of epoch 0, loss: 8.0000, acc: 0.0300, lr: 3e-05, throughput: 2.00 samples/sec, tokens/s: 256.0,
    step 3 of epoch 0, loss: 7.5000, acc: 0.0400, lr: 4e-05, throughput: 3.00 samples/sec, tokens/s: 384.0,
    """)


def metric(name, regexp, skip=0, reduction="mean"):
    return Metric(name, re.compile(regexp), skip, reduction)


THROUGHPUT = r"throughput: *(.*?) samples\/sec"


@pytest.mark.parametrize("reduction,skip,expected", [
    ("mean", 0, 2.5), ("mean", 1, 3.0),  # sorted ascending, the smallest `skip` dropped: (2+3+4)/3
    ("final", 0, 3.0), ("value", 0, 1.0), ("value", 1, 4.0), ("min", 1, 2.0), ("max", 0, 4.0)])
def test_reductions_on_canned_step_lines(reduction, skip, expected):
    out = extract([metric("throughput", THROUGHPUT, skip, reduction)], CANNED, "", command_ok=True)
    assert out == {"throughput": {reduction: pytest.approx(expected)}}


def test_latency_mean_drops_the_largest_and_stderr_is_read_too():
    stderr = "latency avg: 50.0 ms\nlatency avg: 10.0 ms\nlatency avg: 20.0 ms\n"
    out = extract([metric("latency", r"latency avg: *(.*?) ms", skip=1)], "", stderr, command_ok=True)
    assert out["latency"]["mean"] == pytest.approx(15.0)


def test_matches_take_the_first_group_and_numbers_may_have_commas():
    assert matches(re.compile(r"ours, (\d+) workers?: ([0-9,]+) tokens/s"), "ours, 2 workers: 1,234 tokens/s") == ["2"]
    out = extract([metric("t", r"workers: ([0-9,.]+) tokens/s", 0, "final")], "ours, 2 workers: 1,234.5 tokens/s",
                  "", command_ok=True)
    assert out["t"]["final"] == 1234.5


def test_builtin_compile_time_is_extracted_when_printed():
    out = extract([], "Compiled/Loaded model in 12.34 secs\n", "", command_ok=True)
    assert out == {"compile_time": {"value": 12.34}}


def test_a_regexp_that_never_matches_is_a_spec_error_naming_the_metric():
    with pytest.raises(MetricError, match="'speed'.*matched 0 time") as exc:
        extract([metric("speed", r"speed: (\d+)")], CANNED, "", command_ok=True)
    assert exc.value.spec
    with pytest.raises(MetricError) as exc:  # too few matches after a crash: the command's fault
        extract([metric("throughput", THROUGHPUT, skip=4)], CANNED, "", command_ok=False)
    assert not exc.value.spec


def test_derived_metrics_use_metrics_and_parameters_and_refuse_code():
    results = {"throughput": {"mean": 3.0}, "latency": {"final": 20.0}}
    derived = derive({"tokens_per_second": "{throughput} * {seq}"}, results, {"seq": "128"})
    assert derived == {"tokens_per_second": 384.0}
    out = derive({"a": "{throughput} / 2", "b": "max({a}, {latency}) - 1"}, results, {})
    assert out == {"a": 1.5, "b": 19.0}
    with pytest.raises(MetricError, match="derived 'c'.*nope"):
        derive({"c": "{nope} + 1"}, results, {})
    with pytest.raises(MetricError, match="derived 'd'"):
        derive({"d": "__import__('os').getpid()"}, results, {})


def test_parameter_forms_and_variant_names():
    assert expand_parameters({"b": "1,2", "a": "x"}) == [{"b": "1", "a": "x"}, {"b": "2", "a": "x"}]
    assert expand_parameters([["model", "seq"], ["gpt2", 128], ["gpt2-xl", 1024]]) == [
        {"model": "gpt2", "seq": "128"}, {"model": "gpt2-xl", "seq": "1024"}]
    assert variant_name("infer", {"seq": "128", "model": "gpt2 xl"}) == "infer_model_gpt2-xl_seq_128"
    with pytest.raises(ValueError, match="row 1"):
        expand_parameters([["a", "b"], [1]])


def write_spec(tmp_path, text: str) -> Path:
    path = tmp_path / "spec.yml"
    path.write_text(textwrap.dedent(text))
    return path


def test_spec_errors_name_the_benchmark_and_key(tmp_path):
    spec = write_spec(tmp_path, """\
        base_options: &base
          hardware: cpu
        good:
          <<: *base
          cmd: echo {n}
          parameters: {n: "1,2"}
        typo:
          <<: *base
          cmd: echo hi
          timeuot: 3
        missing_param:
          <<: *base
          cmd: echo {model} {seq}
          parameters: {model: gpt2}
        bad_metric:
          <<: *base
          cmd: echo
          data: {x: {regexp: '(', reduction_type: median}}
        """)
    with pytest.raises(UsageError) as exc:
        load_spec(spec)
    msg = str(exc.value)
    assert "typo: unknown key 'timeuot'" in msg
    assert "missing_param: cmd uses {seq} but `parameters` give model" in msg
    assert "bad_metric: data.x: regexp '(' does not compile" in msg
    assert "reduction_type 'median'" in msg
    assert "good" not in msg.replace("good:", "")  # the valid entry is not blamed


def test_variants_fill_placeholders_and_groups_select(tmp_path):
    spec = write_spec(tmp_path, """\
        a:
          hardware: cuda
          cmd: python run.py --model {model} --home $HOME_X --seq {seq}
          env: {HOME_X: /h}
          parameters: [[model, seq], [gpt2, 128], [gpt2-xl, 1024]]
        a_cpu:
          hardware: cpu
          cmd: python run.py --model test
        """)
    entries = load_spec(spec)
    variants = {name: build_variants(spec, name, e) for name, e in entries.items()}
    argvs = [v.argv[1:] for v in variants["a"]]
    assert argvs == [["run.py", "--model", "gpt2", "--home", "/h", "--seq", "128"],
                     ["run.py", "--model", "gpt2-xl", "--home", "/h", "--seq", "1024"]]
    assert variants["a"][0].argv[0] == sys.executable and variants["a"][0].cwd == tmp_path
    assert [v.name for v in select(variants, ["cpu"])] == ["a_cpu"]
    assert [v.name for v in select(variants, ["a_model_gpt2-xl_seq_1024", "all"])] == [
        "a_model_gpt2-xl_seq_1024", "a_model_gpt2_seq_128", "a_cpu"]
    with pytest.raises(UsageError, match="--benchmark nope: no such benchmark.*groups: all, cpu, cuda"):
        select(variants, ["nope"])


# -- the shipped spec ---------------------------------------------------------------------------

def shipped_variants():
    entries = load_spec(SPEC)
    return entries, [v for name, e in entries.items() for v in build_variants(SPEC, name, e)]


def trainer_args(argv: list[str]) -> list[str] | None:
    """The train_gpt2.py / inference_gpt2.py flags a command passes (a run/*.sh script's own flags
    first, then the extra ones, as the script's "$@" does); None for other commands."""
    script = Path(argv[1]).name if len(argv) > 1 else ""
    if script in ("train_gpt2.py", "inference_gpt2.py"):
        return argv[2:]
    if argv[0] == "bash" and argv[1].startswith("run/"):
        text = (ROOT / argv[1]).read_text().replace("\\\n", " ")
        line = next(ln for ln in text.splitlines() if "launch train_gpt2.py" in ln)
        return [a for a in shlex.split(line.split("train_gpt2.py", 1)[1]) if a != "$@"] + argv[2:]
    return None


def test_shipped_spec_parses_and_every_command_parses_against_its_parser():
    entries, variants = shipped_variants()
    assert {v.hardware for v in variants} <= {"cpu", "cpu-host", "cuda"}
    for name, entry in entries.items():  # every full-size entry has a CPU-sized twin
        assert entry["hardware"] == "cpu" or f"{name}_cpu" in entries, name
    checked_trainer = checked_scripts = 0
    for v in variants:
        args = trainer_args(v.argv)
        if args is not None:
            parse_args(args)  # raises on an unknown flag or an invalid combination
            checked_trainer += 1
            continue
        script = ROOT / v.argv[1]
        assert script.is_file(), f"{v.name}: {script} not found"
        module_spec = importlib.util.spec_from_file_location(f"bench_{script.stem}", script)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
        if hasattr(module, "parse_args"):
            module.parse_args(v.argv[2:])
        else:  # argparse built inside main(): every flag used must be one it declares
            for flag in (a for a in v.argv[2:] if a.startswith("--")):
                assert f'"{flag}"' in script.read_text(), f"{v.name}: {script.name} has no {flag}"
        checked_scripts += 1
    assert checked_trainer >= 10 and checked_scripts >= 12


def test_make_bench_runs_the_runner_on_the_named_group():
    out = subprocess.run(["make", "-n", "-o", "setup", "bench", "BENCH=sample_index_cpu"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    assert "-m gpt2forge.benchmark_runner --spec benchmarks.yml --benchmark sample_index_cpu" in out


# -- end to end ---------------------------------------------------------------------------------

def run_runner(spec: Path, log_dir: Path, *extra: str) -> tuple[int, dict]:
    code = bench_main(["--spec", str(spec), "--log-dir", str(log_dir), *extra])
    results = json.loads((log_dir / "benchmark_results.json").read_text())
    return code, {r["variant"]: r for r in results["variants"]}


def test_runner_end_to_end_exit_codes_logs_and_results(tmp_path, capsys):
    emit = ("import sys; [print('step, throughput: %s samples/sec' % t) for t in (1, 4, 2)]; "
            "print('latency avg: 7.5 ms', file=sys.stderr)")  # no braces: {x} is a placeholder
    spec = write_spec(tmp_path, f"""\
        run_options: &opts
          hardware: cpu
          data:
            throughput: {{skip: 1, regexp: 'throughput: *(.*?) samples\\/sec'}}
            latency: {{reduction_type: final, regexp: 'latency avg: *(.*?) ms'}}
          derived:
            per_batch: {{expr: '{{throughput}} * {{batch}}'}}
        ok:
          <<: *opts
          parameters: {{batch: "2,4"}}
          cmd: >-
            python -c "{emit}"
        crash:
          <<: *opts
          cmd: >-
            python -c "import sys; print('error: --flag is wrong', file=sys.stderr); sys.exit(2)"
        slow:
          hardware: cpu
          timeout: 1
          cmd: python -c "import time; time.sleep(30)"
        """)
    code, res = run_runner(spec, tmp_path / "logs", "--benchmark", "ok")
    assert code == 0
    ok = res["ok_batch_2"]
    assert ok["status"] == "PASSED" and ok["results"]["throughput"] == {"mean": 3.0}
    assert ok["results"]["latency"] == {"final": 7.5} and ok["derived"] == {"per_batch": 6.0}
    assert res["ok_batch_4"]["derived"] == {"per_batch": 12.0}
    stdout_log = (tmp_path / "logs" / "ok_batch_2" / "stdout").read_text()
    assert stdout_log.startswith("== environment") and "custom ops:" in stdout_log
    assert "latency avg: 7.5 ms" in (tmp_path / "logs" / "ok_batch_2" / "stderr").read_text()
    rows = list(csv.DictReader((tmp_path / "logs" / "benchmark_results.csv").open()))
    assert [(r["variant"], r["throughput"], r["per_batch"]) for r in rows] == [
        ("ok_batch_2", "3.0", "6.0"), ("ok_batch_4", "3.0", "12.0")]
    assert "2 passed, 0 failed" in capsys.readouterr().out

    code, res = run_runner(spec, tmp_path / "logs2", "--benchmark", "crash", "slow")
    assert code == 1
    assert res["crash"]["status"] == "FAILED" and res["crash"]["reason"] == "exit code 2: error: --flag is wrong"
    assert res["slow"]["status"] == "FAILED" and res["slow"]["reason"] == "timed out after 1 s"

    code, res = run_runner(spec, tmp_path / "logs3", "--benchmark", "crash", "ok", "--stop-on-error")
    assert code == 1 and list(res) == ["crash"]


def test_a_regexp_that_never_matches_exits_2(tmp_path):
    spec = write_spec(tmp_path, """\
        quiet:
          hardware: cpu
          cmd: python -c "print('nothing to see')"
          data: {speed: {regexp: 'speed: ([0-9.]+)'}}
        """)
    code, res = run_runner(spec, tmp_path / "logs")
    assert code == 2 and res["quiet"]["spec_error"]
    assert "spec error: metric 'speed'" in res["quiet"]["reason"]


def test_spec_error_is_one_line_and_exit_2(tmp_path, capsys):
    spec = write_spec(tmp_path, "x:\n  hardware: cpu\n  cmd: echo\n  frobnicate: 1\n")
    assert bench_main(["--spec", str(spec), "--log-dir", str(tmp_path / "l")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: spec.yml: x: unknown key 'frobnicate'") and err.count("\n") == 1


@pytest.mark.slow
def test_real_cpu_entry_with_profile_and_compile_only(tmp_path):
    """The shipped inference CPU entry, run by the runner as `make bench` does, under --profile."""
    log_dir = tmp_path / "logs"
    proc = subprocess.run([sys.executable, "-m", "gpt2forge.benchmark_runner", "--spec", str(SPEC), "--benchmark",
                           "gpt2_infer_gen_cpu", "--log-dir", str(log_dir), "--profile"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    record = json.loads((log_dir / "benchmark_results.json").read_text())["variants"][0]
    assert record["status"] == "PASSED" and record["results"]["throughput"]["mean"] > 0
    step_lines = re.findall(r"throughput: ([0-9.]+) samples/sec",
                            (log_dir / "gpt2_infer_gen_cpu" / "stdout").read_text())
    assert len(step_lines) == 4
    assert record["results"]["throughput"]["mean"] == pytest.approx(
        sum(sorted(map(float, step_lines))[1:]) / 3)
    prof = log_dir / "gpt2_infer_gen_cpu_profile"
    assert "traceEvents" in json.loads((prof / "trace.json").read_text())
    assert "aten::" in (prof / "top_ops.txt").read_text()

    code, res = run_runner(SPEC, tmp_path / "co", "--benchmark", "gpt2_infer_gen_cpu", "sample_index_cpu",
                           "--compile-only")
    assert code == 0 and res["sample_index_cpu"]["status"] == "SKIPPED"
    assert res["gpt2_infer_gen_cpu"]["results"]["compile_time"]["value"] >= 0


TRAINER_OUTPUT = textwrap.dedent("""\
    LM loss: fused, 128 tokens x 4 vocabulary chunk(s) at a time
    step 0 of epoch 0, loss: 10.8418, acc: 0.0000, lr: 0.000128, throughput: 0.77 samples/sec, tokens/s: 49.1, MFU: 1.5%
    step 1 of epoch 0, loss: 10.5219, acc: 0.0100, lr: 7.5e-05, throughput: 2.00 samples/sec, tokens/s: 128.0, MFU: 3.9%
    step 2 of epoch 0, loss: 10.2543, acc: 0.0200, lr: 2.2e-05, throughput: 3.00 samples/sec, tokens/s: 192.0, MFU: 5.5%
    """)


def test_shipped_training_metrics_read_the_step_lines_only():
    entries, variants = shipped_variants()
    trainers = [v for v in variants if trainer_args(v.argv) is not None and "train" in v.benchmark]
    assert len(trainers) >= 10
    for v in trainers:
        out = extract(v.metrics, TRAINER_OUTPUT, "", command_ok=True)
        assert out["throughput"] == {"mean": 2.5} and out["tokens_per_second"] == {"mean": 160.0}, v.name
        assert out["loss"] == {"final": 10.2543}, v.name
