"""What a training run reports, in one room:

- `lines`: the step and validation lines, in the reference's layout or Megatron-LM's (`StepReport`,
  the one record of a host step);
- `peak_flops`: the device's peak FLOP/s (measured on a CPU) and the step meter (samples/s, tokens/s, MFU);
- `monitor`: the sinks of every record (metrics file, progress bar, TensorBoard, W&B), behind one
  `RunMonitor`;
- `profiler`: the PyTorch profiler over chosen host steps.
"""
