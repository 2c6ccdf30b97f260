"""``dcp-plus bench``: physical limits, stock DCP and dcp_plus side by side (``docs/bench.md``).

One module per job: ``models`` (GPT-2-like + AdamW state dicts), ``machine`` (load average,
other processes' CPU, page-cache dropping, peak RSS), ``limits`` (memcpy / durable write / cold
read, buffered and O_DIRECT), ``pagecache`` (a checkpoint's bytes left in the page cache),
``cases`` (the save+load rows), ``measure`` (one rank's figures, merged over the ranks),
``world`` (the gloo world they run in: this process or N spawned ranks), ``timeline`` (a
training loop with checkpoints), ``runner`` (the whole run), ``report`` (table, JSON, ratios)
and ``plot`` (PNG). Imports run one way: ``runner`` -> ``world`` -> ``measure``.
"""
