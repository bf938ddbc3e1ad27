import os

import pytest


@pytest.fixture(autouse=True)
def _fenced(monkeypatch):
    """Ranks share 2 cores: one intra-op thread each; gloo on loopback. What the test changes in this process
    (tests/fence.py: environment, signal handlers, RNG, torch's globals, logging, process groups) is put back
    after it, and a non-daemon thread it left running fails it."""
    from fence import Fence

    fence = Fence()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    yield
    fence.restore()
    stray = fence.stray_threads()
    if stray:
        pytest.fail(f"the test left non-daemon threads running: {[t.name for t in stray]}", pytrace=False)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A real one-node Slurm (tests/slurm_cluster.py) for one module's tests; skipped, with why, where it cannot run."""
    from slurm_cluster import SlurmCluster, available

    reason = available()
    if reason:
        pytest.skip(reason)
    slurm = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        slurm.start()
        yield slurm
    finally:
        slurm.stop()


def pytest_configure(config):
    # What the preloaded server (tests/preloaded.py) reads once at import, fixed before anything forks.
    from preloaded import freeze_env

    freeze_env()
    config.addinivalue_line("markers", "slow: longer than the default suite allows; run with -m slow")
    config.addinivalue_line("markers", "slurm: starts a real one-node Slurm cluster (installs it as root if missing)")
    config.addinivalue_line("markers", "image: builds docker/Dockerfile with buildah and runs it (installs buildah as "
                            "root if missing; about 2 minutes with the cached base image)")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")


def pytest_collection_finish(session):
    # The test modules' imports (torch, transformers, ...) out of the collector's reach, as in the preloaded
    # server (tests/gc_frozen.py): a gc.collect() in a case run in this process then walks only what it made.
    import gc

    gc.collect()
    gc.freeze()
