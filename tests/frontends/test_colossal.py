"""Colossal-AI's Python configs (`--config gpt2_configs/gpt2_zero3.py`, seed 003): read without running
them, mapped onto the trainer's flags (the command line wins), the rest named; refused forms are one
line naming file:line."""

from pathlib import Path

import pytest
from colossal_examples import ZERO3  # tests/colossal_examples.py

from gpt2forge.core.errors import UsageError
from gpt2forge.frontends.colossal import KEYS, colossal_values
from gpt2forge.frontends.flag_table import cell
from gpt2forge.frontends.graphcore import parse_args

ROOT = Path(__file__).resolve().parents[2]

"""ColossalAI-Examples' language/gpt/gpt2_configs/gpt2_zero3.py, as seed 003 runs it."""

SEED_SNIPPET = """\
from model_zoo.gpt.gpt import gpt2_small
from colossalai.nn.optimizer import CPUAdam
from colossalai.zero.shard_utils import TensorShardStrategy
zero = dict(
    model_config=dict(
        offload_config=dict(device="cpu"),
        shard_strategy=TensorShardStrategy()
    ),
    optimizer_config=dict(
        cpu_offload=True,
    )
)
BATCH_SIZE = 2
NUM_EPOCHS = 60
SEQ_LEN = 1024
optimizer = dict(
    type=HybridAdam,
    lr=0.00015,
    weight_decay=1e-2,
)
model = dict(
    type=gpt2_small,
    checkpoint=True,
)
"""
"""Seed 003's own two blocks, one after the other (HybridAdam is used without its import)."""

PIPELINE_1D = """\
from titans.model.gpt import gpt2_small
from torch.optim import Adam
from colossalai.amp import AMP_TYPE
from titans.loss.vocab_cross_entropy import vocab_parallel_cross_entropy
import torch

BATCH_SIZE = 8
TENSOR_PARALLEL = 2
fp16 = dict(mode=AMP_TYPE.NAIVE, initial_scale=2**5)
parallel = dict(pipeline=1, tensor=dict(mode='1d', size=TENSOR_PARALLEL))
optimizer = dict(type=Adam, lr=0.00015, weight_decay=1e-2, betas=(0.8, 0.95))
model = dict(type=gpt2_small, checkpoint=False, dtype=torch.half, num_chunks=1)
loss_fn = dict(type=vocab_parallel_cross_entropy)
"""


def write(tmp_path: Path, text: str, name: str = "gpt2_zero3.py") -> str:
    path = tmp_path / "gpt2_configs" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    return str(path)


def test_seed_003_config_and_launch_line_become_the_run(tmp_path, monkeypatch, capsys):
    # Before: `--config x.py` was parsed as JSON ("cannot parse (JSONDecodeError)"), --from_torch unknown.
    monkeypatch.setenv("DATA", str(tmp_path / "train_data.json"))
    path = write(tmp_path, ZERO3)
    cfg = parse_args([f"--config={path}", "--from_torch"])
    assert (cfg.parallel.batch_size, cfg.optim.epochs, cfg.arch.max_len, cfg.arch.model) == (2, 60, 1024, "gpt2")
    assert (cfg.parallel.zero_stage, cfg.memory.offload) == (3, "full")
    assert (cfg.optim.optimizer, cfg.optim.learning_rate, cfg.optim.weight_decay) == ("AdamW", 0.00015, 0.01)
    assert (cfg.optim.lr_schedule, cfg.optim.lr_warmup) == ("linear", 5 / 60)
    assert cfg.memory.recompute_checkpoint_every_layer
    assert (cfg.data.dataset, cfg.data.input_files) == ("jsonl", [str(tmp_path / "train_data.json")])
    out, err = capsys.readouterr()
    assert f"--config {path} (Colossal-AI's) stands for: --batch-size 2 --max-len 1024 --epochs 60" in out
    assert "notice" not in err  # every setting of the file was read or accepted
    # the command line wins, and names the data instead of $DATA
    cli = parse_args([f"--config={path}", "--batch-size", "7", "--offload", "optimizer", "--dataset", "generated"])
    assert (cli.parallel.batch_size, cli.memory.offload, cli.data.dataset, cli.data.input_files) == \
        (7, "optimizer", "generated", None)


def test_seed_003_snippet_offloads_everything_and_uses_known_names(tmp_path, monkeypatch):
    monkeypatch.delenv("DATA", raising=False)
    values = colossal_values(write(tmp_path, SEED_SNIPPET))
    assert values["offload"] == "full" and values["zero_stage"] == 3 and values["optimizer"] == "AdamW"
    assert "dataset" not in values


def test_pipeline_1d_config_maps_precision_tensor_parallel_and_names_the_rest(tmp_path, capsys):
    values = colossal_values(write(tmp_path, PIPELINE_1D, "gpt2_pp1d.py"))
    assert values["tensor_model_parallel_size"] == 2 and values["precision"] == "fp16"
    assert (values["initial_loss_scale"], values["loss_scale_window"], values["loss_scale_hysteresis"]) == \
        (32.0, 1000, 2)
    assert (values["optimizer"], values["adam_beta1"], values["adam_beta2"]) == ("Adam", 0.8, 0.95)
    assert "recompute_checkpoint_every_layer" not in values
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"notice: --config {tmp_path / 'gpt2_configs' / 'gpt2_pp1d.py'}: no meaning here, ignored: "
                   "TENSOR_PARALLEL, model.num_chunks, loss_fn.type"]


ZERO3_PP1D = """\
from colossalai.nn.optimizer import HybridAdam
from colossalai.zero.shard_utils import (BucketTensorShardStrategy,
                                         TensorShardStrategy)
from model import GPT2_small_pipeline_hybrid

BATCH_SIZE = 8
NUM_EPOCHS = 60
SEQ_LEN = 1024
NUM_MICRO_BATCHES = 4
HIDDEN_SIZE = 768
TENSOR_SHAPE = (BATCH_SIZE // NUM_MICRO_BATCHES, SEQ_LEN, HIDDEN_SIZE)
zero = dict(
    model_config=dict(
        tensor_placement_policy='cpu',
        shard_strategy=BucketTensorShardStrategy()
    ),
    optimizer_config=dict()
)


optimizer = dict(
    type=HybridAdam,
    lr=0.00015,
    weight_decay=1e-2,
)

model = dict(
    type=GPT2_small_pipeline_hybrid,
    checkpoint=True,
    num_chunks=1
)

parallel = dict(
    pipeline=2,
    tensor=dict(size=2, mode='1d'),
)
"""
"""ColossalAI-Examples' language/gpt/gpt2_configs/gpt2_zero3_pp1d.py."""


def test_pipeline_config_splits_the_blocks_and_the_batch(tmp_path, capsys):
    cfg = parse_args(["--config", write(tmp_path, ZERO3_PP1D, "gpt2_zero3_pp1d.py"), "--dataset", "generated"])
    assert (cfg.parallel.layers_per_ipu, cfg.parallel.ipus_per_replica, cfg.parallel.tensor_model_parallel_size) == \
        ([6, 6], 2, 2)
    assert (cfg.parallel.batch_size, cfg.parallel.gradient_accumulation) == (2, 4)  # 4 micro-batches of 2
    assert (cfg.arch.model, cfg.parallel.zero_stage, cfg.memory.offload) == ("gpt2", 3, "full")
    assert capsys.readouterr().err.strip().endswith("no meaning here, ignored: HIDDEN_SIZE, TENSOR_SHAPE")
    # Colossal-AI's uniform partition: the later stages take the remainder; the example's exlarge model
    exlarge = "from model import GPT2_exlarge_pipeline_1D\nparallel = dict(pipeline=5)\n" \
              "model = dict(type=GPT2_exlarge_pipeline_1D)\n"
    values = colossal_values(write(tmp_path, exlarge, "exlarge.py"))
    assert values["layers_per_ipu"] == [9, 9, 10, 10, 10] and values["model"] == "gpt2-xl"
    assert values["num_attention_heads"] == 32


def test_older_zero_config_is_deepspeeds_zero_under_colossal_names(tmp_path):
    text = "BATCH_SIZE = 1\nzero = dict(level=2, dynamic_loss_scale=True, overlap_comm=True, clip_grad=1.0, " \
           "cpu_offload=True)\n"
    values = colossal_values(write(tmp_path, text, "gpt2_zero2.py"))
    assert (values["zero_stage"], values["offload"], values["max_grad_norm"], values["auto_loss_scaling"]) == \
        (2, "optimizer", 1.0, True)


@pytest.mark.parametrize("text,line,message", [
    ("import os\nos.system('ls')\n", 2, "`os.system('ls')` is not a plain assignment"),
    ("BATCH_SIZE = int('2')\n", 1, "`int` is neither imported nor assigned above"),
    ("from x import f\nBATCH_SIZE = f(2)\n", 2, "`f(2)` has positional or ** arguments"),
    ("def f():\n    pass\n", 1, "`def f():` is not a plain assignment"),
    ("X = 1\nfor i in range(3):\n    X += i\n", 2, "`for i in range(3):` is not a plain assignment"),
    ("BATCH_SIZE = SIZE\n", 1, "`SIZE` is neither imported nor assigned above"),
    ("SEQ_LEN = [x for x in (1, 2)]\n", 1, "`[x for x in (1, 2)]` is not a literal"),
    ("SEQ_LEN = 2 ** 100000\n", 1, "`2 ** 100000` is too large a power"),
    ("zero = dict(level=3, offload_param_config=dict(device='nvme'))\n", None,
     "zero.offload_param_config.device 'nvme': only cpu offload"),
    ("parallel = dict(pipeline=2)\n", None, "parallel.pipeline 2: the blocks of this model are not known here"),
    ("from titans.model.gpt import gpt2_small\nparallel = dict(pipeline=2)\nmodel = dict(type=gpt2_small, "
     "num_chunks=2)\n", None, "model.num_chunks 2: the interleaved schedule is not here"),
    ("BATCH_SIZE = 6\nNUM_MICRO_BATCHES = 4\nparallel = dict(pipeline=2)\nmodel = dict(depth=4, dim=32, num_heads=2)\n",
     None, "NUM_MICRO_BATCHES 4: must divide BATCH_SIZE 6"),
    ("parallel = dict(tensor=dict(size=4, mode='2d'))\n", None, "parallel.tensor.mode '2d': only 1d"),
    ("from torch.optim import SGD\noptimizer = dict(type=SGD, lr=0.1)\n", None, "optimizer.type 'SGD'"),
    ("from titans.model.gpt import gpt2_8B\nmodel = dict(type=gpt2_8B)\n", None, "model.type 'gpt2_8B'"),
    ("BATCH_SIZE = 'two'\n", None, "BATCH_SIZE 'two': must be a whole number"),
    ("BATCH_SIZE = (\n", 1, "not Python"),
])
def test_refused_forms_and_values_are_one_line(tmp_path, text, line, message):
    path = write(tmp_path, text, "bad.py")
    with pytest.raises(UsageError) as exc:
        parse_args(["--config", path, "--dataset", "generated"])
    where = f"--config {path}:{line}: " if line else f"--config {path}: "
    assert str(exc.value).startswith(where) and message in str(exc.value), str(exc.value)
    assert "\n" not in str(exc.value)


def test_a_refused_config_exits_2_without_a_traceback(tmp_path, capsys):
    from gpt2forge.cli import train_main

    path = write(tmp_path, "import os\nos.remove('x')\n", "bad.py")
    assert train_main(["--config", path, "--dataset", "generated"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --config {path}:2: ") and err.count("\n") == 1


def test_docs_show_every_setting():
    rows = [f"| `{key}` | {cell(here)} |" for key, here in KEYS.items()]
    table = ["| Colossal-AI setting | Here: `train_gpt2.py` flag, meaning |", "| --- | --- |", *rows]
    text = (ROOT / "docs" / "training.md").read_text()
    missing = [line for line in table if line not in text]
    assert not missing, "docs/training.md is behind; paste:\n" + "\n".join(table)
