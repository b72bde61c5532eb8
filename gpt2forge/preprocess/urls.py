"""URL blacklist rules applied before download (the seed's Megatron blacklist_urls step).

`rule(url)` names the rule that removes a URL, or "" to keep it: shorter than 8 characters
(`too_short`), not http(s) (`not_http`), a host with a blacklisted label (`domain`: video, image,
social, shopping and file hosts) or a path ending in a blacklisted extension (`extension`: images,
video, audio, archives, documents, executables). `filter_urls` streams URL list files (one URL per
line) and keeps the URLs that pass, deduplicated (`duplicate`), in first-seen order.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from urllib.parse import urlsplit

from gpt2forge.core.errors import UsageError

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
    """`source` itself when a file, else every file under the folder, sorted."""
    if source.is_file():
        return [source]
    if not source.is_dir():
        raise UsageError(f"{source}: not found; pass a folder of URL lists or one URL list file")
    files = sorted(p for p in source.rglob("*") if p.is_file())
    if not files:
        raise UsageError(f"{source}: the folder holds no files; expected text files with one URL per line")
    return files


def filter_urls(source: Path) -> tuple[list[str], Counter]:
    """(URLs that pass, in first-seen order without duplicates; removals by rule) of `source`'s files.

    Raises UsageError naming file:line on invalid UTF-8."""
    kept: dict[str, None] = {}
    removed: Counter = Counter()
    for path in url_files(Path(source)):
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
    return list(kept), removed
