"""rl.publish: the policy's weights handed to an inference server during training.

RL post-training generates its rollouts with an inference engine; the engine must serve the weights the trainer
has just made. After each step N with N % rl.publish.every == 0, and after the last step, every rank walks the
model tensor by tensor exactly as the final export does (``final.walk`` over the strategy's ``full_tensors()``:
no rank holds the model whole) and rank 0 writes a Hugging Face directory ``<dir>/step_<N:08d>/`` (config.json,
safetensors files, the tokenizer; a LoRA model merged, in FP32, then cast to rl.publish.dtype):

1. written under ``.tmp-step_<N:08d>`` beside it and renamed when complete (a reader never sees half a version);
2. ``<dir>/latest`` (the version's directory name) written beside it and renamed over the old one;
3. versions beyond the newest rl.publish.keep removed (and any newer than N: a resumed run's rolled-back future);
4. mode=sglang: POST ``{"model_path": ..., "load_format": "auto"}`` to ``<url>/update_weights_from_disk``,
   SGLang's route, whose JSON reply must say ``"success": true``.

rl.publish.lora=adapter (a LoRA model): ``step_<N>/`` holds the adapters alone in peft's format (gathered whole, the
base untouched), and mode=sglang POSTs ``{"lora_name": "step_<N>", "lora_path": ...}`` to ``/load_lora_adapter``.

mode=vllm and mode=broadcast write no directory: the same tensors (names, serving dtype, LoRA merged) go to the
server over a torch.distributed group, announced through its HTTP routes (``rl/transfer.py``).

Whatever fails on rank 0 (the disk, the server) is broadcast, and every rank raises the same error: no rank is
left waiting in a collective. The seconds spent go into the step's record as ``publish_s``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..config import ConfigError
from ..config.schema import PublishConfig
from ..distributed import DistEnv

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
LATEST = "latest"  # a text file holding the newest complete version's directory name
ROUTE = "/update_weights_from_disk"
ANNOUNCE_TIMEOUT_S = 600.0  # the server replies once it has loaded the whole model
VERSION = re.compile(r"step_(\d{8})$")


class PublishError(RuntimeError):
    """A version could not be written, or the server did not load it: raised on every rank alike."""


def version_name(step: int) -> str:
    return f"step_{step:08d}"


class NoPublisher:
    """rl.publish.mode=none: never due."""

    def due(self, step: int, last: bool) -> bool:
        return False


class Publisher:
    """Built once before the loop; ``due`` and ``publish`` are called after each optimizer step, on every rank."""

    def __init__(self, cfg: PublishConfig, strategy: Any, module: nn.Module, run_dir: Path, env: DistEnv):
        from ..hf.export import is_lora, streams

        self.lora = is_lora(module)
        if self.lora and not streams(module):
            raise ConfigError(f"rl.publish.mode={cfg.mode}: this LoRA model (DoRA, a LoRA bias or modules to save) "
                              "is merged from a whole copy, which publishing does not do yet: use plain LoRA on "
                              "linear layers, or rl.publish.mode=none")
        self.cfg, self.strategy, self.module, self.env = cfg, strategy, module, env
        self.root = Path(cfg.dir).expanduser().absolute() if cfg.dir else run_dir.absolute() / "published"
        self.dtype = DTYPES[cfg.dtype]
        self.channel = None  # vllm, broadcast: rank 0's side of the group to the server
        if cfg.mode in ("vllm", "broadcast") and env.is_main:
            from .transfer import Channel

            self.channel = Channel(cfg.mode, cfg.url, cfg.master_address, cfg.master_port, cfg.world_size,
                                   cfg.group_name, env.device)

    def due(self, step: int, last: bool) -> bool:
        return last or step % self.cfg.every == 0

    def publish(self, step: int) -> float:
        """Every rank: version ``step`` written by rank 0 (and loaded by the server); the seconds it took."""
        began = time.perf_counter()
        failure = self._publish(step)
        message = [failure]
        dist.broadcast_object_list(message, src=0)  # rank 0's outcome, so all ranks go on or all raise
        if message[0]:
            raise PublishError(message[0])
        return time.perf_counter() - began

    def _publish(self, step: int) -> Optional[str]:
        from ..final import walk, whole_adapters

        name = version_name(step)
        tensors = self.strategy.full_tensors()  # a collective: every rank walks the model in full
        adapters = whole_adapters(tensors, self.module) if self.lora else None
        if self.cfg.lora == "adapter":  # the adapters alone: the base is neither walked nor written
            failure = self._write_adapters(name, adapters) if self.env.is_main else None
            return self._after_write(step, name, failure, "/load_lora_adapter")
        if self.cfg.mode in ("vllm", "broadcast"):  # to the server's group, no directory
            failure, _ = walk(tensors, lambda: [self._writer(tensors, None, adapters)], self.env.is_main,
                              f"sending step {step}")
            return (f"rl.publish.url={self.cfg.url}: the weights of step {step} did not reach the server "
                    f"({failure})") if failure is not None else None
        failure, _ = walk(tensors, lambda: [self._writer(tensors, name, adapters)], self.env.is_main,
                          f"publishing {name}")
        return self._after_write(step, name, failure, ROUTE)

    def _after_write(self, step: int, name: str, failure: Optional[str], route: str) -> Optional[str]:
        """Rank 0, the version written (or ``failure``): ``latest`` pointed at it, old versions pruned, the server
        told (mode=sglang, through ``route``)."""
        if not self.env.is_main:
            return None
        try:
            if failure is None:
                self._point_latest(name)
                self._prune(step)
        except OSError as err:
            failure = f"{type(err).__name__}: {err}"
        if failure is not None:
            return f"rl.publish.dir={self.root}: the weights of step {step} could not be published ({failure})"
        return self._announce(self.root / name, route) if self.cfg.mode == "sglang" else None

    def _write_adapters(self, name: str, adapters: dict) -> Optional[str]:
        """The adapters alone into ``<dir>/<name>`` (peft's format, the serving dtype), atomically."""
        from ..hf.export import _write, _write_adapters

        try:
            self.root.mkdir(parents=True, exist_ok=True)
            cast = {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in adapters.items()}
            _write(lambda tmp: _write_adapters(self.module, cast, tmp), self.root / name)
        except Exception as err:  # the disk's or peft's: every rank's error, below
            return f"{type(err).__name__}: {err}"
        return None

    def _writer(self, tensors: Any, name: Optional[str], adapters: Optional[dict]) -> Any:
        """hf_model/'s writers (hf.export), into ``<dir>/<name>`` in the serving dtype, or (``name`` None) to the
        server's group; LoRA: the merged model."""
        from ..final import max_shard_mb
        from ..hf.export import HFModelWriter, LoraWriter

        sink = self.channel.sink if name is None else None
        out = None
        if name is not None:
            self.root.mkdir(parents=True, exist_ok=True)  # within walk's guard: a failure here is every rank's error
            out = self.root / name
        if adapters is not None:
            return LoraWriter(self.module, tensors.layout, adapters, out, None, max_shard_mb(), self.dtype, sink)
        return HFModelWriter(self.module, tensors.layout, out, max_shard_mb(), self.dtype, sink)

    def _point_latest(self, name: str) -> None:
        tmp = self.root / f".tmp-{LATEST}"
        tmp.write_text(name + "\n")
        os.replace(tmp, self.root / LATEST)  # atomic: a reader sees the old name or the new, never half of one

    def _prune(self, step: int) -> None:
        """The newest ``keep`` versions up to ``step`` stay; older ones, newer ones (a resumed run's rolled-back
        future) and temporary directories left by an interrupted run go."""
        versions = sorted((int(m.group(1)), p) for p in self.root.iterdir() if (m := VERSION.match(p.name)))
        kept = [p for s, p in versions if s <= step][-self.cfg.keep:]
        for _, path in versions:
            if path not in kept:
                shutil.rmtree(path, ignore_errors=True)
        for path in self.root.glob(".tmp-step_*"):
            shutil.rmtree(path, ignore_errors=True)

    def _announce(self, path: Path, route: str = ROUTE) -> Optional[str]:
        """SGLang's update_weights_from_disk (or load_lora_adapter): None once the server says it loaded ``path``,
        else what went wrong."""
        url = self.cfg.url.rstrip("/") + route
        body = json.dumps({"model_path": str(path), "load_format": "auto"} if route == ROUTE
                          else {"lora_name": path.name, "lora_path": str(path)}).encode()
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=ANNOUNCE_TIMEOUT_S) as response:
                reply = response.read().decode(errors="replace")
        except urllib.error.HTTPError as err:
            reply = f"HTTP {err.code}: {err.read().decode(errors='replace')[:500]}"
        except (urllib.error.URLError, OSError) as err:
            reply = f"no reply: {err}"
        try:
            if json.loads(reply).get("success") is True:
                return None
        except (ValueError, AttributeError):
            pass
        return (f"rl.publish.url={self.cfg.url}: POST {route} with {path} was not accepted "
                f"(reply: {reply[:500]}); the version is on disk, but the server does not serve it")


def build_publisher(cfg: PublishConfig, strategy: Any, module: nn.Module, run_dir: Path,
                    env: DistEnv) -> Publisher | NoPublisher:
    """rl.publish.mode's publisher, chosen once: the loop asks it ``due`` and never looks at the mode."""
    return NoPublisher() if cfg.mode == "none" else Publisher(cfg, strategy, module, run_dir, env)
