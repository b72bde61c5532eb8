"""The GPT-2 BPE vocabulary: fetched once at setup time, verified by sha256, never at run time.

Source: OpenAI's `gpt2.tiktoken` rank file (50256 mergeable byte strings; `<|endoftext|>` = 50256 is
added by the tokenizer), shipped inside the PyPI sdist of `openai-whisper==20250625`. PyPI is the
only network this project may reach, so the sdist is fetched with `pip download` (never installed)
and only that one member is read from it. From the ranks we derive the Hugging Face pair
`vocab.json` + `merges.txt`, so HF users get the files they expect; the derivation is checked by
encoding a sample text with both `tokenizers` and tiktoken. The two encoders over these files are
built here (`gpt2_encoding`, `byte_level_bpe`); `gpt2forge.text.tokenizer` wraps them.

Files live in `asset_dir()`: `$GPT2FORGE_ASSETS` if set, else `gpt2forge/assets/` (git-ignored).

    python -m gpt2forge.text.vocab           # fetch + derive if needed (idempotent)
    python -m gpt2forge.text.vocab --check   # verify only
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import tiktoken
from tiktoken.load import load_tiktoken_bpe

from gpt2forge.core.atomic import write_atomic
from gpt2forge.core.digest import file_sha256
from gpt2forge.core.errors import UsageError, cli_main

PACKAGE = "openai-whisper==20250625"
SDIST_MEMBER = "openai_whisper-20250625/whisper/assets/gpt2.tiktoken"
TIKTOKEN_FILE = "gpt2.tiktoken"
TIKTOKEN_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
VOCAB_FILE = "vocab.json"
MERGES_FILE = "merges.txt"
# The derivation below is deterministic, so its outputs are pinned too: a changed derivation
# (or a hand-edited file) is caught by `--check`, not by a silent change in token ids.
DERIVED_SHA256 = {
    VOCAB_FILE: "03087853bc70c618b66e7c7a43e787d2db4c469416beac9a483e53dad1f72f27",
    MERGES_FILE: "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
}
EOT_TOKEN = "<|endoftext|>"
EOT_ID = 50256
# OpenAI's original GPT-2 pre-tokenizer regex (gpt-2/src/encoder.py), the same one Hugging Face's
# ByteLevel pre-tokenizer uses, so ids match `GPT2TokenizerFast` exactly.
GPT2_PAT_STR = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Exercises the regex split (contractions, letters, numbers, punctuation runs, whitespace runs,
# trailing spaces), multi-byte UTF-8, and `<|endoftext|>` as plain text (never the special id).
PARITY_SAMPLE = (
    "Hello world! It's 2024; we'll test 12345 numbers & symbols: @#$%^*().\n\n"
    "  Leading spaces,\ttabs\t\tand   runs of   spaces   \n"
    "Unicode: naïve café, Ωμέγα, Привет мир, 日本語のテキスト, emoji 🤖🚀, combining é.\n"
    "<|endoftext|>Text after the end-of-text marker<|endoftext|>\n"
    "I'M SHOUTING, they've gone, she'd say. Trailing whitespace   "
)


def asset_dir() -> Path:
    """Folder holding the vocabulary files: `$GPT2FORGE_ASSETS`, else `gpt2forge/assets/`."""
    env = os.environ.get("GPT2FORGE_ASSETS")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "assets"


def verify(path: Path) -> bool:
    """True if `path` exists and is byte-identical to the pinned `gpt2.tiktoken` (by sha256)."""
    path = Path(path)
    return path.is_file() and file_sha256(path) == TIKTOKEN_SHA256


def fetch_tiktoken_file(dest: Path) -> None:
    """Download the `openai-whisper` sdist from PyPI with pip, copy `gpt2.tiktoken` out of it to
    `dest` after checking its sha256. Raises UsageError if pip fails or the hash differs."""
    with tempfile.TemporaryDirectory(prefix="gpt2forge-vocab-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "--quiet", PACKAGE, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [ln.strip() for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
            detail = lines[-1] if lines else f"exit code {proc.returncode}"
            raise UsageError(
                f"`pip download {PACKAGE}` failed ({detail}); check access to the package registry "
                f"(PyPI), or set GPT2FORGE_ASSETS to a folder holding {TIKTOKEN_FILE}")
        sdists = sorted(Path(tmp).glob("*.tar.gz"))
        if len(sdists) != 1:
            raise UsageError(f"`pip download {PACKAGE}` gave {[p.name for p in Path(tmp).iterdir()]}, "
                             f"expected one .tar.gz sdist; set GPT2FORGE_ASSETS to a folder "
                             f"holding {TIKTOKEN_FILE}")
        # Read the one member as bytes: nothing from the archive is extracted to disk.
        with tarfile.open(sdists[0], "r:gz") as tar:
            member = tar.extractfile(SDIST_MEMBER)
            if member is None:
                raise UsageError(f"{SDIST_MEMBER} is not a regular file in {sdists[0].name}")
            data = member.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != TIKTOKEN_SHA256:
        raise UsageError(f"{SDIST_MEMBER} from {PACKAGE} has sha256 {digest}, expected "
                         f"{TIKTOKEN_SHA256}; refusing to use it")
    write_atomic(dest, data)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (as in OpenAI's encoder.py and HF ByteLevel):
    printable Latin-1 bytes map to themselves, the other 68 bytes to chr(256 + n) in byte order."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


def _bpe_split(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """Merge `token`'s bytes greedily by rank, using only merges ranked below `max_rank`.

    For a token of rank r this stops at the two parts whose merge created it, which recovers
    the merge list from a rank file (as tiktoken's docs and transformers' TikTokenConverter do).
    """
    parts = [bytes([b]) for b in token]
    while len(parts) > 1:
        best_i, best_rank = -1, max_rank
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and rank < best_rank:
                best_i, best_rank = i, rank
        if best_i < 0:
            break
        parts[best_i:best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def derive_hf_files(ranks: dict[bytes, int], out_dir: Path) -> None:
    """Write `vocab.json` (token string -> id, `<|endoftext|>` = 50256) and `merges.txt`
    (`#version: 0.2` then one `left right` pair per line, in rank order) to `out_dir`."""
    byte_char = bytes_to_unicode()

    def text(token: bytes) -> str:
        return "".join(byte_char[b] for b in token)

    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    vocab = {text(tok): rank for tok, rank in by_rank}
    vocab[EOT_TOKEN] = EOT_ID
    merges = []
    for tok, rank in by_rank:
        if len(tok) < 2:
            continue
        parts = _bpe_split(ranks, tok, max_rank=rank)
        if len(parts) != 2:
            raise RuntimeError(f"rank {rank} ({tok!r}) is not a merge of two lower-ranked tokens")
        merges.append(f"{text(parts[0])} {text(parts[1])}")
    write_atomic(out_dir / VOCAB_FILE, json.dumps(vocab, ensure_ascii=False).encode("utf-8"))
    write_atomic(out_dir / MERGES_FILE, ("#version: 0.2\n" + "\n".join(merges) + "\n").encode("utf-8"))


def gpt2_encoding(path: Path) -> tiktoken.Encoding:
    """GPT-2's tiktoken Encoding from the rank file at `path` (50257 ids, `<|endoftext|>` = 50256).

    The caller checks the file first (`verify`); the expected hash also makes tiktoken discard a
    stale copy in its cache (it caches even local files, keyed by path)."""
    ranks = load_tiktoken_bpe(str(path), expected_hash=TIKTOKEN_SHA256)
    return tiktoken.Encoding(name="gpt2", pat_str=GPT2_PAT_STR, mergeable_ranks=ranks,
                             special_tokens={EOT_TOKEN: EOT_ID})


def byte_level_bpe(vocab_file: Path, merge_file: Path):
    """A `tokenizers.Tokenizer`: ByteLevel BPE from a `vocab.json` + `merges.txt` pair, no prefix
    space, no special tokens (so `<|endoftext|>` in text is plain text until the caller adds it).
    Raises what `tokenizers` raises on files that are not such a pair."""
    from tokenizers import (  # lazy: only non-GPT-2 tokenizers need it at run time
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
    )

    tok = Tokenizer(models.BPE.from_file(str(vocab_file), str(merge_file)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def check_hf_files(directory: Path) -> None:
    """Raise RuntimeError unless the HF files in `directory` match their pinned sha256 and encode
    PARITY_SAMPLE to the same ids as tiktoken on the rank file in the same folder."""
    directory = Path(directory)
    for name, expected in DERIVED_SHA256.items():
        digest = file_sha256(directory / name)
        if digest != expected:
            raise RuntimeError(f"{directory / name} has sha256 {digest}, expected {expected}")
    want = gpt2_encoding(directory / TIKTOKEN_FILE).encode_ordinary(PARITY_SAMPLE)
    got = byte_level_bpe(directory / VOCAB_FILE, directory / MERGES_FILE).encode(PARITY_SAMPLE).ids
    if got != want:
        raise RuntimeError(f"HF tokenizer from {directory} disagrees with tiktoken on the parity sample")


def _is_complete(directory: Path) -> bool:
    return verify(directory / TIKTOKEN_FILE) and all(
        (directory / name).is_file() for name in (VOCAB_FILE, MERGES_FILE))


def ensure_vocab(quiet: bool = False) -> Path:
    """Make sure `gpt2.tiktoken` (verified) and the derived HF files exist in `asset_dir()`.

    Does nothing if they are all there and the rank file's sha256 matches; re-fetches a rank
    file that is missing or fails the check. Returns the path of `gpt2.tiktoken`.
    Raises UsageError if the download fails.
    """
    directory = asset_dir()
    path = directory / TIKTOKEN_FILE
    say = (lambda msg: None) if quiet else print
    if _is_complete(directory):
        say(f"GPT-2 vocabulary already present in {directory} (sha256 ok)")
        return path
    if not verify(path):
        if path.exists():
            say(f"{path} fails its sha256 check; fetching it again")
        say(f"fetching {TIKTOKEN_FILE} from the PyPI sdist of {PACKAGE}")
        fetch_tiktoken_file(path)
    derive_hf_files(load_tiktoken_bpe(str(path), expected_hash=TIKTOKEN_SHA256), directory)
    check_hf_files(directory)
    say(f"GPT-2 vocabulary ready in {directory}: {TIKTOKEN_FILE}, {VOCAB_FILE}, {MERGES_FILE}")
    return path


def check(directory: Path) -> None:
    """Verify every vocabulary file in `directory`; raise UsageError naming the first problem."""
    fix = "run `python -m gpt2forge.text.vocab` to fetch it"
    path = directory / TIKTOKEN_FILE
    if not path.is_file():
        raise UsageError(f"GPT-2 vocabulary not found at {path}; {fix}")
    if not verify(path):
        raise UsageError(f"{path} fails its sha256 check; {fix}")
    for name in (VOCAB_FILE, MERGES_FILE):
        if not (directory / name).is_file():
            raise UsageError(f"{directory / name} is missing; {fix}")
    try:
        check_hf_files(directory)
    except RuntimeError as exc:
        raise UsageError(f"{exc}; delete {directory / VOCAB_FILE} and {fix}") from exc


@cli_main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpt2forge.text.vocab",
        description="Fetch (once, from PyPI) and verify the GPT-2 BPE vocabulary. Files go to "
                    "$GPT2FORGE_ASSETS if set, else gpt2forge/assets/.")
    parser.add_argument("--check", action="store_true",
                        help="only verify the files already present (sha256 and HF/tiktoken parity)")
    args = parser.parse_args(argv)
    if args.check:
        check(asset_dir())
        print(f"GPT-2 vocabulary in {asset_dir()} verified")
    else:
        ensure_vocab()
    return 0


if __name__ == "__main__":
    sys.exit(main())
