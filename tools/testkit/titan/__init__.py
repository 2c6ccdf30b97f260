"""TorchTitan CPU runs for tests and benchmarks: a local tokenizer and dataset (``assets``),
the 2-rank launcher (``run``), the rank entry with its CPU shims (``rank``) and the recipe
(``recipe``). Only ``rank`` and ``recipe`` import TorchTitan."""
