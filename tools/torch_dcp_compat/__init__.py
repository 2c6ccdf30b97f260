"""Run PyTorch's own DCP tests against dcp_plus.

``plugin`` (a pytest plugin, ``-p tools.torch_dcp_compat.plugin``) replaces DCP's stock
``FileSystemWriter``/``FileSystemReader``/``DefaultSavePlanner``/``DefaultLoadPlanner``/
``DefaultStager`` with the dcp_plus stand-ins of ``compat`` in the test process and in every
process it spawns. ``summarize`` compares a patched and an unpatched JUnit report.
See README.md. Importing this package does not import torch.
"""
