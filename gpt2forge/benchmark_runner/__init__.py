"""Benchmark runner: `python -m gpt2forge.benchmark_runner --spec benchmarks.yml [--benchmark NAME ...]`.

Reads the examples-utils spec format of the reference (graphcore_gpt2.md §9): a YAML mapping of
benchmark name -> entry (names containing `options` only hold YAML anchors). An entry has

  cmd          the command; `{param}` placeholders are filled from `parameters`; $VAR / ${VAR} are
               expanded against the merged environment; a leading `python`/`python3` becomes this
               interpreter; run with the spec file's folder (joined with `location`) as cwd
  parameters   variants: dict form {name: "a,b"} (cartesian product) or list form
               [[names...], [values...], ...] (one variant per row); variant name
               `<benchmark>_<key>_<value>...` with the keys sorted
  data         metric -> {regexp, skip (default 0), reduction_type (default mean)}, matched per line
               of stdout and stderr; reductions: mean (sorted, ascending; descending for a metric
               named latency; the first `skip` dropped), final, value (first), min, max (after
               dropping the first `skip` matches)
  derived      metric -> {expr}: `{metric}` and `{param}` are substituted, the expression evaluated
  env          extra environment variables; `timeout` seconds (the smaller of it and --timeout)
  hardware     what it is meant for (cpu, cuda, ...): also the group name, so `--benchmark cpu`
               runs every entry with `hardware: cpu`
  compile_only true when the command accepts --compile-only (the trainer, inference, run scripts)
  profile      steps: the command honours GPT2FORGE_PROFILE_STEPS/DIR itself (the trainer);
               process (default): the runner runs the Python script under the profiler whole
  description, output, requirements_path, pre_run_commands: documentation, not used

Spec errors (unknown keys, a missing parameter, a bad regexp, a regexp that never matches the
output of a command that succeeded) name the benchmark and key and exit with code 2; a failing
command exits with code 1.

May import: every package below it; it uses gpt2forge.core, the trainer's profiling and run-folder
settings (gpt2forge.train.metrics.profiler) and the machine report (gpt2forge.tools).
"""
