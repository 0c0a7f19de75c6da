#!/usr/bin/env python3
"""Screenshots of the Ray dashboard's Serve views (the pictures in docs/images/).

Needs Playwright for Python and a Chromium (neither is a rayinfer dependency), e.g.
``python3 -m venv /tmp/pw && /tmp/pw/bin/pip install playwright`` and Debian's ``chromium``.
With ``rayinfer serve --model-repository examples/model_repository --dashboard-port 8265``
running, and the cluster's token from ``ray get-auth-token``:

    /tmp/pw/bin/python docs/tools/capture_dashboard.py TOKEN [--chromium /usr/bin/chromium]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from playwright.sync_api import sync_playwright

IMAGES = Path(__file__).resolve().parent.parent / "images"
VIEWS = {"serve": "dashboard-serve.png", "serve/applications/mlp": "dashboard-model-app.png"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("token")
    parser.add_argument("--url", default="http://127.0.0.1:8265")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    args = parser.parse_args()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=args.chromium, args=["--no-sandbox", "--disable-gpu"])
        context = browser.new_context(viewport={"width": 1500, "height": 950})
        # Ray's dashboard takes its authentication token from this cookie.
        context.add_cookies([{"name": "ray-authentication-token", "value": args.token, "url": args.url}])
        page = context.new_page()
        for view, name in VIEWS.items():
            page.goto(f"{args.url}/#/{view}")
            page.wait_for_timeout(9000)  # the views poll the API before they render
            page.screenshot(path=str(IMAGES / name))
            print(IMAGES / name)
        browser.close()


if __name__ == "__main__":
    main()
