"""Tables from minserve results: percentiles per metric, and one row per contract."""

from __future__ import annotations

from collections.abc import Sequence

import pandas as pd

from minserve import slo


def percentile_table(records: Sequence[slo.RequestRecord], decimals: int = 1) -> pd.DataFrame:
    """:func:`minserve.slo.summary_table` (milliseconds) rounded for reading."""
    return slo.summary_table(records).round(decimals)


def contract_table(
    records: Sequence[slo.RequestRecord],
    slos: Sequence[slo.SLO],
    usd_per_accelerator_hour: float | None = None,
    window: float | None = None,
) -> pd.DataFrame:
    """One row per contract: attainment per target and overall, goodput, throughput, availability, cost.

    Attainment columns are fractions in [0, 1] (``nan`` for a target the contract does not set); rates are
    per second over ``window`` seconds (default: the measured window); cost is US$ per million output tokens.
    """
    rows = [slo.evaluate(records, target, window, usd_per_accelerator_hour).as_row() for target in slos]
    return pd.DataFrame(rows).set_index("contract")
