"""What tests/ and benchmarks/ share: free ports, the multi-process gloo world, the bit-exact
state-dict assertion, the object-collective byte counter and the test servers.

It lives under ``tools/`` (the repository's own, not-installed code) rather than in
``tests/``, because benchmarks import nothing from the tests, and outside ``dcp_plus`` because
the library must not depend on test code. Both ``pytest`` and ``python -m benchmarks.x`` run
from the repository root, where ``tools`` is importable; spawned ranks get the root on
``PYTHONPATH``.

Modules: ``ports`` (free TCP ports), ``exact`` (:func:`~tools.testkit.exact.assert_bit_exact`),
``world`` (N-rank gloo worlds: named cases, one function, or this process alone),
``collectives`` (bytes DCP's object collectives carry), ``server``/``seaweed``/``ganesha``
(SeaweedFS S3 and NFS-Ganesha test servers) and ``titan`` (TorchTitan CPU runs).
"""
