"""Drop URLs by domain and file extension before download: the seed's Megatron blacklist step.

    python data/blacklist_urls.py <folder or file of URL lists> clean_urls.txt

Reads every file in the folder (one URL per line), writes the URLs that pass, deduplicated, in
first-seen order (atomically), and prints what each rule removed. Rules, as the seed's tool:
a blacklisted domain label (video, image, social, shopping and file hosts), a blacklisted file
extension (images, video, audio, archives, documents, executables), shorter than 8 characters, or
not http(s).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

# Run as `python data/blacklist_urls.py` from a plain checkout (no pip install needed).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpt2forge.core.atomic import write_atomic  # noqa: E402
from gpt2forge.core.errors import UsageError, cli_main  # noqa: E402

DOMAINS = frozenset("""
500px aapks akamaihd amazon apple artifactfire artstation awwni bandcamp battleforthenet coinscalendar
dailymotion deviantart discord discordapp dlapkandroid dropbox e621 ebay edealinfo erome eroshare
explosm facebook fbcdn flickr furaffinity futhead gatopardo gfycat gifsound gifsoup giphy github
google gunprime gyazo hotdealstar imagefap imageshack imgflip imgur instagram karmadecay kryptocal
kym-cdn liveleak livememe lmgtfy magaimg memegenerator minorplanetcenter minus mobafire morejpeg
nocookie pcpartpicker photobucket pinimg pinterest pixiv pornhub prntscr puu qkme quickmeme radd
redd reddit reddit-stream redditlog redditmedia reddituploads redtube reupp reverb roanoke rollingstone
sli slimgur soundcloud soundgasm spankbang spotify strawpoll streamable timeanddate tinypic touhouradio
tumblr twimg twitch twitter vid vimeo vine vkaao vocaroo voyagefusion walmart wciu wikimedia wikipedia
xhamster xkcd xvideos youtu youtube youtubedoubler ytimg zillexplorer
""".split())
EXTENSIONS = frozenset("""
.3gp .7z .ai .aif .apk .app .avi .bin .bmp .bz2 .css .csv .dat .deb .dmg .doc .docx .exe .gif .gifv .gz
.iso .jar .jpeg .jpg .js .log .mid .midi .mkv .mov .mp3 .mp4 .mpeg .mpg .ogg .ogv .otf .pdf .pkg .png .pps
.ppt .pptx .psd .py .qt .ram .rar .sql .svg .swf .tar .tar.gz .tgz .tiff .ttf .txt .wav .webm .wma .wmv .xls
.xlsx .xml .xz .zip
""".split())


def rule(url: str) -> str:
    """The rule that removes `url`, or "" to keep it."""
    if len(url) < 8:
        return "too_short"
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "not_http"
    if any(label in DOMAINS for label in parts.hostname.split(".")[:-1]):
        return "domain"
    path = parts.path.lower()
    if any(path.endswith(ext) for ext in EXTENSIONS):
        return "extension"
    return ""


def url_files(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise UsageError(f"{source}: not found; pass a folder of URL lists or one URL list file")
    files = sorted(p for p in source.rglob("*") if p.is_file())
    if not files:
        raise UsageError(f"{source}: the folder holds no files; expected text files with one URL per line")
    return files


@cli_main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Filter URL lists by domain and extension rules (seed's blacklist_urls).")
    p.add_argument("input", help="a folder of URL list files (one URL per line), or one such file")
    p.add_argument("output", help="the URLs that pass, one per line (written atomically)")
    p.add_argument("--overwrite", action="store_true", help="redo the work even when the output exists")
    args = p.parse_args(argv)
    if Path(args.output).exists() and not args.overwrite:
        print(f"{args.output} exists (written atomically, so complete); skipping (pass --overwrite to redo)")
        return 0
    kept, removed = {}, Counter()
    for path in url_files(Path(args.input)):
        with open(path, "rb") as f:
            for n, raw in enumerate(f, start=1):
                try:
                    url = raw.decode("utf-8").strip()
                except UnicodeDecodeError as exc:
                    raise UsageError(f"{path}:{n}: invalid UTF-8 at byte {exc.start}; fix or remove the line") from None
                if not url:
                    continue
                why = rule(url) or ("duplicate" if url in kept else "")
                if why:
                    removed[why] += 1
                else:
                    kept[url] = None
    write_atomic(args.output, "".join(u + "\n" for u in kept))
    rules = ", ".join(f"{r} {c}" for r, c in sorted(removed.items())) or "none"
    print(f"{args.output}: kept {len(kept)} of {len(kept) + sum(removed.values())} URLs; removed: {rules}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
