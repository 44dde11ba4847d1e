"""The console's scripts come from npm, copied into the repository so the
service needs no CDN nor npm at run time: each copy is the package's own file,
and every asset a page links is served."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from app.http.console.web import STATIC_DIR

ROOT = Path(__file__).resolve().parents[3]
# vendored file -> (npm package, its file)
VENDORED = {"htmx-2.0.11.min.js": ("htmx.org", "dist/htmx.min.js"),
            "uPlot-1.6.32.iife.min.js": ("uplot", "dist/uPlot.iife.min.js"),
            "uPlot-1.6.32.min.css": ("uplot", "dist/uPlot.min.css")}


def test_each_vendored_file_is_the_pinned_npm_package_s_own():
    pinned = json.loads((ROOT / "package.json").read_text())["devDependencies"]
    for copy, (package, path) in VENDORED.items():
        assert pinned[package] in copy, f"{copy} is not the version package.json pins ({pinned[package]})"
        installed = ROOT / "node_modules" / package / path
        if not installed.exists():
            if os.environ.get("PARALON_REQUIRE_SERVICES"):
                raise AssertionError(f"{installed} is missing: `make dev-venv` runs npm ci")
            pytest.skip("node_modules is not installed")
        assert (STATIC_DIR / "vendor" / copy).read_bytes() == installed.read_bytes(), copy


def test_every_asset_a_page_links_is_served(signed_in):
    customer = signed_in.accounts["customer"]
    page = signed_in.get(f"/console/{customer}/overview", "customer_admin@example.com").text
    assets = re.findall(r'(?:src|href)="(/console/static/[^"]+)"', page)
    assert len(assets) >= 4
    for asset in assets:
        served = signed_in.get(asset)
        assert served.status_code == 200 and served.content, asset
        assert "max-age" in served.headers["cache-control"]
