"""Calibrate the planner's GPU efficiencies (costs/hardware.yaml) and print how well they predict
points they were not fitted on (`shardlab.costs.calibration`):

    python scripts/calibrate-planner.py

- A100: fitted on Korthikanti et al. 2022's eight iteration times; each model's error when the other
  three are the calibration set (leave-one-model-out).
- H100: fitted on MosaicML's FSDP rows of the calibration models and one Llama 3 405B configuration;
  the error on the held-out rows of both.
Write the printed values into the catalog by hand: a change of calibration is a reviewed edit.
"""

from __future__ import annotations

from statistics import mean

from shardlab.costs import calibration, published


def main() -> None:
    models = [p["name"] for p in published.reference()["models"]]
    error, fitted = calibration.fit_megatron(models)
    print(f"A100, all eight times: mean {error:.2f} % with {fitted}")
    held = calibration.megatron_leave_one_out()
    for row in held:
        print(f"  left out {row['model']:5s} {row['mode']:15s} error {row['error_pct']:+6.1f} %")
    print(f"  leave-one-model-out: mean {mean(abs(r['error_pct']) for r in held):.2f} %, "
          f"worst {max(abs(r['error_pct']) for r in held):.2f} %")
    error, fitted = calibration.fit_hopper()
    print(f"H100, both sources' calibration rows: {error:.2f} % with {fitted}")
    for source, rows in calibration.HOPPER_SOURCES.items():
        for split, summary in published.summary(rows(fitted), by="split").items():
            print(f"  {source} {split}: mean {summary['mean']:.2f} %, worst {summary['worst']:.2f} % "
                  f"over {summary['n']} rows")
    for row in published.llama3_rows(fitted):
        print(f"  Llama 3 405B on {row['gpus']} GPUs, {row['seq_len']} tokens ({row['split']}): "
              f"{row['predicted']:.1f} % MFU predicted, {row['published']} % reported")


if __name__ == "__main__":
    main()
