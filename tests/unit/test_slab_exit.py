"""Shared memory outlives the process that made it: a process that ends normally without
closing its slabs (or its stager) still leaves none of them behind, and a forked child's exit
leaves its parent's slabs alone."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap

from dcp_plus.memory.slabs import SHM_DIR
from tests.conftest import child_env


def _run(code: str) -> list[str]:
    """Run ``code`` in a fresh interpreter; its stdout lines."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=child_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_slabs_left_open_are_unlinked_when_their_process_exits():
    lines = _run("""
        from dcp_plus.memory.slabs import Slab, registry
        kept = Slab(1 << 20); registry.register(kept); kept.tensor().fill_(7)
        closed = Slab(4096); closed.close()
        print(kept.name, closed.name)
    """)
    assert lines and not [n for n in lines if os.path.exists(os.path.join(SHM_DIR, n))]


def test_a_stager_never_closed_leaves_no_shared_memory_after_a_normal_exit():
    lines = _run("""
        import os, torch
        from dcp_plus import ArenaStager
        stager = ArenaStager()
        stager.stage({"w": torch.randn(256, 256), "b": torch.randn(256)})
        stager.synchronize_staging()
        print(os.getpid())
    """)
    assert glob.glob(f"{SHM_DIR}/dcpp-{lines[-1]}-*") == []


def test_a_forked_childs_exit_leaves_its_parents_slabs():
    lines = _run("""
        import os, sys
        from dcp_plus.memory.slabs import SHM_DIR, Slab
        slab = Slab(1 << 20)
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a normal exit: the child runs the atexit handlers it inherited
        os.waitpid(pid, 0)
        print(slab.name, os.path.exists(os.path.join(SHM_DIR, slab.name)))
    """)
    name, kept_after_child = lines
    assert kept_after_child == "True"
    assert not os.path.exists(os.path.join(SHM_DIR, name))  # the parent's own exit unlinked it


def test_remove_orphans_unlinks_only_the_slabs_of_dead_creators():
    from dcp_plus.memory.slabs import Slab, remove_orphans

    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import sys
            from dcp_plus.memory.slabs import Slab
            print(Slab(4096).name, flush=True)
            sys.stdin.read()
        """)], env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    orphan = child.stdout.readline().strip()
    child.kill()  # SIGKILL: no exit handler runs
    child.wait()
    live = Slab(4096)
    foreign = os.path.join(SHM_DIR, "dcpp-notapid-0")
    open(foreign, "wb").close()
    try:
        assert os.path.exists(os.path.join(SHM_DIR, orphan))
        assert orphan in remove_orphans()
        assert not os.path.exists(os.path.join(SHM_DIR, orphan))
        assert os.path.exists(os.path.join(SHM_DIR, live.name)) and os.path.exists(foreign)
    finally:
        live.close()
        os.unlink(foreign)
