"""--dataset hf: the blocks equal transformers' run_clm_no_trainer's (its tokenizer, datasets.map batching
and num_proc sharding, percent-split validation); the block cache is reused and rebuilt on demand; the
flags reach the reader; every bad input is one line."""

import os

os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"  # before datasets is imported: no network

import csv  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import uuid  # noqa: E402
from itertools import chain  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

datasets = pytest.importorskip("datasets", reason="--dataset hf reads through the Hugging Face datasets package")
transformers = pytest.importorskip("transformers", reason="the oracle is transformers' GPT-2 tokenizer and model")

from gpt2forge.core.errors import UsageError  # noqa: E402
from gpt2forge.core.labels import IGNORE_INDEX  # noqa: E402
from gpt2forge.data import DataRequest, collate, load_datasets, split_batch  # noqa: E402
from gpt2forge.data.args import DataArgs  # noqa: E402
from gpt2forge.frontends.graphcore import parse_args  # noqa: E402
from gpt2forge.text.vocab import asset_dir  # noqa: E402

VOCAB = 50257
BLOCK = 16
WORDS = "the cat sat on a mat , and dog ran far away ; hello world Ünïcödé café 数字 🙂 <|endoftext|>".split()


@pytest.fixture(autouse=True)
def _datasets_cache(tmp_path, monkeypatch):
    """datasets' own cache (the arrow copies of text files) in the test's folder, not the home directory."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


@pytest.fixture(scope="module")
def hf_tokenizer():
    folder = asset_dir()
    return transformers.GPT2TokenizerFast(str(folder / "vocab.json"), str(folder / "merges.txt"))


def lines(n: int, seed: int = 0) -> list[str]:
    """``n`` texts of 0 to 14 words (some empty), a few spanning lines of their own."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(0, 14))) + ("\n  indented" if rng.random() < 0.05 else "")
            for _ in range(n)]


def run_clm_blocks(raw, tokenizer, column: str = "text", num_proc: int | None = None) -> list[list[int]]:
    """run_clm_no_trainer's preprocessing of a split: tokenize with datasets.map(batched=True), then
    group_texts (concatenate a batch, keep whole blocks) with another map, both on ``num_proc`` processes."""
    def tokenize_function(examples):
        return tokenizer(examples[column])

    def group_texts(examples):
        concatenated = {k: list(chain(*examples[k])) for k in examples}
        total_length = len(concatenated[list(examples.keys())[0]]) // BLOCK * BLOCK
        return {k: [t[i: i + BLOCK] for i in range(0, total_length, BLOCK)] for k, t in concatenated.items()}

    # Fresh fingerprints: datasets would otherwise reuse the shards of an earlier call with another num_proc.
    tokenized = raw.map(tokenize_function, batched=True, num_proc=num_proc, remove_columns=raw.column_names,
                        load_from_cache_file=False, new_fingerprint=uuid.uuid4().hex)
    return list(tokenized.map(group_texts, batched=True, num_proc=num_proc, load_from_cache_file=False,
                              new_fingerprint=uuid.uuid4().hex)["input_ids"])


def request(inputs, **fields) -> DataRequest:
    """An hf request at --max-len BLOCK; `fields` are DataArgs fields."""
    paths = [str(inputs)] if isinstance(inputs, (str, Path)) else list(map(str, inputs))
    return DataRequest(DataArgs(dataset="hf", input_files=paths, seed=0, **fields), max_len=BLOCK, vocab_size=VOCAB)


def blocks_of(dataset) -> list[list[int]]:
    """The blocks of a reader's dataset; every item is the block then one IGNORE_INDEX."""
    items = torch.stack([dataset[i] for i in range(len(dataset))])  # (N, BLOCK + 1)
    assert items.dtype == torch.int64 and items.shape[1] == BLOCK + 1
    assert (items[:, -1] == IGNORE_INDEX).all()
    return items[:, :-1].tolist()


def one_line_error(req: DataRequest, *needles: str) -> str:
    with pytest.raises(UsageError) as exc:
        load_datasets(req)
    message = str(exc.value)
    assert "\n" not in message and all(n in message for n in needles), message
    return message


@pytest.mark.parametrize("keep", [True, False])
def test_text_files_give_run_clm_blocks_and_percent_split(tmp_path, hf_tokenizer, keep):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines(2300)) + "\n\n\nlast line without newline")  # blank lines are records too
    split = load_datasets(request(path, keep_linebreaks=keep, validation_split_percentage=5))
    options = {"data_files": {"train": [str(path)]}, "keep_linebreaks": keep}
    train = datasets.load_dataset("text", split="train[5%:]", **options)  # run_clm's own split
    val = datasets.load_dataset("text", split="train[:5%]", **options)
    expected = run_clm_blocks(train, hf_tokenizer)
    assert blocks_of(split.train) == expected
    assert blocks_of(split.val) == run_clm_blocks(val, hf_tokenizer)
    # The remainder is dropped per batch of 1000 records: grouping all tokens at once gives more blocks.
    tokens = sum(len(ids) for ids in hf_tokenizer(list(train["text"]))["input_ids"])
    assert len(expected) < tokens // BLOCK
    if keep:
        assert hf_tokenizer.eos_token_id in chain(*expected)  # "<|endoftext|>" in the text is that token


def test_jsonl_first_column_and_json_key(tmp_path, hf_tokenizer):
    texts = lines(1200, seed=1)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"body": t, "id": i, "title": t[:5]}) + "\n" for i, t in enumerate(texts)))
    split = load_datasets(request(path, validation_split_percentage=0))  # no "text" column: the first one
    raw = datasets.load_dataset("json", data_files={"train": [str(path)]})["train"]
    assert split.val is None
    assert blocks_of(split.train) == run_clm_blocks(raw, hf_tokenizer, column="body")
    titles = load_datasets(request(path, validation_split_percentage=0, json_key="title"))
    assert blocks_of(titles.train) == run_clm_blocks(raw, hf_tokenizer, column="title")
    one_line_error(request(path, json_key="missing"), "no column 'missing'", "body, id, title", "--json-key")
    one_line_error(request(path, json_key="id"), "column 'id' holds", "not text", "--json-key")


def test_csv_with_validation_files(tmp_path, hf_tokenizer):
    def write(path: Path, texts: list[str]) -> Path:
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["content", "label"])
            writer.writerows([t or "-", i % 3] for i, t in enumerate(texts))  # an empty cell would be None
        return path

    train, valid = write(tmp_path / "train.csv", lines(1100, 2)), write(tmp_path / "valid.csv", lines(300, 3))
    split = load_datasets(request(train, valid_data_path=[str(valid)]))
    raw = datasets.load_dataset("csv", data_files={"train": [str(train)], "validation": [str(valid)]})
    assert blocks_of(split.train) == run_clm_blocks(raw["train"], hf_tokenizer, column="content")
    assert blocks_of(split.val) == run_clm_blocks(raw["validation"], hf_tokenizer, column="content")


@pytest.mark.parametrize("with_validation", [True, False])
def test_saved_dataset_dict(tmp_path, hf_tokenizer, capsys, with_validation):
    splits = {"train": datasets.Dataset.from_dict({"text": lines(1500, 4), "n": list(range(1500))})}
    if with_validation:
        splits["validation"] = datasets.Dataset.from_dict({"text": lines(200, 5), "n": list(range(200))})
    folder = tmp_path / "saved"
    datasets.DatasetDict(splits).save_to_disk(str(folder))
    split = load_datasets(request(folder, validation_split_percentage=10))
    if with_validation:
        raw = {name: datasets.load_dataset(str(folder), split=name) for name in ("train", "validation")}
    else:  # run_clm with --dataset_name DIR: the percent slices of its train split
        raw = {"train": datasets.load_dataset(str(folder), split="train[10%:]"),
               "validation": datasets.load_dataset(str(folder), split="train[:10%]")}
        assert len(raw["validation"]) == 150
    assert blocks_of(split.train) == run_clm_blocks(raw["train"], hf_tokenizer)
    assert blocks_of(split.val) == run_clm_blocks(raw["validation"], hf_tokenizer)
    assert (tmp_path / ".gpt2forge_cache").is_dir()  # beside the dataset folder
    assert "built the cache" in capsys.readouterr().out
    load_datasets(request(folder, validation_split_percentage=10))  # keyed by the splits' fingerprints
    assert "reused the cache" in capsys.readouterr().out


def test_dataset_folder_of_data_files(tmp_path, hf_tokenizer, capsys):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name, n in (("train", 1300), ("validation", 150)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in lines(n, n)))
    split = load_datasets(request(folder))  # run_clm --dataset_name DIR: datasets finds the splits by file name
    raw = datasets.load_dataset(str(folder))
    assert blocks_of(split.train) == run_clm_blocks(raw["train"], hf_tokenizer)
    assert blocks_of(split.val) == run_clm_blocks(raw["validation"], hf_tokenizer)
    load_datasets(request(folder))
    assert "reused the cache" in capsys.readouterr().out


def test_workers_shard_the_records_as_datasets_num_proc(tmp_path, hf_tokenizer):
    folder = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": lines(2400, 6)}).save_to_disk(str(folder))  # a plain Dataset: train
    raw = datasets.load_from_disk(str(folder))
    two = load_datasets(request(folder, validation_split_percentage=0, preprocessing_workers=2))
    one = load_datasets(request(folder, validation_split_percentage=0))
    assert blocks_of(two.train) == run_clm_blocks(raw, hf_tokenizer, num_proc=2)
    assert blocks_of(one.train) == run_clm_blocks(raw, hf_tokenizer)
    # Two shards of 1200 records are batches 1000 + 200 each, one process 1000 + 1000 + 400: other remainders.
    assert blocks_of(two.train) != blocks_of(one.train)


def test_cache_is_reused_then_rebuilt_on_request_or_change(tmp_path, capsys):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines(300, 7)))
    first = blocks_of(load_datasets(request(path)).train)
    assert "built the cache" in capsys.readouterr().out
    (npy,) = (tmp_path / ".gpt2forge_cache").glob("*.train.npy")
    stamp = npy.stat().st_mtime_ns
    again = load_datasets(request(path))
    out = capsys.readouterr().out
    records = len(datasets.load_dataset("text", data_files=[str(path)], split="train[5%:]"))
    assert "reused the cache" in out and f"train {records} records" in out and blocks_of(again.train) == first
    assert npy.stat().st_mtime_ns == stamp  # not re-tokenized
    assert blocks_of(load_datasets(request(path, overwrite_cache=True)).train) == first
    assert "built the cache" in capsys.readouterr().out and npy.stat().st_mtime_ns != stamp
    path.write_text(path.read_text() + "\none more line of text to change the content")
    load_datasets(request(path))
    assert "built the cache" in capsys.readouterr().out


def test_items_give_the_loss_of_gpt2_with_labels_equal_to_inputs(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines(200, 8)))
    batch = collate([load_datasets(request(path)).train[i] for i in range(3)])  # (3, BLOCK + 1)
    input_ids, labels = split_batch(batch)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, n_positions=BLOCK))
    model.eval()
    logits = model(input_ids).logits
    ours = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    theirs = model(input_ids, labels=input_ids).loss
    torch.testing.assert_close(ours, theirs)
    assert (labels != IGNORE_INDEX).sum() == 3 * (BLOCK - 1)


def test_flags_reach_the_request():
    cfg = parse_args(["--dataset", "hf", "--input-files", "a.txt", "--valid-data-path", "b.txt", "--max-len", "64",
                      "--dataset-config-name", "wikitext-2-raw-v1", "--validation-split-percentage", "10",
                      "--keep-linebreaks", "False", "--preprocessing-workers", "2", "--overwrite-cache"])
    req = DataRequest(cfg.data, cfg.arch.max_len, VOCAB).data
    assert (req.dataset, req.input_files, req.valid_data_path) == ("hf", ["a.txt"], ["b.txt"])
    assert (req.dataset_config_name, req.validation_split_percentage) == ("wikitext-2-raw-v1", 10)
    assert req.keep_linebreaks is False
    assert (req.preprocessing_workers, req.overwrite_cache) == (2, True)
    defaults = DataRequest(parse_args(["--dataset", "hf", "--input-files", "a.txt"]).data, 64, VOCAB).data
    assert (defaults.dataset_config_name, defaults.validation_split_percentage, defaults.keep_linebreaks,
            defaults.preprocessing_workers, defaults.overwrite_cache) == (None, 5, True, None, False)
    for argv, needle in [(["--dataset", "hf"], "--dataset hf needs --input-files"),
                         (["--dataset", "hf", "--input-files", "a", "--validation-split-percentage", "100"],
                          "--validation-split-percentage must be in [0, 100)"),
                         (["--dataset", "hf", "--input-files", "a", "--preprocessing-workers", "0"],
                          "--preprocessing-workers must be >= 1"),
                         (["--dataset", "jsonl", "--input-files", "a", "--train-data-path", "b"],
                          "--train-data-path needs --dataset mmap"),
                         (["--dataset", "hf", "--input-files", "a", "--test-data-path", "b"],
                          "--test-data-path go with mmap, jsonl and text")]:
        with pytest.raises(UsageError, match=re.escape(needle)):
            parse_args(argv)


def test_missing_dataset_name_is_one_line_saying_how_to_provide_it():
    message = one_line_error(request("someone/not-here", dataset_config_name="small"), "someone/not-here",
                             "not in the local datasets cache", "save_to_disk", "'someone/not-here', 'small'")
    assert "Traceback" not in message


def test_bad_inputs_are_one_line(tmp_path):
    empty, corrupt = tmp_path / "empty", tmp_path / "corrupt"
    empty.mkdir()
    corrupt.mkdir()
    (corrupt / "dataset_dict.json").write_text("{not json")
    one_line_error(request(empty), str(empty), "could not load")
    one_line_error(request(corrupt), str(corrupt), "could not load")
    text, table, notes = tmp_path / "a.txt", tmp_path / "b.csv", tmp_path / "c.md"
    for p in (text, table, notes):
        p.write_text("content\nmore\n")
    one_line_error(request(tmp_path / "missing.txt"), "missing.txt", "no such file")
    one_line_error(request([text, table]), "mixed kinds", "all .txt")
    one_line_error(request(notes), str(notes), "not '.md'")
    one_line_error(request(text, valid_data_path=[str(table)]), "mixed kinds")
    one_line_error(request(corrupt, valid_data_path=[str(text)]), "--valid-data-path goes with --input-files files")
    one_line_error(request(text, validation_split_percentage=0), "no block of --max-len 16", "smaller --max-len")
