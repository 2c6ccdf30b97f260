"""``dcp-plus bench``: physical limits, stock DCP and dcp_plus side by side (``docs/bench.md``).

One module per job: ``models`` (GPT-2-like + AdamW state dicts), ``machine`` (load average,
other processes' CPU, page-cache dropping, peak RSS), ``limits`` (memcpy / durable write / cold
read), ``cases`` (the save+load rows), ``timeline`` (a training loop with checkpoints),
``world`` (a gloo world of N ranks), ``report`` (table, JSON, ratios) and ``plot`` (PNG).
"""
