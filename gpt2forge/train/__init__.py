"""Training: the run's configuration (`config`; the command lines that build one are
gpt2forge.frontends), what a run resolves before its first step (`setup`: the process, the model
through gpt2forge.model.build, the layout, the step's parts), memory features (`memory_features`),
optimizers (`optim`), learning-rate schedules (`schedule`), one update (`step`), the run's checkpoint
folder (`run_folder`: saving, pruning, `latest`, the training state), checkpoints and resuming under any
layout (`state`), exit signals (`signals`), what a run reports (`metrics`: its lines, MFU, sinks and
profiler), what the loop feeds on (`batches`: the datasets, an epoch's updates) and the loop (`trainer`).

May import: every package below it (core, ops, text, model, data, preprocess, parallel, generate,
evaluation).
"""
