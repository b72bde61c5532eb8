"""Front ends: the command lines users bring, each turned into one TrainConfig for the one trainer.

- `graphcore`: train_gpt2.py's own flags (the Graphcore application's), with `--config` files;
  Colossal-AI `.py` configs through `colossal` (read by `python_config`, never run);
- `megatron`: Megatron-LM / Megatron-DeepSpeed's pretrain_gpt.py, with DeepSpeed's ds.json
  (`deepspeed`);
- `run_clm`: Hugging Face's run_clm / run_clm_no_trainer.py.

The foreign front ends are tables of `flag_table.Flag` rows; the config files (ds.json, Colossal-AI's
.py) are read by `config_file`, whose `Key` rows name their fields as flag rows do. The loop
(gpt2forge.train) knows none of them: it takes a TrainConfig.

May import: every package below it and gpt2forge.train.config (TrainConfig), never the loop.
"""
