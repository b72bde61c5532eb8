#!/usr/bin/env bash
# Extract article text from a Wikipedia XML dump with WikiExtractor (PyPI `wikiextractor`,
# pinned in requirements.txt) into <out>/AA/wiki_00, ... (<doc ...> blocks, 100 MB files).
#
#   ./data/wikipedia_extract.sh <chosen-path-for-dump-file>/wikidump.xml <chosen-folder-for-extracted-files> [processes]
#
# processes defaults to all cores. Re-running with a finished <out> does nothing (delete it to redo).
# Set PYTHON to choose the interpreter (default: .venv/bin/python if present, else python3).
set -euo pipefail

if [[ $# -lt 2 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//'
    [[ $# -ge 1 && ( "$1" == "-h" || "$1" == "--help" ) ]] && exit 0 || exit 2
fi
dump="$1"
out="$2"
procs="${3:-$(nproc)}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$repo/.venv/bin/python" ]]; then PYTHON="$repo/.venv/bin/python"; else PYTHON=python3; fi
fi
[[ -f "$dump" ]] || { echo "error: dump $dump not found; run ./data/wikipedia_download.sh first" >&2; exit 2; }
if [[ -f "$out/.complete" ]]; then
    echo "$out already holds a finished extraction; nothing to do (delete it to extract again)"
    exit 0
fi
if ! "$PYTHON" -c "import wikiextractor" 2>/dev/null; then
    echo "error: WikiExtractor is not installed for $PYTHON; run: $PYTHON -m pip install wikiextractor==3.1.0" >&2
    exit 2
fi
export PYTHONIOENCODING=utf-8
export LC_ALL=C.UTF-8
# Extract into a temporary folder, then rename: an interrupted run leaves nothing that looks finished.
tmp="$out.partial"
rm -rf "$tmp"
"$PYTHON" -m wikiextractor.WikiExtractor "$dump" -o "$tmp" -b 100M --processes "$procs"
touch "$tmp/.complete"
rm -rf "$out"
mv "$tmp" "$out"
echo "wrote $out ($(find "$out" -name 'wiki_*' | wc -l) files)"
