"""The CUDA-only branches of what a run reports (MFU's GPU peak table and the peak read beside it,
the profiler's CUDA activity and sort key, the machine report's GPUs), run on the CPU under the
fake CUDA runtime (tests/fake_cuda.py)."""

import re

import pytest
import torch

from gpt2forge.tools import machine_report
from gpt2forge.train.metrics import peak_flops, profiler
from gpt2forge.train.metrics.lines import StepReport, step_line
from gpt2forge.train.metrics.peak_flops import GPU_PEAK_FLOPS, StepMeter, device_peak_flops

CUDA0 = torch.device("cuda", 0)
STEP_MFU = re.compile(r"^step \d+ of epoch \d+, .* MFU: (\S+),")
"""As tests/train/test_metrics_peak_flops.py reads the step line's MFU."""

NAMES = {
    "NVIDIA H200": "H200",
    "NVIDIA GH200 480GB": "H200",  # an H200-class GPU: the same dense peaks
    "NVIDIA H100 80GB HBM3": "H100",
    "NVIDIA H100 PCIe": "H100 PCIe",
    "NVIDIA A100-SXM4-80GB": "A100",
    "NVIDIA A100 80GB PCIe": "A100",
    "NVIDIA L40S": "L40S",
    "NVIDIA A10": "A10",
    "Tesla V100-SXM2-16GB": "V100",
    "NVIDIA GeForce RTX 4090": "RTX 4090",
    "NVIDIA GeForce RTX 3090": "RTX 3090",
}
"""What torch.cuda.get_device_name says for each GPU of the table -> its row."""


def test_every_row_of_the_peak_table_is_named_by_a_real_gpu():
    assert set(NAMES.values()) == set(GPU_PEAK_FLOPS)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_the_gpu_peak_is_its_names_row(fake_cuda, name, precision):
    fake_cuda.names = ["NVIDIA H100 80GB HBM3", name]
    assert device_peak_flops(torch.device("cuda", 1), precision) == GPU_PEAK_FLOPS[NAMES[name]][precision]
    assert fake_cuda.called("get_device_name") == [((torch.device("cuda", 1),), {})]


def test_the_peaks_tell_the_gpus_apart(fake_cuda):
    peaks = {}
    for name in NAMES:
        fake_cuda.names = [name]
        peaks[name] = device_peak_flops(CUDA0, "bf16")
    assert peaks["NVIDIA H100 PCIe"] < peaks["NVIDIA H100 80GB HBM3"]
    assert peaks["NVIDIA A10"] < peaks["NVIDIA A100-SXM4-80GB"]
    assert peaks["Tesla V100-SXM2-16GB"] is None  # no bf16: the MFU is 'unknown'


@pytest.mark.parametrize("name", ["Tesla T4", "NVIDIA RTX A6000", "AMD Instinct MI300X"])
def test_an_unknown_gpu_has_no_peak(fake_cuda, name):
    fake_cuda.names = [name]
    assert all(device_peak_flops(CUDA0, p) is None for p in ("bf16", "fp16", "fp32"))


def test_the_profiler_records_cuda_and_sorts_by_device_time(fake_cuda, monkeypatch, tmp_path):
    made = []
    with monkeypatch.context() as patch:
        patch.setattr(torch.profiler, "profile", lambda **kw: made.append(kw) or "profiler")
        assert profiler.new_profiler() == "profiler"
    assert made[0]["activities"] == [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    # A real CPU profile to export: torch's table must know the sort key.
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))
    _, table = profiler.export_profile(prof, tmp_path, "title")
    assert "operators sorted by self_device_time_total, top 30" in table.read_text()


def test_the_machine_report_lists_each_gpu(fake_cuda):
    fake_cuda.names = ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]
    fake_cuda.capability = (7, 0)  # a V100: bf16 tensors, emulated bf16 matmuls: not native
    env = machine_report.environment()
    gpu = {"name": "NVIDIA H100 80GB HBM3", "capability": "7.0", "memory_gib": 80.0}
    assert env["devices"]["cuda"] == [gpu, {**gpu, "name": "NVIDIA H200"}]
    assert env["devices"]["cuda_runtime"] == "12.8"
    fast = env["fast_paths"]
    assert fast["bf16 on this GPU"] is False and fast["torch.compile (inductor)"] == "yes"
    assert {"SDPA flash", "SDPA memory-efficient"} <= set(fast)
    assert ("cuda: NVIDIA H100 80GB HBM3 (sm 7.0, 80.0 GiB); NVIDIA H200 (sm 7.0, 80.0 GiB) (CUDA runtime 12.8)"
            in machine_report.format_report(env))


FLOPS_PER_TOKEN = 6 * 124e6  # the meter takes any figure: round numbers keep the expected lines readable


def _report(meter, tokens_per_s: float) -> StepReport:
    meter.rates(1024 * 16 / tokens_per_s)  # raises the peak where the step beat it
    return StepReport(step=3, total_steps=10, index_in_epoch=2, epoch=0, loss=3.5, acc=0.25, lr=6e-4,
                      samples_per_s=tokens_per_s / 1024, tokens_per_s=tokens_per_s, mfu=meter.mfu(tokens_per_s),
                      mfu_uncertain=meter.last_uncertain, peak_memory_gib=9.5, data_wait_pct=0.1,
                      grad_norm=1.0, seconds_per_step=1024 * 16 / tokens_per_s, consumed_samples=48,
                      consumed_tokens=48 * 1024, global_batch=16, loss_scale=1.0, skipped=0, processes=1,
                      epoch_done=False, last=False, mfu_of_read=meter.read_mfu(tokens_per_s),
                      peak_flops_read=meter.peak_flops_read)


def test_gpu_mfu_is_the_data_sheets_with_the_peak_read_here_beside_it(fake_cuda, monkeypatch):
    fake_cuda.names = ["NVIDIA H200"]
    reads = []
    monkeypatch.setattr(peak_flops, "read_gpu_peak_flops",
                        lambda device, precision: reads.append((device, precision)) or 790e12)
    sheet, read = device_peak_flops(CUDA0, "bf16"), peak_flops.in_run_peak_flops(CUDA0, "bf16")
    assert (sheet, read, reads) == (989e12, 790e12, [(CUDA0, "bf16")])
    meter = StepMeter(16, 1024, FLOPS_PER_TOKEN, sheet, peak_flops_read=read)
    line = step_line("graphcore", _report(meter, 500_000.0))
    assert ", MFU: 37.6%, MFU of the peak read here: 47.1% of 790.0 TFLOP/s, peak memory: 9.50 GiB," in line
    assert STEP_MFU.match(line)[1] == "37.6%"  # the data sheet's figure is the one log parsers read
    assert _report(meter, 500_000.0).record()["mfu_of_read"] == pytest.approx(500_000 * FLOPS_PER_TOKEN / 790e12)


def test_a_cpu_step_line_has_no_second_mfu():
    assert peak_flops.in_run_peak_flops(torch.device("cpu"), "fp32") is None
    meter = StepMeter(16, 1024, FLOPS_PER_TOKEN, 2e12)
    report = _report(meter, 1000.0)
    assert "MFU of the peak read" not in step_line("graphcore", report) and "mfu_of_read" not in report.record()


def test_the_peak_read_is_a_timed_matmul_and_none_without_room(monkeypatch):
    assert peak_flops.read_gpu_peak_flops(torch.device("cpu"), "fp32", n=64, reps=2) > 0

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 128.00 MiB.")

    monkeypatch.setattr(torch, "randn", no_room)
    assert peak_flops.read_gpu_peak_flops(torch.device("cpu"), "bf16") is None
