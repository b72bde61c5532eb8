"""Checkpoints that survive real clusters: SIGTERM/SIGUSR1 save step_N and exit 0 (one process and
two under torchrun), step_N names with epoch links, saves that cannot happen (one line, nothing
stray), training states this program did not write, and a fine-tune's record of its parent."""

import errno
import hashlib
import json
import os
import pickle
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gpt2forge.model.checkpoint as model_ck
import gpt2forge.train.run_folder as ck
import gpt2forge.train.trainer as trainer
from gpt2forge.cli import train_main
from gpt2forge.model.config import ModelConfig
from gpt2forge.model.gpt2 import GPT2LMHeadModel
from gpt2forge.train import signals
from gpt2forge.train.config import CheckpointArgs
from gpt2forge.train.state import Progress, checkpoint_name, run_lineage

ROOT = Path(__file__).resolve().parents[2]
STEP_LINE = re.compile(r"^(step \d+ of epoch \d+, loss: \S+, acc: \S+, lr: \S+),")


@pytest.fixture()
def tiny_config(make_tiny_config) -> Path:
    return make_tiny_config(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)


def base_args(cfg: Path, out: Path, *extra: str) -> list[str]:
    """Generated data: 4 host steps per epoch, 2 epochs."""
    return ["--model-config", str(cfg), "--dataset", "generated", "--max-len", "16", "--batch-size", "2",
            "--gradient-accumulation", "2", "--device-iterations", "1", "--epochs", "2", "--num-workers", "0",
            "--learning-rate", "3e-3", "--lr-schedule", "cosine", "--checkpoint-output-dir", str(out), *extra]


def step_lines(text: str) -> list[str]:
    return [m.group(1) for line in text.splitlines() if (m := STEP_LINE.match(line))]


def error_line(capsys, argv: list[str]) -> str:
    assert train_main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def signal_at_update(monkeypatch, n: int, signum: int) -> None:
    """Deliver `signum` to this process during the n-th optimizer update (one per host step here)."""
    real, calls = trainer.train_step, [0]

    def train_step(run, micro_batches):
        calls[0] += 1
        if calls[0] == n:
            signal.raise_signal(signum)
        return real(run, micro_batches)
    monkeypatch.setattr(trainer, "train_step", train_step)


# --- signals ---------------------------------------------------------------------------------------

def test_sigterm_saves_step_n_exits_0_and_the_requeued_job_continues(tiny_config, tmp_path, capsys, monkeypatch):
    assert train_main(base_args(tiny_config, tmp_path / "full", "--epochs", "1")) == 0
    full = step_lines(capsys.readouterr().out)
    assert len(full) == 4
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "o"
    argv = base_args(tiny_config, out, "--epochs", "1", "--auto-resume", "true")
    signal_at_update(monkeypatch, 2, signal.SIGTERM)
    assert train_main(argv) == 0
    text = capsys.readouterr().out
    assert f"stopped by SIGTERM after step 2; saved checkpoint {out / 'step_2'}" in text
    assert step_lines(text) == full[:2]  # the step it was in finished, no further one began
    assert (out / "latest").read_text().strip() == "step_2" and not (out / "epoch_1").exists()
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is gone after the run
    monkeypatch.undo()
    assert train_main(argv) == 0  # the requeued job: the same command
    text = capsys.readouterr().out
    assert f"auto-resume: continuing from {out / 'step_2'}" in text
    assert step_lines(text) == full[2:]


def test_sigint_still_interrupts_at_once_and_sigusr1_stops_without_a_checkpoint_dir(tiny_config, tmp_path, capsys,
                                                                                    monkeypatch):
    out = tmp_path / "o"
    # Python's own Ctrl-C handler, whatever this process inherited (a job started in the background
    # by a non-interactive shell inherits SIGINT ignored).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        signal_at_update(monkeypatch, 2, signal.SIGINT)
        code = train_main(base_args(tiny_config, out, "--save-per-steps", "1"))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert code == 130
    assert "interrupted" in capsys.readouterr().err
    assert not (out / "step_2").exists()  # Ctrl-C: no exit checkpoint, as before

    seen = {}
    real = trainer.train_step

    def train_step(run, micro_batches):
        seen.update({s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)})
        if len(seen) == 2:
            signal.raise_signal(signal.SIGUSR1)
        return real(run, micro_batches)
    monkeypatch.setattr(trainer, "train_step", train_step)
    assert train_main(base_args(tiny_config, tmp_path)[:-2]) == 0  # no --checkpoint-output-dir
    text = capsys.readouterr().out
    assert "stopped by SIGUSR1 after step 1; no checkpoint saved" in text and len(step_lines(text)) == 1
    assert seen[signal.SIGTERM] is signals._record  # ours while training
    assert seen[signal.SIGINT] is signal.getsignal(signal.SIGINT)  # Ctrl-C untouched


def test_the_handler_is_installed_only_when_asked_and_a_second_signal_is_not_held_back():
    delivered = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: delivered.append(signum))
    try:
        before = {s: signal.getsignal(s) for s in signals.EXIT_SIGNALS}
        with signals.exit_signals(False):
            assert {s: signal.getsignal(s) for s in signals.EXIT_SIGNALS} == before
            assert signals.agreed_signal(torch.device("cpu")) is None
        with signals.exit_signals(True):
            assert signals.agreed_signal(torch.device("cpu")) is None
            signal.raise_signal(signal.SIGUSR1)  # recorded only
            assert signals.agreed_signal(torch.device("cpu")) == "SIGUSR1" and delivered == []
            signal.raise_signal(signal.SIGUSR1)  # at once: torchrun's copy of the scheduler's signal, ignored
            assert delivered == []
            signals._received_at -= signals.REPEAT_WINDOW_S  # later: the user asks again
            signal.raise_signal(signal.SIGUSR1)  # handled as without our handler
            assert delivered == [signal.SIGUSR1]
        assert {s: signal.getsignal(s) for s in signals.EXIT_SIGNALS} == before
    finally:
        signal.signal(signal.SIGUSR1, previous)


def _workers(launcher: subprocess.Popen) -> dict[int, int]:
    """rank -> pid of the launcher's worker processes (its children, by their RANK)."""
    pids = []
    for task in Path(f"/proc/{launcher.pid}/task").iterdir():
        pids += [int(p) for p in (task / "children").read_text().split()]
    ranks = {}
    for pid in pids:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = next((e[5:] for e in env if e.startswith(b"RANK=")), None)
        if rank is not None:
            ranks[int(rank)] = pid
    return ranks


def _launch(argv: list[str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "train_gpt2.py", *argv], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _signal_after_first_step(proc: subprocess.Popen, signum: int, ranks: tuple[int, ...]) -> str:
    """Send `signum` to the workers of `ranks` once training prints a step line; the whole output."""
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step "):
                break
        workers = _workers(proc)
        assert set(workers) == {0, 1}, "".join(lines)[-3000:]
        for rank in ranks:
            os.kill(workers[rank], signum)
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    return "".join(lines) + rest


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds torchrun's workers through /proc")
def test_torchrun_job_stops_on_sigterm_at_one_step_on_every_rank_and_resumes(tiny_config, tmp_path):
    out = tmp_path / "o"
    argv = base_args(tiny_config, out, "--auto-resume", "true", "--replication-factor", "2", "--log-steps", "1",
                     "--epochs", "100000", "--save-per-epochs", "100000")
    # Slurm and torchrun signal every worker.
    proc = _launch(argv)
    text = _signal_after_first_step(proc, signal.SIGTERM, (0, 1))
    assert proc.returncode == 0, text[-3000:]
    saved = re.escape(str(out))
    stopped = re.search(rf"stopped by SIGTERM after step (\d+); saved checkpoint {saved}/step_(\d+)", text)
    assert stopped and stopped.group(1) == stopped.group(2), text[-3000:]
    n = int(stopped.group(1))
    assert (out / "latest").read_text().strip() == f"step_{n}"
    # The requeued job continues from step_N; now only rank 1 gets the signal (SIGUSR1): both ranks
    # still stop after the same step, or the job would hang in its next collective.
    proc = _launch(argv)
    text = _signal_after_first_step(proc, signal.SIGUSR1, (1,))
    assert proc.returncode == 0, text[-3000:]
    assert f"auto-resume: continuing from {out / f'step_{n}'}" in text
    assert f"resumed from {out / f'step_{n}'} at step {n} " in text
    m = int(re.search(r"stopped by SIGUSR1 after step (\d+); saved checkpoint", text).group(1))
    assert m > n and (out / f"step_{m}" / "training_state.pt").is_file()


# --- names ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("step", "epoch_done", "last", "stopping", "expected"), [
    (4, True, False, False, ("step_4", "epoch_2")),  # both apply: step_N is the directory, epoch_E a link
    (6, False, False, False, ("step_6",)),
    (5, False, False, False, ()),
    (5, True, False, False, ()),  # epoch 2 of --save-per-epochs 2 is due, epoch 3 is not
    (5, False, True, False, ("step_5",)),  # the end of training
    (5, False, False, True, ("step_5",)),  # an exit signal
])
def test_checkpoint_names(step, epoch_done, last, stopping, expected):
    cfg = CheckpointArgs(checkpoint_output_dir="o", save_per_steps=2, save_per_epochs=2)
    progress = Progress(step=step, epoch=2 if step == 4 else 3)
    assert checkpoint_name(cfg, progress, epoch_done, last, stopping) == expected


def test_a_step_save_at_an_epoch_end_has_both_names_and_keep_and_resume_work(tiny_config, tmp_path, capsys):
    out = tmp_path / "o"
    argv = base_args(tiny_config, out, "--save-per-steps", "2", "--keep-checkpoints", "2", "--auto-resume", "true")
    assert train_main(argv) == 0
    text = capsys.readouterr().out
    assert f"saved checkpoint {out / 'step_4'} (also {out / 'epoch_1'})" in text
    # step_2, step_4 (= epoch_1), step_6, step_8 (= epoch_2); the two newest are kept with their links.
    assert sorted(p.name for p in out.iterdir() if re.fullmatch(r"(step|epoch)_\d+|latest|\..*", p.name)) == [
        "epoch_2", "latest", "step_6", "step_8"]
    assert (out / "epoch_2").is_symlink() and (out / "epoch_2").resolve() == (out / "step_8").resolve()
    assert (out / "latest").read_text().strip() == "step_8"
    model_ck.load_weights(GPT2LMHeadModel(model_ck.load_model_config(out / "epoch_2")), out / "epoch_2")
    assert ck.latest_checkpoint(out) == out / "step_8"  # where --auto-resume continues


# --- saves that cannot happen ----------------------------------------------------------------------

def tiny_model() -> GPT2LMHeadModel:
    return GPT2LMHeadModel(ModelConfig(vocab_size=96, n_positions=16, n_embd=32, n_layer=2, n_head=2))


def training_state(model: GPT2LMHeadModel) -> dict:
    return {"progress": {"step": 1}, "optimizer": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}


def stray(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def test_too_little_free_space_is_one_line_before_anything_is_written(tmp_path, monkeypatch):
    model, root = tiny_model(), tmp_path / "ckpts"
    killed = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    (root / f".step_1.tmp-{killed.stdout.strip()}").mkdir(parents=True)  # from a save killed with kill -9
    (root / f".step_7.tmp-{os.getppid()}").mkdir()  # a live process's save
    ck.save_checkpoint(root, "step_1", model, training_state(model), {})
    assert stray(root) == [f".step_7.tmp-{os.getppid()}"]
    (root / f".step_7.tmp-{os.getppid()}").rmdir()
    written = sum(f.stat().st_size for f in (root / "step_1").iterdir())
    needed = ck.checkpoint_bytes(model_ck.to_hf_state_dict(model), training_state(model))
    assert written <= needed <= written + (2 << 20)  # an upper bound, and a close one
    usage = ck.shutil.disk_usage(root)
    monkeypatch.setattr(ck.shutil, "disk_usage", lambda p: usage._replace(free=needed - 1))
    with pytest.raises(ck.UsageError) as exc:
        ck.save_checkpoint(root, "step_2", model, training_state(model), {})
    msg = str(exc.value)
    assert "\n" not in msg and f"cannot save checkpoint {root / 'step_2'}: not enough free space" in msg
    assert f"needs {needed:,} bytes, {needed - 1:,} bytes free" in msg
    assert f"last complete checkpoint: {root / 'step_1'}" in msg
    assert not (root / "step_2").exists() and stray(root) == [] and (root / "latest").read_text() == "step_1\n"


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
                                     RuntimeError("basic_ios::clear: iostream error"),
                                     PermissionError(errno.EACCES, os.strerror(errno.EACCES))])
def test_a_failing_write_removes_its_temporary_directory(tmp_path, monkeypatch, failure):
    model, root = tiny_model(), tmp_path / "ckpts"

    def failing_save(obj, path):
        Path(path).write_bytes(b"x" * 1000)  # part of the file reached the disk
        raise failure
    monkeypatch.setattr(ck.torch, "save", failing_save)
    with pytest.raises(ck.UsageError) as exc:
        ck.save_checkpoint(root, "step_1", model, training_state(model), {})
    msg = str(exc.value)
    assert "\n" not in msg and f"cannot save checkpoint {root / 'step_1'}: {type(failure).__name__}" in msg
    assert str(failure.args[-1]) in msg and "last complete checkpoint: none" in msg
    assert list(root.iterdir()) == []  # no .step_1.tmp-<pid>, no latest


def test_a_run_whose_save_fails_exits_2_with_one_line(tiny_config, tmp_path, capsys, monkeypatch):
    out = tmp_path / "o"
    real, calls = ck.torch.save, [0]

    def save_once(obj, path):
        calls[0] += 1
        if calls[0] > 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(obj, path)
    monkeypatch.setattr(ck.torch, "save", save_once)
    msg = error_line(capsys, base_args(tiny_config, out, "--save-per-steps", "2"))
    assert f"cannot save checkpoint {out / 'step_4'}: OSError" in msg and "No space left on device" in msg
    assert f"last complete checkpoint: {out / 'step_2'}" in msg
    assert stray(out) == [] and not (out / "step_4").exists() and not (out / "epoch_1").exists()


# --- training states this program did not write ----------------------------------------------------

class Payload:
    """Unpickling this runs a shell command that creates a file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("how", ["pickle", "torch.save"])
def test_a_training_state_that_would_run_code_is_refused_in_one_line(tiny_config, tmp_path, capsys, how):
    out, model = tmp_path / "o", tiny_model()
    ck.save_checkpoint(out, "epoch_1", model, training_state(model), {})
    marker, state = tmp_path / "pwned", out / "epoch_1" / "training_state.pt"
    payload = {"progress": Payload(marker)}
    if how == "pickle":
        state.write_bytes(pickle.dumps(payload, protocol=2))
    else:
        torch.save(payload, state)
    assert pickle.loads(pickle.dumps(Payload(tmp_path / "probe"))) == 0 and (tmp_path / "probe").exists()  # it works
    msg = error_line(capsys, base_args(tiny_config, tmp_path / "p", "--checkpoint-input-dir", str(out / "epoch_1"),
                                       "--resume-training-from-checkpoint", "true"))
    assert msg.startswith(f"error: {state}: not a training state written by gpt2forge") and "system" in msg
    assert "weights_only" not in msg and not marker.exists()
    torch.save(torch.zeros(3), state)  # loadable, but no training state either
    msg = error_line(capsys, base_args(tiny_config, tmp_path / "p", "--checkpoint-input-dir", str(out / "epoch_1"),
                                       "--resume-training-from-checkpoint", "true"))
    assert f"{state}: not a training state" in msg and "Tensor" in msg


# --- a fine-tune records its parent ----------------------------------------------------------------

def test_fine_tune_checkpoints_record_the_parents_hash_and_resumes_keep_it(tiny_config, tmp_path, capsys):
    pre, fine = tmp_path / "pre", tmp_path / "fine"
    assert train_main(base_args(tiny_config, pre, "--epochs", "1")) == 0
    assert not (pre / "epoch_1" / ck.LINEAGE).exists()  # trained from scratch: no parent
    assert train_main(base_args(tiny_config, fine, "--epochs", "1", "--checkpoint-input-dir", str(pre))) == 0
    lineage = json.loads((fine / "epoch_1" / ck.LINEAGE).read_text())
    weights = (pre / "epoch_1" / "model.safetensors").read_bytes()
    assert lineage == {"parent": {"path": str((pre / "epoch_1").resolve()),
                                  "weights_sha256": {"model.safetensors": hashlib.sha256(weights).hexdigest()}}}
    # Continuing the fine-tune keeps its parent; fine-tuning the fine-tune records the chain.
    assert train_main(base_args(tiny_config, fine, "--auto-resume", "true")) == 0
    assert json.loads((fine / "epoch_2" / ck.LINEAGE).read_text()) == lineage
    chain = run_lineage(str(fine / "epoch_2"), resuming=False)["parent"]  # a fine-tune of the fine-tune
    assert chain["path"] == str((fine / "epoch_2").resolve()) and chain["lineage"] == lineage
