import sys

from gpt2forge.benchmark_runner.cli import main

sys.exit(main())
