"""Foundations every other package builds on: user-facing errors (`errors`), the rank-aware logging
helper (`log`), atomic file writes (`atomic`), one process at a time on a file (`file_lock`), file
digests (`digest`), the label value losses skip (`labels`), the device a process runs on (`device`),
compilation (`compilation`), what a process may allocate (`memory`), precision and autocast
(`precision`), deterministic algorithms (`determinism`), fp16 loss scaling (`loss_scaler`), which
device-dependent code path runs (`capability`) and command-line value parsing (`flags`).

May import: the standard library, torch and numpy only; nothing else from gpt2forge.
"""
