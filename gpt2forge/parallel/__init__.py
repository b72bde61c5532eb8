"""How one model is spread over processes: the process topology and stage map (`topology`),
process groups, DDP and FSDP2 (`distributed`), pipeline stages and schedules (`pipeline_stages`), the
training loop's one interface to a layout (`strategy`, implemented by `data_parallel`, `fsdp` and
`pipeline_strategy`), the per-process memory plan (`memory_plan`), job health (`health`) and layout-free
optimizer state (`optimizer_state`).

May import: gpt2forge.core, gpt2forge.ops, gpt2forge.text, gpt2forge.model, gpt2forge.data.
"""
