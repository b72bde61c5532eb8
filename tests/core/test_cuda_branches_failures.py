"""A GPU that runs out of memory or stops answering ends a command in one line, exit code 2
(errors.naming_gpu_failures): the line itself under the fake CUDA runtime (tests/fake_cuda.py), and
each command's one place for it (the training loop, the evaluation and generation commands), with
the error injected into a tiny CPU run."""

import json

import pytest
import torch

from gpt2forge.cli import generate_main, train_main
from gpt2forge.core.errors import UsageError, gpu_failure_line, naming_gpu_failures
from gpt2forge.evaluation import cli as evaluation_cli
from gpt2forge.generate.generator import Generator
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.train import trainer
from gpt2forge.train.state import save_checkpoint

CUDA0 = torch.device("cuda", 0)

OOM = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which 1.23 GiB "
       "is free. Process 4242 has 77.86 GiB memory in use. Including non-PyTorch memory, this process has 77.86 GiB "
       "memory in use. Of the allocated memory 75.20 GiB is allocated by PyTorch, and 1.66 GiB is reserved by "
       "PyTorch but unallocated. If reserved but unallocated memory is large try setting "
       "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See documentation for Memory "
       "Management  (https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
"""torch.cuda.OutOfMemoryError's message, as the caching allocator writes it (c10/cuda/CUDACachingAllocator.cpp)."""

ASYNC = ("\nCUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below "
         "might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\nCompile with "
         "`TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")
"""What torch appends to every CUDA error (c10/cuda/CUDAException.cpp)."""


def test_out_of_memory_names_the_work_the_memory_and_the_fixes(fake_cuda):
    line = gpu_failure_line(torch.OutOfMemoryError(OOM), CUDA0, "host step 3 of gpt2-xl", "try --plan",
                            "nothing lost")
    assert line == ("CUDA out of memory on cuda:0 (NVIDIA H100 80GB HBM3) in host step 3 of gpt2-xl: it asked for "
                    "2.00 GiB more with 1.23 GiB of the GPU's 79.11 GiB free (this process held 77.86 GiB); try "
                    "--plan; nothing lost")


@pytest.mark.parametrize("said", ["CUDA error: unspecified launch failure",
                                  "CUDA error: CUDA-capable device(s) is/are busy or unavailable",
                                  "CUDA error: uncorrectable ECC error encountered",
                                  "CUDA error: the launch timed out and was terminated"])
def test_a_gpu_that_stops_answering_is_one_line(fake_cuda, said):
    line = gpu_failure_line(torch.AcceleratorError(said + ASYNC), CUDA0, "host step 9", "try --plan", "resume")
    assert line == (f"the GPU cuda:0 (NVIDIA H100 80GB HBM3) stopped working in host step 9 ({said}): it reset, "
                    "fell off the bus, hit an uncorrectable ECC error or hung; `nvidia-smi` and the kernel log "
                    "(`dmesg`, NVRM Xid lines) say which; resume")


@pytest.mark.parametrize("error", [
    torch.AcceleratorError("CUDA error: an illegal memory access was encountered" + ASYNC),
    torch.AcceleratorError("CUDA error: device-side assert triggered" + ASYNC),
    RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 9x8)")])
def test_a_programs_own_errors_keep_their_traceback(fake_cuda, error):
    assert gpu_failure_line(error, CUDA0, "host step 1", "", "") is None
    with pytest.raises(type(error)), naming_gpu_failures(CUDA0, lambda: "host step 1", "", ""):
        raise error


def _raise_oom(*args, **kwargs):
    raise torch.OutOfMemoryError(OOM)


def test_training_out_of_memory_ends_the_run_in_one_line_and_keeps_its_checkpoints(tmp_path, monkeypatch, capsys):
    steps = []
    real_step = trainer.train_step

    def second_step_runs_out(run, micro_batches):
        steps.append(len(steps) + 1)
        return _raise_oom() if len(steps) == 2 else real_step(run, micro_batches)

    monkeypatch.setattr(trainer, "train_step", second_step_runs_out)
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps({"model_type": "gpt2", "vocab_size": 50257, "n_positions": 32, "n_embd": 32,
                                 "n_layer": 2, "n_head": 2}))
    out = tmp_path / "run"
    code = train_main(["--model-config", str(model), "--dataset", "generated", "--max-len", "16", "--batch-size", "4",
                       "--device-iterations", "1", "--training-steps", "3", "--num-workers", "0", "--device", "cpu",
                       "--precision", "fp32", "--checkpoint-output-dir", str(out), "--save-per-steps", "1"])
    assert code == 2
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert errors == [
        "error: out of memory on cpu in host step 2 of tiny (1.6M parameters, fp32), micro-batches of 4 x 16 tokens: "
        "it asked for 2.00 GiB more with 1.23 GiB of the GPU's 79.11 GiB free (this process held 77.86 GiB); try "
        "--plan (what each process needs, and whether it fits), --batch-size 2 with --gradient-accumulation 2 (the "
        "same global batch), --recompute-checkpoint-every-layer (activations recomputed in backward), --offload "
        f"optimizer or full (optimizer state in host memory); the checkpoints already in {out} are complete (each is "
        "published whole); --auto-resume continues from the latest"]
    assert (out / "step_1").is_dir() and not (out / "step_2").exists()


def _tiny_checkpoint(root):
    cfg = ModelConfig(vocab_size=50257, n_positions=64, n_embd=32, n_layer=2, n_head=2, vocab_pad_multiple=64)
    model = GPT2LMHeadModel(cfg)
    model.init_weights(torch.Generator().manual_seed(0))
    from gpt2forge.train.state import checkpoint_tokenizer_files

    return save_checkpoint(root, "step_1", model, {}, {}, extra_files=checkpoint_tokenizer_files(50257))


def test_evaluation_out_of_memory_is_one_line(tmp_path, monkeypatch, capsys):
    ckpt = _tiny_checkpoint(tmp_path / "ck")
    data = tmp_path / "wiki.test.tokens"
    data.write_text(" = Title = \n \n The cat sat on the mat . \n" * 6)
    monkeypatch.setattr(evaluation_cli, "evaluate_stream", _raise_oom)
    out = tmp_path / "r.json"
    code = evaluation_cli.wiki_main(["--checkpoint-input-dir", str(ckpt), "--valid-data", str(data), "--seq-length",
                                     "32", "--batch-size", "3", "--no-progress", "--device", "cpu", "--precision",
                                     "fp32", "--output-json", str(out)])
    assert code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: out of memory on cpu in evaluation of {ckpt} (1.6M parameters, fp32) in batches of 3 x 32 tokens: "
        "it asked for 2.00 GiB more with 1.23 GiB of the GPU's 79.11 GiB free (this process held 77.86 GiB); try a "
        "smaller --batch-size (now 3), a shorter --seq-length, --precision bf16 (or fp16 where the GPU has no "
        "bf16); nothing is lost: --output-json is written only when the evaluation completes")
    assert not out.exists()


def test_generation_out_of_memory_is_one_line_and_keeps_the_samples(tmp_path, monkeypatch, capsys):
    ckpt = _tiny_checkpoint(tmp_path / "ck")
    monkeypatch.setattr(Generator, "generate", _raise_oom)
    samples = tmp_path / "samples"
    code = generate_main(["--model-name-or-path", str(ckpt), "--prompt", "Hello", "--batch-size", "2",
                          "--output-len", "8", "--device", "cpu", "--save-samples-path", str(samples)])
    assert code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"error: out of memory on cpu in generation with {ckpt} (fp32) for 2 row(s) of up to 56 + 8 tokens: it "
        "asked for 2.00 GiB more with 1.23 GiB of the GPU's 79.11 GiB free (this process held 77.86 GiB); try a "
        "smaller --batch-size, a shorter --output-len or --input-len, --bf16 or --fp16 (half the weights and KV "
        f"cache); the completions printed so far are complete; the samples already in {samples}/samples.txt are "
        "kept")
    assert (samples / "samples.txt").read_text().startswith("Text generator record")


def test_the_line_is_a_usage_error(fake_cuda):
    with pytest.raises(UsageError, match=r"^CUDA out of memory on cuda:0 \(NVIDIA H100 80GB HBM3\) in step 4: "):
        with naming_gpu_failures(CUDA0, lambda: "step 4", "try --plan", "kept"):
            raise torch.OutOfMemoryError(OOM)
