"""Calibrate each software stack's efficiencies on its own calibration rows and print how well the
planner predicts every published row it was not calibrated on (`shardlab.costs.calibration`,
`shardlab.costs.comparison`):

    python scripts/calibrate-planner.py            # fit, then score with the fitted values
    python scripts/calibrate-planner.py --score    # score with the values in stacks.yaml only

Write the printed values into costs/stacks.yaml by hand: a change of calibration is a reviewed edit.
"""

from __future__ import annotations

import argparse

from shardlab.costs import calibration, comparison


def table(rows: list[dict], by: str) -> str:
    lines = [f"{by:16s} held-out rows  mean |err| %  worst |err| %  bias %  calibration (mean |err| %)  "
             "informed (mean |err| %)  false does-not-fit"]
    for r in comparison.summary(rows, by):
        lines.append(f"{r[by]:16s} {r['held_out_rows']:13d} {r['held_out_mean_abs_pct']:13.1f} {r['held_out_worst_abs_pct']:14.1f} "
                     f"{r['held_out_bias_pct']:+7.1f} {r['calibration_rows']:12d} ({r['calibration_mean_abs_pct']:4.1f}) "
                     f"{r['informed_rows']:10d} ({r['informed_mean_abs_pct']:4.1f}) {r['false_does_not_fit']:19d}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--score", action="store_true", help="score the catalog's values without fitting")
    args = parser.parse_args()
    fitted: dict[str, dict] = {}
    if not args.score:
        for stack, generation in calibration.fitted_pairs():
            error, values = calibration.fit(stack, generation)
            fitted[stack] = values
            print(f"{stack} on {generation}: calibration rows' mean |error| {error:.2f} % with {values}")
    rows = comparison.results(fitted)
    print()
    print(table(rows, "source"))
    print()
    print(table(rows, "stack"))
    print()
    for r in rows:
        mark = "cal " if r["split"] == "calibration" else "    "
        print(f"{mark}{r['row']:20s} {r['model']:15s} {r['gpus']:6d} GPUs  {r['stack']:15s} published {r['published']:10.1f}  "
              f"predicted {r['predicted']:10.1f} tokens/s/GPU  {r['error_pct']:+6.1f} %  "
              f"{'fits' if r['fits'] else 'DOES NOT FIT'}  {r['plan']}")


if __name__ == "__main__":
    main()
