#!/usr/bin/env bash
# Download the latest English Wikipedia dump to <dir>/wikidump.xml.bz2 and decompress it to
# <dir>/wikidump.xml (about 20 GB compressed).
#
#   ./data/wikipedia_download.sh <chosen-path-for-dump-file> [language, default: en]
#
# Re-running is safe: a finished wikidump.xml is kept; a partial download resumes (wget -c).
set -euo pipefail

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'
    [[ $# -ge 1 ]] && exit 0 || exit 2
fi
dir="$1"
lang="${2:-en}"
url="https://dumps.wikimedia.org/${lang}wiki/latest/${lang}wiki-latest-pages-articles-multistream.xml.bz2"
mkdir -p "$dir"
if [[ -s "$dir/wikidump.xml" && ! -e "$dir/wikidump.xml.bz2" ]]; then
    echo "$dir/wikidump.xml already exists; nothing to do (delete it to download again)"
    exit 0
fi
command -v wget >/dev/null || { echo "error: wget not found; install it (apt-get install wget)" >&2; exit 2; }
wget -c --progress=bar:force -O "$dir/wikidump.xml.bz2" "$url"
# bunzip2 -k keeps the archive until the output is complete; a temp name keeps a partial
# wikidump.xml from looking finished.
bunzip2 -c "$dir/wikidump.xml.bz2" > "$dir/.wikidump.xml.tmp"
mv "$dir/.wikidump.xml.tmp" "$dir/wikidump.xml"
rm -f "$dir/wikidump.xml.bz2"
echo "wrote $dir/wikidump.xml ($(du -h "$dir/wikidump.xml" | cut -f1))"
