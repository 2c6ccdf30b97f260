"""The application: the `dcp-plus` command and what runs behind its verbs (demo, bench, plan).

No library module imports this package.
"""
