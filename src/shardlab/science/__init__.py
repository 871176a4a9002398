"""Science cases: chemistry, biology and materials data as conditional text for a causal LM.

`formats` turns a labelled row into `<tag=value> body` text (and back), `splits` assigns rows to
deterministic train/validation/test parts, `evaluate` scores fine-tuned models per domain
against trivial baselines, `tables` gathers the runs and metrics into report tables.
"""
