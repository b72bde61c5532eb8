"""Run under torchrun (gloo, 2 processes) by test_distributed: rank 1 reaches the preflight check
`delay` seconds late; with a `timeout` shorter than that, rank 0 must fail with a one-line error."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from gpt2forge.core.errors import UsageError
from gpt2forge.parallel.health import preflight


def main(delay: float, timeout: float) -> int:
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(delay)
    try:
        preflight(torch.device("cpu"), datetime.timedelta(seconds=timeout))
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"rank {dist.get_rank()} passed", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main(float(sys.argv[1]), float(sys.argv[2]))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as train_gpt2.py under torchrun: no interpreter teardown after gloo
