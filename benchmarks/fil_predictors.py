#!/usr/bin/env python3
"""Which CPU predictor is faster for a forest, by batch size: the framework's own or Treelite's GTIL.

    .venv/bin/python benchmarks/fil_predictors.py [--threads 1] [--seconds 0.5]

The FIL adapter's choice (``adapters/fil/forest.py``) rests on this: for the example forest
(XGBoost, 100 trees of depth 6, 16 features, binary) and a LightGBM forest of 100 trees on the same
data, microseconds per call of XGBoost's ``inplace_predict``, LightGBM's ``predict`` and Treelite's
``gtil.predict``, at 1 to 1,024 rows. Prints a markdown table. Needs the fil extra.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from rayinfer.cluster.example_backends import forest_data, lightgbm_forest, xgboost_forest

BATCHES = (1, 8, 16, 32, 64, 256, 1024)


def per_call_us(fn, seconds: float) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        calls += 1
    return (time.perf_counter() - start) / calls * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=0.5, help="per measurement")
    args = parser.parse_args()
    import treelite
    import treelite.gtil

    xgb, lgb = xgboost_forest(), lightgbm_forest()
    xgb.set_param({"nthread": args.threads})
    tl_xgb, tl_lgb = treelite.frontend.from_xgboost(xgb), treelite.frontend.from_lightgbm(lgb)
    rows = forest_data(rows=max(BATCHES), seed=3)[0]
    print(f"| rows | XGBoost inplace_predict (us) | GTIL, XGBoost forest (us) | LightGBM predict (us) | "
          f"GTIL, LightGBM forest (us) |  (threads: {args.threads})")
    print("|---|---|---|---|---|")
    for n in BATCHES:
        x = np.ascontiguousarray(rows[:n])
        cells = [per_call_us(lambda: xgb.inplace_predict(x, validate_features=False), args.seconds),
                 per_call_us(lambda: treelite.gtil.predict(tl_xgb, x, nthread=args.threads), args.seconds),
                 per_call_us(lambda: lgb.predict(x, num_threads=args.threads), args.seconds),
                 per_call_us(lambda: treelite.gtil.predict(tl_lgb, x, nthread=args.threads), args.seconds)]
        print(f"| {n} | " + " | ".join(f"{c:,.0f}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
