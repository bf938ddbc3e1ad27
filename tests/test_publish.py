"""rl.publish: the policy's weights reach an inference server during training.

A loopback server stands in for SGLang: it implements POST /update_weights_from_disk by loading the announced
directory with ``from_pretrained`` and recording its logits on a fixed input. A 2-rank fsdp DPO run of a tiny
Llama publishing every 2 of 5 steps announces versions 2, 4 and 5 in order, keeps the newest two, points
``latest`` at the last, and the last version's logits are the run's own hf_model/'s, bit for bit (fp32). A
server that refuses stops the run with an error naming rl.publish.url, after the version (here in bf16) is
complete on disk. The checks' refusals name their keys.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from dist_trainer.config import Config, ConfigError, RLConfig
from dist_trainer.config.schema import PublishConfig
from dist_trainer.rl.checks import check_publish
from dist_trainer.validation import KEY_CHECKS
from test_dpo import _cli, preference_records
from test_hf_chat import write_jsonl

INPUT_IDS = torch.tensor([[1, 5, 9, 33, 70, 101, 2, 48]])  # byte-level tokens: any ids below 256


def logits_of(directory: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(INPUT_IDS).logits


def _reply(handler: BaseHTTPRequestHandler, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class LoopbackServer:
    """JSON POST routes on 127.0.0.1 (port 0: the system's choice), served by a thread of the test inside
    ``with``: each request's (path, body) goes to ``post``, which returns (status, reply)."""

    def __init__(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, reply = server.post(self.path, body)
                _reply(self, status, reply)

            def log_message(self, *args) -> None:  # quiet
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)

    def post(self, path: str, body: dict) -> tuple:
        raise NotImplementedError

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.http.shutdown()
        self.http.server_close()


class FakeSGLang(LoopbackServer):
    """POST /update_weights_from_disk: each announced directory loaded and recorded as (its name, its logits);
    ``accept=False`` replies ``success: false`` without loading."""

    def __init__(self, accept: bool = True):
        super().__init__()
        self.announced: list = []
        self.accept = accept

    def post(self, path: str, body: dict) -> tuple:
        if path == "/load_lora_adapter":  # the adapters alone: recorded as (name, their tensors)
            from safetensors.torch import load_file

            adapter = Path(body["lora_path"])
            self.announced.append((body["lora_name"], load_file(adapter / "adapter_model.safetensors")))
            return 200, {"success": True}
        if path != "/update_weights_from_disk" or body.get("load_format") != "auto":
            return 400, {"success": False, "message": f"unexpected {path} {body}"}
        if not self.accept:
            return 200, {"success": False, "message": "refused by the test"}
        model = Path(body["model_path"])
        self.announced.append((model.name, logits_of(model)))
        return 200, {"success": True, "message": "loaded"}


class FakeGroupServer(LoopbackServer):
    """An inference server's weight routes: SGLang's /init_weights_update_group and
    /update_weights_from_distributed (``broadcast``), vLLM's /init_weight_transfer_engine, /start_weight_update,
    /update_weights and /finish_weight_update (``vllm``). Its one worker joins the trainer's group as rank 1
    (torch's TCPStore and gloo, the group's name as the store's prefix) and receives each announced tensor, in
    order, into a version: {name: tensor}."""

    def __init__(self):
        super().__init__()
        self.versions: list = []
        self.routes: list = []

    def post(self, path: str, body: dict) -> tuple:
        self.routes.append(path)
        if path == "/init_weights_update_group":
            self._join(body)
        elif path == "/init_weight_transfer_engine":
            self._join(body["init_info"])
        elif path == "/update_weights_from_distributed":
            self._receive(body["names"], body["dtypes"], body["shapes"])
        elif path == "/update_weights":
            info = body["update_info"]
            self._receive(info["names"], info["dtype_names"], info["shapes"])
        return 200, {"success": True}

    def _join(self, info: dict) -> None:
        import datetime

        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=60)
        store = dist.TCPStore(info["master_address"], info["master_port"], info["world_size"], is_master=False,
                              timeout=timeout)
        name = info.get("group_name", "dist_trainer_publish")
        self.group = dist.ProcessGroupGloo(dist.PrefixStore(f"{name}/", store), info["rank_offset"],
                                           info["world_size"], timeout)
        self.store = store

    def _receive(self, names: list, dtypes: list, shapes: list) -> None:
        import torch.distributed as dist

        version = {}
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype))
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            self.group.broadcast([tensor], opts).wait()
            version[name] = tensor
        self.versions.append(version)

    def logits(self, version: dict, like: Path) -> torch.Tensor:
        """The logits of a model configured as ``like`` (a hf_model/ directory) holding ``version``'s tensors."""
        from transformers import AutoConfig, AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(like), dtype=torch.float32).eval()
        missing, unexpected = model.load_state_dict(version, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # a tied head
        with torch.no_grad():
            return model(INPUT_IDS).logits


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    return write_jsonl(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", preference_records(32, seed=3))


@pytest.mark.slow  # a 2-rank torchrun job and three loads by the server: about 15 s
def test_sglang_gets_every_version_in_order_and_the_last_is_the_final_model(tmp_path, pairs):
    from test_checkpoint import metrics, run

    run_dir = tmp_path / "run"
    with FakeSGLang() as server:
        result = run(_cli(pairs, run_dir, 5, "dist.strategy=fsdp", "rl.publish.mode=sglang", "rl.publish.every=2",
                          f"rl.publish.url={server.url}"), tmp_path, nproc=2)
    assert result.returncode == 0, result.output[-4000:]
    assert [name for name, _ in server.announced] == ["step_00000002", "step_00000004", "step_00000005"]
    published = run_dir / "published"
    assert sorted(p.name for p in published.iterdir()) == ["latest", "step_00000004", "step_00000005"]
    assert (published / "latest").read_text().strip() == "step_00000005"
    assert torch.equal(server.announced[-1][1], logits_of(run_dir / "hf_model"))
    assert not torch.equal(server.announced[0][1], server.announced[-1][1])  # the weights moved between versions
    timed = [r["step"] for r in metrics(run_dir) if "publish_s" in r]
    assert timed == [2, 4, 5] and all(r["publish_s"] > 0 for r in metrics(run_dir) if "publish_s" in r)


def test_a_server_that_refuses_stops_the_run_naming_the_url(tmp_path, pairs):
    """One process: the version is written whole (here in bf16) before it is announced; the refusal is an error
    naming rl.publish.url and the reply."""
    from safetensors import safe_open

    from test_checkpoint import run

    run_dir = tmp_path / "run"
    with FakeSGLang(accept=False) as server:
        result = run(_cli(pairs, run_dir, 2, "rl.publish.mode=sglang", f"rl.publish.url={server.url}",
                          "rl.publish.dtype=bf16"), tmp_path)
    assert result.returncode != 0
    assert f"rl.publish.url={server.url}" in result.output and "refused by the test" in result.output
    version = run_dir / "published" / "step_00000001"
    assert (run_dir / "published" / "latest").read_text().strip() == version.name
    assert json.loads((version / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(version / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


VLLM_ROUTES = ["/init_weight_transfer_engine"] + ["/start_weight_update", "/update_weights",
                                                  "/finish_weight_update"] * 2
SGLANG_ROUTES = ["/init_weights_update_group"] + ["/update_weights_from_distributed"] * 2


@pytest.mark.parametrize("mode, lora, routes", [("vllm", False, VLLM_ROUTES),
                                                pytest.param("broadcast", False, SGLANG_ROUTES,
                                                             marks=pytest.mark.slow),  # 4-5 s: slow stage
                                                ("broadcast", True, SGLANG_ROUTES)])
def test_a_server_gets_each_version_over_the_group_and_the_last_is_the_final_model(tmp_path, pairs, mode, lora,
                                                                                   routes):
    """One process (vllm) or 2 fsdp ranks (broadcast; LoRA: the adapters merged as hf_model/ is): the group made
    once, a version a step, no directory written; the last version's logits are the run's own hf_model/'s, bit
    for bit (fp32)."""
    from test_checkpoint import metrics, run

    run_dir = tmp_path / "run"
    extra = (["dist.strategy=fsdp"] if mode == "broadcast" else []) + (["model.lora.r=4"] if lora else [])
    with FakeGroupServer() as server:
        result = run(_cli(pairs, run_dir, 2, f"rl.publish.mode={mode}", f"rl.publish.url={server.url}",
                          f"rl.publish.master_port={free_port()}", *extra), tmp_path,
                     nproc=2 if mode == "broadcast" else 0)
    assert result.returncode == 0, result.output[-4000:]
    assert server.routes == routes
    assert len(server.versions) == 2 and not (run_dir / "published").exists()
    first, last = (server.logits(v, run_dir / "hf_model") for v in server.versions)
    assert torch.equal(last, logits_of(run_dir / "hf_model")) and not torch.equal(first, last)
    assert [r["step"] for r in metrics(run_dir) if "publish_s" in r] == [1, 2]


def test_the_adapters_alone_reach_the_server_as_peft_writes_them(tmp_path, pairs):
    """rl.publish.lora=adapter: each version is the adapters in peft's format, loaded with /load_lora_adapter;
    the last equals the run's own hf_adapter/, bit for bit, and no base weight is written."""
    from safetensors.torch import load_file

    from test_checkpoint import run

    run_dir = tmp_path / "run"
    with FakeSGLang() as server:
        result = run(_cli(pairs, run_dir, 2, "model.lora.r=4", "rl.publish.mode=sglang", "rl.publish.lora=adapter",
                          f"rl.publish.url={server.url}"), tmp_path)
    assert result.returncode == 0, result.output[-4000:]
    assert [name for name, _ in server.announced] == ["step_00000001", "step_00000002"]
    final = load_file(run_dir / "hf_adapter" / "adapter_model.safetensors")
    last = server.announced[-1][1]
    assert last.keys() == final.keys() and all(torch.equal(last[k], final[k]) for k in final)
    assert not all(torch.equal(server.announced[0][1][k], final[k]) for k in final)  # the adapters moved
    files = {p.name for p in (run_dir / "published" / "step_00000002").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= files
    assert not any(name.startswith("model") or name == "config.json" for name in files), files  # no base


# ------------------------------------------------------------------------------------------ refusals

HF_CAUSAL = {"_target_": "dist_trainer.hf.models.hf_model", "task": "causal_lm"}


def _cfg(model: dict = HF_CAUSAL, **publish) -> Config:
    return Config(model=dict(model), rl=RLConfig(publish=PublishConfig(**publish)))


@pytest.mark.parametrize("publish, key", [
    ({"mode": "triton"}, "rl.publish.mode"),
    ({"mode": "disk", "lora": "both"}, "rl.publish.lora"),
    ({"mode": "disk", "lora": "adapter"}, "rl.publish.lora"),  # the model has no adapters
    ({"mode": "vllm", "url": "http://127.0.0.1:30000", "master_port": 29600, "lora": "adapter"}, "rl.publish.lora"),
    ({"mode": "vllm"}, "rl.publish.url"),
    ({"mode": "broadcast", "url": "http://127.0.0.1:30000"}, "rl.publish.master_port"),
    ({"mode": "vllm", "url": "http://127.0.0.1:30000", "master_port": 29600, "world_size": 1},
     "rl.publish.world_size"),
    ({"mode": "disk", "dtype": "fp8"}, "rl.publish.dtype"),
    ({"mode": "disk", "every": 0}, "rl.publish.every"),
    ({"mode": "disk", "keep": 0}, "rl.publish.keep"),
    ({"mode": "disk", "dir": " "}, "rl.publish.dir"),
    ({"mode": "sglang"}, "rl.publish.url"),
    ({"mode": "sglang", "url": "127.0.0.1:30000"}, "rl.publish.url"),
    ({"mode": "disk", "url": "http://127.0.0.1:30000"}, "rl.publish.url"),
    ({"url": "http://127.0.0.1:30000"}, "rl.publish.url"),
])
def test_refusals_name_their_key(publish, key):
    with pytest.raises(ConfigError, match=f"^{key}="):
        check_publish(_cfg(**publish))


def test_publishing_needs_a_hugging_face_causal_lm():
    with pytest.raises(ConfigError, match="^model=.*model=hf_causal_lm"):
        check_publish(_cfg({"_target_": "dist_trainer.models.gpt.GPT"}, mode="disk"))
    with pytest.raises(ConfigError, match="^model="):
        check_publish(_cfg({**HF_CAUSAL, "task": "masked_lm"}, mode="disk"))
    check_publish(_cfg({"_target_": "dist_trainer.models.gpt.GPT"}))  # mode=none: any model
    check_publish(_cfg(mode="sglang", url="http://127.0.0.1:30000", every=3, keep=1, dtype="bf16"))
    assert check_publish in KEY_CHECKS  # validate runs it
