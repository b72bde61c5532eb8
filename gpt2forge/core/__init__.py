"""Foundations every other package builds on: user-facing errors (`errors`), the rank-aware logging
helper (`log`), atomic file writes (`atomic`), file digests (`digest`), the label value losses skip
(`labels`), device, precision and compile helpers (`runtime`), which device-dependent code path runs
(`capability`) and command-line value parsing (`flags`).

May import: the standard library, torch and numpy only; nothing else from gpt2forge.
"""
