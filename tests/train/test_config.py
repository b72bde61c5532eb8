"""TrainConfig in sections: every field documented twice (--help line and docstring), the flat view
(`to_dict`, train_config.json, --config keys) unchanged, problems of all sections raised once."""

import ast
import dataclasses
import inspect
import json
import textwrap

import pytest

from gpt2forge.core.errors import UsageError
from gpt2forge.frontends.graphcore import build_parser, parse_args
from gpt2forge.train.config import FIELD_SECTION, SECTIONS, TrainConfig, field_help

# The flat field names of the single TrainConfig before it was split into sections (issue 15): the
# keys of every train_config.json saved next to a checkpoint and of --config files.
FLAT_NAMES = {
    "adam_beta1", "adam_beta2", "adam_eps", "muon_learning_rate", "muon_momentum", "windows", "dataset_config_name",
    "validation_split_percentage",
    "keep_linebreaks", "preprocessing_workers", "overwrite_cache", "final_model_dir",
    "hidden_dropout", "attention_dropout", "train_data_path", "valid_data_path", "test_data_path", "json_key",
    "data_cache_dir", "loss_on", "reset_position_ids", "reset_attention_mask", "eod_mask_loss", "min_lr",
    "train_samples", "lr_decay_samples", "lr_warmup_samples", "lr_warmup_form", "exit_signal_handler",
    "async_dataloader", "auto_loss_scaling", "auto_resume", "batch_size", "checkpoint_input_dir",
    "checkpoint_output_dir", "compile_only", "custom_ops", "dataset", "device", "device_iterations",
    "embedding_serialization_factor", "enable_half_partials", "enable_sequence_serialized", "epochs",
    "eval_every_steps", "eval_lambada", "eval_wikitext", "executable_cache_dir", "gradient_accumulation",
    "input_files", "ipus_per_replica", "keep_checkpoints", "layers_per_ipu", "learning_rate", "lm_loss", "log_steps",
    "loss_scaling", "lr_decay_steps", "lr_schedule", "lr_warmup", "lr_warmup_steps", "matmul_proportion",
    "max_grad_norm", "max_len", "max_nonfinite_updates", "metrics_file", "model", "model_config", "num_workers",
    "optimizer", "optimizer_state_offchip", "pipeline_schedule", "plan", "precision", "profile_dir",
    "profile_steps", "recompute_checkpoint_every_layer", "recompute_checkpoint_layers", "remap_logit",
    "replicated_tensor_sharding", "replication_factor", "resume_training_from_checkpoint", "sample_prompt",
    "sample_tokens", "save_per_epochs", "save_per_steps", "seed", "serialized_seq_len", "split", "stride",
    "tensorboard_dir", "tokenizer_name_or_path", "torch_compile", "training_steps", "use_wandb", "val_num",
    "verify", "weight_decay", "zero_stage", "offload", "device_memory_gib", "num_layers", "hidden_size",
    "num_attention_heads", "ffn_hidden_size", "max_position_embeddings", "init_method_std", "log_format",
    "eval_iters", "initial_loss_scale", "loss_scale_window", "min_loss_scale", "loss_scale_hysteresis",
    "tensor_model_parallel_size", "sequence_parallel",
    "kfac", "kfac_factor_update_steps", "kfac_inv_update_steps", "kfac_damping", "kfac_factor_decay",
    "kfac_kl_clip", "kfac_skip_layers", "kfac_compute_method", "deterministic",
}


@pytest.mark.parametrize("attr", list(SECTIONS))
def test_every_field_has_one_text_its_docstring_which_is_its_help(attr):
    cls = SECTIONS[attr]
    assert cls.__doc__ and cls.__doc__.strip()
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    documented = {node.target.id for node, after in zip(body, body[1:])
                  if isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr)
                  and isinstance(after.value, ast.Constant) and str(after.value.value).strip()}
    for f in dataclasses.fields(cls):
        assert f.name in documented, f"{cls.__name__}.{f.name} has no docstring"
        assert "help" not in f.metadata, f"{cls.__name__}.{f.name} has a second text (a help= beside its docstring)"
        assert field_help(f.name) == " ".join(field_help(f.name).split()) and field_help(f.name)


def test_flat_names_are_unchanged_and_unique():
    sizes = sum(len(dataclasses.fields(cls)) for cls in SECTIONS.values())
    assert sizes == len(FIELD_SECTION)  # no flat name in two sections
    assert set(FIELD_SECTION) == FLAT_NAMES
    cfg = parse_args(["--dataset", "generated", "--layers-per-ipu", "0", "2", "--ipus-per-replica", "2"])
    assert set(cfg.to_dict()) == FLAT_NAMES
    assert cfg.to_dict()["layers_per_ipu"] == [0, 2] and cfg.to_dict()["dataset"] == "generated"


def test_sections_are_the_train_config_fields():
    fields = {f.name: f.type for f in dataclasses.fields(TrainConfig)}
    assert list(fields) == list(SECTIONS)
    assert all(fields[attr] == cls.__name__ for attr, cls in SECTIONS.items())
    assert all(isinstance(getattr(TrainConfig.from_flat({"dataset": "generated"}), attr), cls)
               for attr, cls in SECTIONS.items())


def test_help_lists_every_flag_with_its_help_line_grouped_by_section():
    text = "".join(build_parser().format_help().split())  # argparse wraps lines, also at hyphens
    for cls in SECTIONS.values():
        assert "".join(cls.__doc__.split()) in text  # one argument group per section
        for f in dataclasses.fields(cls):
            assert f"--{f.name.replace('_', '-')}" in text
            assert "".join(field_help(f.name).split()) in text
    for alias in ("--pretrained-checkpoint", "--save-model-path", "--data-prefix", "--tfrecord-path", "--dry-run",
                  "--eval-steps", "--train-path", "--config"):
        assert alias in text


def test_saved_config_round_trips_through_config_file(tmp_path):
    cfg = parse_args(["--dataset", "pickle", "--input-files", "a.pkl", "--batch-size", "3", "--layers-per-ipu", "0",
                      "1", "1", "--ipus-per-replica", "3", "--matmul-proportion", "0.1", "0.2", "0.3",
                      "--learning-rate", "0.002", "--use-wandb", "--zero-stage", "2", "--sample-prompt", "Hi"])
    path = tmp_path / "train_config.json"  # what save_checkpoint writes next to the weights
    path.write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True))
    again = parse_args(["--config", str(path)])
    assert again == cfg and again.to_dict() == cfg.to_dict()
    assert (again.parallel.batch_size, again.optim.learning_rate, again.eval.sample_prompt) == (3, 0.002, "Hi")
    assert TrainConfig.from_flat(cfg.to_dict()) == cfg
    assert cfg.samples_per_update == 3 and cfg.samples_per_step == 12 and cfg.tokens_per_step == 12 * 128


def test_replace_changes_flat_fields_and_validates_again():
    cfg = parse_args(["--dataset", "generated", "--checkpoint-output-dir", "out"])
    resumed = cfg.replace(checkpoint_input_dir="out/step_3", resume_training_from_checkpoint=True)
    assert resumed.checkpoint.checkpoint_input_dir == "out/step_3"
    assert resumed.checkpoint.resume_training_from_checkpoint is True
    assert cfg.checkpoint.checkpoint_input_dir == ""  # the original is unchanged
    with pytest.raises(UsageError, match="--resume-training-from-checkpoint needs"):
        cfg.replace(resume_training_from_checkpoint=True)


def test_problems_of_all_sections_are_raised_once():
    with pytest.raises(UsageError) as exc:
        parse_args(["--batch-size", "0", "--max-len", "0", "--learning-rate", "-1", "--log-steps", "0"])
    message = str(exc.value)
    for flag in ("--batch-size", "--max-len", "--learning-rate", "--log-steps", "--dataset is required"):
        assert flag in message
    with pytest.raises(TypeError, match="no_such_field"):
        TrainConfig.from_flat({"no_such_field": 1})


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_a_float_flag_refuses_nan_and_infinity_by_name(value):
    # nan passed every range check (nan < 0 is False) and reached torch.optim's own ValueError traceback
    with pytest.raises(UsageError, match=rf"--learning-rate {value}: not a finite number") as exc:
        parse_args(["--dataset", "generated", f"--learning-rate={value}"])
    assert "\n" not in str(exc.value)
    with pytest.raises(UsageError, match="--adam-eps"):
        TrainConfig.from_flat({"dataset": "generated", "adam_eps": float(value)})  # a --config file's value


def test_a_list_float_flag_refuses_a_non_finite_element():
    with pytest.raises(UsageError, match=r"--matmul-proportion \[0.2, nan\]: not a finite number"):
        parse_args(["--dataset", "generated", "--matmul-proportion", "0.2", "nan"])
