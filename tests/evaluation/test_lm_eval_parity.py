"""Our `--lambada-target lm-eval` and `--protocol lm-eval` against lm-evaluation-harness itself.

lm-eval (pinned 0.4.13) runs offline on local-file copies of its own `lambada_openai` and `wikitext`
tasks (the YAML fields and its `preprocess_wikitext.py` are taken from the installed package, only
the dataset is pointed at a local file), through its `hf` model on a checkpoint we saved. Skipped
with the reason when lm-eval is not installed.
"""

import json
import math
import shutil
from pathlib import Path

import pytest
import yaml

from gpt2forge.evaluation.cli import lambada_main, wiki_main
from gpt2forge.evaluation.protocol import lm_eval_pages, lm_eval_words

PASSAGES = [
    "The keeper climbed the stairs of the lighthouse every night. When the storm came he lit the lamp for the boats",
    "She folded the letter twice and hid it in the drawer. Nobody would ever read it, she thought, not even\nThomas",
    "They walked along the river until the path ended at an old stone bridge. On the other side waited\n\nbrother",
    "The children counted the coins on the kitchen table: forty, fifty, sixty. It was enough for the bicycle",
]
"""Passages whose last word follows a space or a newline (where Megatron's and lm-eval's targets differ)."""

WIKI = (" = Robert Boulter = \n \n Robert Boulter is an English film , television and theatre actor . He had a "
        "guest @-@ starring role on the television series The Bill in 2000 . \n \n = = Career = = \n \n In 2006 , "
        "Boulter starred in 1 @,@ 000 performances ( 3 @.@ 5 % ) . \n \n = Du Fu = \n \n Du Fu was a prominent "
        "Chinese poet of the Tang dynasty . Along with Li Bai , he is frequently called the greatest of the "
        "Chinese poets . \n \n")


def local_tasks(root: Path, lambada_file: Path, pages_file: Path) -> Path:
    """Copies of lm-eval's lambada_openai and wikitext task definitions reading local JSON files."""
    import lm_eval

    tasks = Path(lm_eval.__file__).parent / "tasks"
    out = root / "tasks"
    out.mkdir()
    lamb = yaml.safe_load((tasks / "lambada" / "lambada_openai.yaml").read_text())
    lamb.update(task="lambada_local", dataset_path="json", dataset_kwargs={"data_files": {"test": str(lambada_file)}})
    lamb.pop("dataset_name", None)
    lamb.pop("tag", None)
    (out / "lambada_local.yaml").write_text(yaml.safe_dump(lamb))
    shutil.copy(tasks / "wikitext" / "preprocess_wikitext.py", out / "preprocess_wikitext.py")
    wiki = (tasks / "wikitext" / "wikitext.yaml").read_text()  # keeps its `!function` tags
    wiki = wiki.replace("task: wikitext", "task: wikitext_local")
    wiki = wiki.replace("dataset_path: EleutherAI/wikitext_document_level",
                        f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {pages_file}")
    wiki = "\n".join(ln for ln in wiki.splitlines()
                     if not ln.startswith(("dataset_name:", "training_split:", "validation_split:")))
    (out / "wikitext_local.yaml").write_text(wiki + "\n")
    return out


def run_lm_eval(ckpt: Path, task_dir: Path, monkeypatch) -> dict:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model="hf", model_args=f"pretrained={ckpt},dtype=float32", device="cpu", batch_size=4,
                           tasks=["lambada_local", "wikitext_local"], log_samples=True,
                           task_manager=TaskManager(include_path=str(task_dir)))


@pytest.mark.slow
def test_lambada_and_wikitext_equal_lm_eval(tmp_path, monkeypatch, eval_data_or_none):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install lm-eval==0.4.13)")
    from test_evaluation import tiny_checkpoint

    ckpt = tiny_checkpoint(tmp_path / "ck", vocab_size=50257, n_positions=64)
    passages = list(PASSAGES)
    wiki_text = WIKI
    if eval_data_or_none is not None:  # the real passages whose last word follows a newline, and 2 pages
        real = (eval_data_or_none / "lambada" / "lambada_test.jsonl").read_text(encoding="utf-8").splitlines()
        passages += [json.loads(real[i])["text"] for i in (426, 1053)]  # 0-based line numbers
        raw = (eval_data_or_none / "wikitext" / "wiki.test.raw").read_text(encoding="utf-8")
        wiki_text = "\n".join(lm_eval_pages(raw)[:2])
    lambada_file, pages_file, wiki_file = tmp_path / "lambada.jsonl", tmp_path / "pages.jsonl", tmp_path / "w.raw"
    lambada_file.write_text("".join(json.dumps({"text": t}) + "\n" for t in passages))
    wiki_file.write_text(wiki_text)
    pages = lm_eval_pages(wiki_text)
    pages_file.write_text("".join(json.dumps({"page": p}) + "\n" for p in pages))

    out = run_lm_eval(ckpt, local_tasks(tmp_path, lambada_file, pages_file), monkeypatch)
    theirs = sorted(out["samples"]["lambada_local"], key=lambda s: s["doc_id"])
    their_ll = [s["resps"][0][0][0] for s in theirs]
    their_greedy = [bool(s["resps"][0][0][1]) for s in theirs]

    ours_json = tmp_path / "l.json"
    assert lambada_main(["--checkpoint-input-dir", str(ckpt), "--valid-data", str(lambada_file), "--lambada-target",
                         "lm-eval", "--output-json", str(ours_json), "--no-progress", "--device", "cpu"]) == 0
    ours = json.loads(ours_json.read_text())["result"]
    assert ours["correct"] == sum(their_greedy)
    assert ours["loss_sum"] == pytest.approx(-sum(their_ll), rel=1e-4)
    assert ours["ppl"] == pytest.approx(out["results"]["lambada_local"]["perplexity,none"], rel=1e-4)

    from gpt2forge.evaluation.protocol import build_cloze_examples  # per passage: the same target ids scored
    from gpt2forge.text.tokenizer import load_tokenizer

    per = build_cloze_examples(passages, load_tokenizer().encode, True, 64, "lm-eval")
    megatron = build_cloze_examples(passages, load_tokenizer().encode, True, 64, "megatron")
    differ = [i for i, (a, b) in enumerate(zip(per, megatron)) if a.target != b.target]
    assert differ == [1, 2] + ([4, 5] if eval_data_or_none is not None else [])  # last word after a newline

    wiki_json = tmp_path / "w.json"
    assert wiki_main(["--checkpoint-input-dir", str(ckpt), "--valid-data", str(wiki_file), "--protocol", "lm-eval",
                      "--output-json", str(wiki_json), "--no-progress", "--device", "cpu"]) == 0
    ours_w = json.loads(wiki_json.read_text())["result"]
    theirs_w = out["results"]["wikitext_local"]
    assert ours_w["words"] == sum(lm_eval_words(p) for p in pages)
    for key in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert ours_w[key] == pytest.approx(theirs_w[f"{key},none"], rel=1e-4), key
    assert math.isfinite(ours_w["word_perplexity"])


def test_real_wikitext_pages_match_lm_eval_counts(eval_data):
    pages = lm_eval_pages((eval_data / "wikitext" / "wiki.test.raw").read_text(encoding="utf-8"))
    # lm-eval 0.4.13's wikitext task on this file: 62 documents, 241,335 words, 1,290,527 bytes.
    assert (len(pages), sum(map(lm_eval_words, pages)), sum(len(p.encode()) for p in pages)) == (62, 241_335, 1_290_527)
