#!/usr/bin/env python3
"""Stand-in for Graphcore's `examples_utils` module, which the reference's README runs from this folder
(`python3 -m examples_utils benchmark --spec benchmarks.yml`; its Makefile ran `load_lib_build .`): one line
naming what replaces the command, exit code 2. It imports nothing of the package."""

import shlex
import sys


def main(argv: list[str]) -> int:
    command = argv[0] if argv else ""
    if command == "benchmark":  # the runner here takes the same --spec, --benchmark and --profile
        line = shlex.join(["python", "-m", "gpt2forge.benchmark_runner", *argv[1:]])
        print(f"error: examples_utils benchmark is Graphcore's runner; here it is `{line}` (docs/benchmarks.md)",
              file=sys.stderr)
    elif command == "load_lib_build":
        print("error: examples_utils load_lib_build is Graphcore's; here `make` builds custom_ops/", file=sys.stderr)
    else:
        print(f"error: examples_utils {command}: Graphcore's examples-utils is not used here; benchmarks run with "
              "`python -m gpt2forge.benchmark_runner --spec benchmarks.yml`, the custom ops build with `make`",
              file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
