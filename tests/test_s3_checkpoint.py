"""Checkpoints in object storage (trainer.ckpt_dir=s3://...), against moto's S3 server on the loopback.

The fixture starts ``python -m moto.server`` on 127.0.0.1 and stops it; s3fs is the client, and the
runs find the endpoint and the credentials in the environment, as they would find a real one's.

What is proved here, with real torchrun runs:

* fsdp on 2 ranks saves to S3 in the background and blocking (DCP writes the shards through fsspec),
  prunes beyond trainer.keep_checkpoints there, and a second start resumes from S3, removes a
  checkpoint whose manifest was never written (a killed write's debris), and ends bit-identical to a
  run that kept its checkpoints on the local disk;
* the credentials appear in no log, config or checkpoint file;
* a Hugging Face model's checkpoint in S3 exports with ``python -m dist_trainer.export s3://...``;
* an s3:// URL with credentials in it is refused, naming trainer.ckpt_dir.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from helpers import REPO
from test_checkpoint import TINY, assert_bit_identical, assert_same_metrics, resumed_from, run, run_all

SECRET = "moto-secret-9f2c"  # what must never be written anywhere
BUCKET = "ckpts"
ARGS = TINY + ["batch.global_batch_size=32", "batch.micro_batch_size=8", "optim.warmup_steps=2",
               "optim.schedule=constant", "trainer.ckpt_every=2", "+model.bias=false", "dist.strategy=fsdp"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """moto's S3 server, a bucket in it, and the environment a client needs to reach it."""
    port = _free_port()
    log = tmp_path_factory.mktemp("moto") / "server.log"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                  stdout=out, stderr=subprocess.STDOUT)
    env = {"AWS_ACCESS_KEY_ID": "moto-key", "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        import s3fs

        deadline = time.monotonic() + 60
        while True:
            try:
                fs = s3fs.S3FileSystem(skip_instance_cache=True)
                fs.mkdir(BUCKET)
                break
            except Exception:  # noqa: BLE001 - the server is still starting
                assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
        yield fs
    finally:
        server.terminate()
        server.wait(10)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _names(fs, prefix: str):
    fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{BUCKET}/{prefix}", detail=False))


@pytest.mark.slow  # four 2-rank runs through a local S3 server, about a minute: .ci/run runs it with the slow set
def test_sharded_background_saves_to_s3_prune_and_resume_bit_identical(s3, tmp_path):
    url = f"s3://{BUCKET}/fsdp"
    remote = ARGS + [f"trainer.ckpt_dir={url}", "trainer.keep_checkpoints=1", "trainer.ckpt_async=true"]
    ref, half = run_all([(ARGS + ["trainer.max_steps=8", f"hydra.run.dir={tmp_path / 'ref'}"], 2),
                         (remote + ["trainer.max_steps=6", f"hydra.run.dir={tmp_path / 'run'}"], 2)], tmp_path)
    assert ref.returncode == 0, ref.output[-4000:]
    assert half.returncode == 0, half.output[-4000:]
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing on the local disk
    assert _names(s3, "fsdp") == ["step_00000006"]  # steps 2 and 4 pruned once newer ones were sealed
    manifest = json.loads(s3.cat(f"{BUCKET}/fsdp/step_00000006/manifest.json"))
    assert manifest["sharded"] and any(name.startswith("shards/__1_") for name in manifest["files"])
    assert f"step 4: checkpoint {url}/step_00000004 (written in the background" in half.output

    # A killed write's debris: a checkpoint prefix without its manifest. Then resume to step 8, blocking saves.
    s3.pipe(f"{BUCKET}/fsdp/step_00000007/shared.pt", b"partial")
    proc = run(ARGS + [f"trainer.ckpt_dir={url}", "trainer.keep_checkpoints=1", "trainer.max_steps=8",
                       f"hydra.run.dir={tmp_path / 'run'}"], tmp_path, nproc=2)
    assert proc.returncode == 0, proc.output[-4000:]
    assert resumed_from(proc.output) == f"{url}/step_00000006"
    assert f"removing {url}/step_00000007, a checkpoint that was never sealed" in proc.output
    assert _names(s3, "fsdp") == ["step_00000008"]
    assert_same_metrics(tmp_path / "run", tmp_path / "ref", 8)
    assert_bit_identical(tmp_path / "run", tmp_path / "ref")
    # The credentials came from the environment and went nowhere.
    written = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert all(SECRET.encode() not in p.read_bytes() for p in written)
    assert SECRET not in half.output + proc.output
    assert all(SECRET.encode() not in s3.cat(key) for key in s3.find(f"{BUCKET}/fsdp"))


@pytest.mark.slow  # a Hugging Face model: .ci/run runs it with the slow set
def test_a_hugging_face_checkpoint_in_s3_exports(s3, tmp_path):
    url = f"s3://{BUCKET}/hf"
    llama = ["model=hf_causal_lm", "model.model_type=llama", "model.pretrained=null",
             "+model.config={hidden_size:32,num_hidden_layers:1,num_attention_heads:4,num_key_value_heads:2,"
             "intermediate_size:64}", "batch.global_batch_size=8", "batch.micro_batch_size=8"]
    rest = [a for a in TINY if not a.startswith("model.")]
    proc = run(rest + llama + ["trainer.max_steps=2", f"trainer.ckpt_dir={url}", f"hydra.run.dir={tmp_path / 'run'}"],
               tmp_path)
    assert proc.returncode == 0, proc.output[-4000:]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "dist_trainer.export", url, str(tmp_path / "exported")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert f"{url}/step_00000002" in out.stdout + out.stderr
    assert (tmp_path / "exported" / "model.safetensors").is_file()


def test_credentials_in_the_url_are_refused_naming_the_key():
    from dist_trainer.config import ConfigError
    from dist_trainer.validation import validate
    from test_hsdp import _gpt

    cfg = _gpt(8)
    cfg.trainer.ckpt_dir = f"s3://key:{SECRET}@bucket/prefix"
    with pytest.raises(ConfigError, match=r"trainer\.ckpt_dir") as err:
        validate(cfg, 1)
    assert SECRET not in str(err.value)
