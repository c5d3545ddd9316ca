"""Screenshots of the asset pages a newcomer opens after `make demo`, taken with headless Chromium.

Start the UIs first (`make ui`, or `python -m pipelines ui --dagster-port P --mlflow-port Q`), then:
`PYTHONPATH=$PWD .venv/bin/python scripts/screenshot_asset_pages.py --dagster http://127.0.0.1:3000 --out docs/screenshots`.
Each page is saved as a PNG; the MLflow links are followed through the Dagster UI's /mlflow redirect, so a
screenshot of an MLflow page also shows that the link resolved.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from assets.checkpoint_manifest import all_manifests

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-dev-shm-usage"]


def pages(dagster: str) -> dict[str, str]:
    """File stem → URL: the assets a newcomer opens first, at the newest checkpoint of each recipe."""
    newest = {}
    for manifest in sorted(all_manifests(), key=lambda m: m.step):
        newest[manifest.recipe] = manifest
    found = {
        "asset_graph": f"{dagster}/asset-groups",
        "rollout_batches": f"{dagster}/assets/rollout_batches",
        "rl_checkpoint": f"{dagster}/assets/rl_checkpoint",
        "sft_chat_dataset": f"{dagster}/assets/chat_dataset",
    }
    for recipe, manifest in newest.items():
        found[f"{recipe}_checkpoints_partition"] = f"{dagster}/assets/{recipe}_checkpoints?view=partitions&partition={manifest.partition}"
        found[f"{recipe}_eval_report_partition"] = f"{dagster}/assets/{recipe}_eval_report?view=partitions&partition={manifest.partition}"
    if "rl" in newest:
        found["mlflow_rl_training_run"] = f"{dagster}{newest['rl'].mlflow_run_url}" if newest["rl"].mlflow_run_url.startswith("/") else newest["rl"].mlflow_run_url
        found["mlflow_rl_registered_model"] = f"{dagster}/mlflow/#/models/rl"
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dagster", default="http://127.0.0.1:3000")
    parser.add_argument("--out", type=Path, default=Path("docs/screenshots"))
    parser.add_argument("--only", nargs="*", help="file stems to take (default: all)")
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1500, "height": 1000})
        page.goto(f"{args.dagster}/locations", timeout=120_000)  # pages show placeholders until the code location loads
        page.wait_for_load_state("networkidle", timeout=300_000)
        page.wait_for_timeout(20_000)
        for name, url in pages(args.dagster).items():
            if args.only and name not in args.only:
                continue
            page.goto(url, timeout=120_000)
            try:
                page.wait_for_load_state("networkidle", timeout=60_000)
            except Exception:  # MLflow's pages poll for ever: never idle, but drawn by now
                pass
            page.wait_for_timeout(6000)  # the asset page fills its sections after the first idle moment
            target = args.out / f"{name}.png"
            page.screenshot(path=str(target), full_page=True)
            print(f"{target}  {page.url}", flush=True)
        browser.close()


if __name__ == "__main__":
    main()
