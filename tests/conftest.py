import os

import pytest


@pytest.fixture(autouse=True)
def _quiet_single_thread_env(monkeypatch):
    """Ranks share 2 cores: one intra-op thread each; gloo on loopback."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():  # a failed test must not leak its group
        dist.destroy_process_group()


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
    config.addinivalue_line("markers", "slow: longer than the default suite allows; run with -m slow")
    config.addinivalue_line("markers", "slurm: starts a real one-node Slurm cluster (installs it as root if missing)")
    config.addinivalue_line("markers", "image: builds docker/Dockerfile with buildah and runs it (installs buildah as "
                            "root if missing; about 2 minutes with the cached base image)")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
