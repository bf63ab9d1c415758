"""Where `covey ledger verify --heads` reads signed ledger heads (covey.trust.heads) from:
a JSONL file of heads or of receipts carrying one (a peer's `ledger-heads.jsonl`), a peer's
store directory holding that file, or a coordinator's URL (its GET /v1/ledger/head).

Reading is form only: which heads count as evidence (this run's, validly signed) is
`covey.trust.heads.usable`'s question. A line that is no head is named in a warning and
left out; a source that cannot be read at all is a SourceError.
"""

from __future__ import annotations

import json
from pathlib import Path

from covey.io.audit import HTTP_TIMEOUT_S, SourceError
from covey.trust.heads import HEADS_FILE, Head, HeadError, parse_head

MAX_LINES = 1_000_000  # a peer keeps one head per ledger length


def load_heads(source: str) -> tuple[list[tuple[Head, str]], list[str]]:
    """(heads, each with where it was found, and a warning for each line that is none)."""
    if source.startswith(("http://", "https://")):
        return [(_head_from_url(source.rstrip("/")), f"{source.rstrip('/')}/v1/ledger/head")], []
    path = Path(source)
    if path.is_dir():
        path = path / HEADS_FILE
    if not path.is_file():
        raise SourceError(f"--heads {source}: no such file, peer directory or URL")
    heads, warnings = [], []
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, start=1):
            if lineno > MAX_LINES:
                warnings.append(f"{path}: more than {MAX_LINES} lines; the rest are not read")
                break
            where = f"{path} line {lineno}"
            if not raw.strip():
                continue
            try:
                heads.append((parse_head(json.loads(raw)), where))
            except (HeadError, ValueError) as e:
                warnings.append(f"{where}: not a signed head ({str(e)[:120]}): ignored")
    return heads, warnings


def _head_from_url(base: str) -> Head:
    import httpx

    try:
        response = httpx.get(f"{base}/v1/ledger/head", timeout=HTTP_TIMEOUT_S)
        response.raise_for_status()
        return parse_head(response.json())
    except (httpx.HTTPError, httpx.InvalidURL) as e:
        raise SourceError(f"--heads {base}: cannot read its ledger head: {e}") from None
    except (HeadError, ValueError) as e:
        raise SourceError(f"--heads {base}: /v1/ledger/head is not a signed head: {e}") from None
