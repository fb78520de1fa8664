#!/usr/bin/env bash
# Renders a triage report through real GFM renderers and checks that what a reader needs is there.
#
# 1. `mla-diff run --layer 1 --inject phantom-output --report DIR/r.md` (must exit 1);
# 2. the report's first line names phantom-output at attn_out;
# 3. cmark-gfm (with the table extension) and pandoc -f gfm render it to HTML, and each HTML has
#    the verdict, a per-site <table>, the <details> blocks and the <img> of the heat map;
# 4. the heat map is a valid SVG that rsvg-convert rasterizes;
# 5. with --screenshot, headless Chromium renders the cmark-gfm page to DIR/report.png.
#
# Needs: cmark-gfm, pandoc, librsvg2-bin (rsvg-convert); chromium for --screenshot
# (Debian: apt-get install cmark-gfm pandoc librsvg2-bin chromium).
# Usage: scripts/ci/check_report_render.sh [--screenshot] [OUTDIR]   (binary: target/release/mla-diff)
# Exit: 0 rendered and checked, 1 a check failed, 2 a tool is missing (the message says which and
# the apt-get line that installs it).
set -euo pipefail
cd "$(dirname "$0")/../.."
SHOT=0
if [[ "${1:-}" == "--screenshot" ]]; then SHOT=1; shift; fi
need=(cmark-gfm pandoc rsvg-convert)
pkgs="cmark-gfm pandoc librsvg2-bin"
if [[ $SHOT == 1 ]]; then need+=(chromium); pkgs+=" chromium"; fi
missing=()
for tool in "${need[@]}"; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if (( ${#missing[@]} )); then
  echo "check_report_render: missing ${missing[*]}: install with apt-get install $pkgs" >&2
  exit 2
fi
OUT=${1:-$(mktemp -d)}
mkdir -p "$OUT"
BIN=${MLA_DIFF_BIN:-target/release/mla-diff}
[[ -x $BIN ]] || cargo build --release --quiet
fail() { echo "check_report_render: FAIL: $*" >&2; exit 1; }

set +e
"$BIN" run --layer 1 --inject phantom-output --report "$OUT/r.md" --force --quiet --backend cpu >/dev/null 2>&1
rc=$?
set -e
[[ $rc == 1 ]] || fail "run exited $rc, expected 1"
head -1 "$OUT/r.md" | grep -q "phantom-output at L1.attn_out" || fail "first line does not name phantom-output at L1.attn_out"
sed -n 3p "$OUT/r.md" | grep -q "Finding \*\*phantom-output\*\* at \`L1.attn_out\`" || fail "verdict paragraph lacks the finding"

cmark-gfm --extension table --unsafe "$OUT/r.md" > "$OUT/r.cmark.html"
pandoc -f gfm -t html --standalone --metadata title="mla-diff triage" "$OUT/r.md" -o "$OUT/r.pandoc.html"
for h in "$OUT/r.cmark.html" "$OUT/r.pandoc.html"; do
  grep -q "<strong>phantom-output</strong>" "$h" || fail "$h: no verdict"
  grep -q "<table" "$h" || fail "$h: no table"
  [[ $(grep -c "<td><code>L1.attn_out</code></td>" "$h") -ge 4 ]] || fail "$h: per-site tables lack L1.attn_out rows"
  [[ $(grep -c "<details>" "$h") -eq 4 ]] || fail "$h: expected 4 <details> blocks"
  grep -q '<img src="r.svg"' "$h" || fail "$h: no heat map image"
done

head -c 200 "$OUT/r.svg" | grep -q "<svg" || fail "r.svg is not SVG"
rsvg-convert "$OUT/r.svg" -o "$OUT/r.png" || fail "rsvg-convert cannot rasterize r.svg"
[[ $(stat -c %s "$OUT/r.png") -gt 5000 ]] || fail "rasterized heat map is suspiciously small"

if [[ $SHOT == 1 ]]; then
  {
    echo '<!doctype html><meta charset="utf-8"><style>body{font-family:sans-serif;max-width:1300px;margin:20px}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 6px;font-size:12px}</style>'
    cat "$OUT/r.cmark.html"
  } > "$OUT/page.html"
  # Open the first <details> so the screenshot shows a per-site table.
  sed -i '0,/<details>/s//<details open>/' "$OUT/page.html"
  chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --window-size=1400,2600 \
    --screenshot="$OUT/report.png" "file://$(realpath "$OUT/page.html")" >/dev/null 2>&1 \
    || fail "chromium screenshot failed"
  [[ -s "$OUT/report.png" ]] || fail "no screenshot"
  echo "screenshot: $OUT/report.png"
fi
echo "check_report_render: OK ($OUT/r.md rendered by cmark-gfm and pandoc; heat map $OUT/r.svg)"
