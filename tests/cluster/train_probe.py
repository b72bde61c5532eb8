"""train_gpt2.py for the fault tests, with two probes switched on by the environment:

- G2F_EXIT_DIR: write <dir>/rank<R> holding the exit code the trainer returned (torchrun does
  not report its workers' codes when it was signalled itself);
- G2F_HANG_IN_SAVE=<name> and G2F_HANG_MARKER=<file>: while checkpoint <name> is written, after
  its files are in the temporary folder and before it is published, write <file> and sleep (the
  test kills the node there: a save killed mid-write).
"""

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from gpt2forge.cli import run_script, train_main  # noqa: E402
from gpt2forge.train import run_folder  # noqa: E402


def hang_in_save(name: str, marker: Path) -> None:
    write = run_folder._write_files

    def writing(tmp: Path, *args, **kwargs):
        write(tmp, *args, **kwargs)
        if tmp.name.startswith(f".{name}.tmp-"):
            marker.write_text(str(tmp))
            time.sleep(600)  # the test kills this process within seconds

    run_folder._write_files = writing


def main() -> int:
    if name := os.environ.get("G2F_HANG_IN_SAVE"):
        hang_in_save(name, Path(os.environ["G2F_HANG_MARKER"]))
    code = train_main(sys.argv[1:])
    if folder := os.environ.get("G2F_EXIT_DIR"):
        (Path(folder) / f"rank{os.environ.get('RANK', '0')}").write_text(str(code))
    return code


if __name__ == "__main__":
    run_script(main)
