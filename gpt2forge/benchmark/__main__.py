import sys

from gpt2forge.benchmark.cli import main

sys.exit(main())
