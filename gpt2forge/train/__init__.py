"""Training: the run's configuration (`config`; the command lines that build one are
gpt2forge.frontends), the model a run starts from (`model_setup`), memory features (`memory_features`),
optimizers (`optim`), learning-rate schedules (`schedule`), one update (`step`), the run's checkpoint
folder (`run_folder`: saving, pruning, `latest`, the training state), checkpoints and resuming under any
layout (`state`), exit signals (`signals`), what a run reports (`metrics`: its lines, MFU, sinks and
profiler), what the loop feeds on (`batches`: the datasets, an epoch's updates) and the loop (`trainer`).

May import: every package below it (core, ops, text, model, data, preprocess, parallel, generate,
evaluation).
"""
