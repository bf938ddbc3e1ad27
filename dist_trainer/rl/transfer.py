"""rl.publish.mode=vllm|broadcast: the weights sent to an inference server over a torch.distributed group.

The control plane is the server's HTTP routes, the data plane a process group of the trainer's rank 0 (rank 0 of
the group) and the server's workers (ranks 1 .. world_size - 1), made once, at the first publication:

- ``broadcast`` speaks SGLang's routes: POST ``/init_weights_update_group`` ``{master_address, master_port,
  rank_offset: 1, world_size, group_name, backend}`` once; each version POST ``/update_weights_from_distributed``
  ``{names, dtypes, shapes, group_name, flush_cache: true}``, while rank 0 broadcasts each tensor in that order.
- ``vllm`` speaks vLLM's weight-transfer routes: POST ``/init_weight_transfer_engine`` ``{init_info:
  {master_address, master_port, rank_offset: 1, world_size}}`` once; each version POST ``/start_weight_update``,
  then ``/update_weights`` ``{update_info: {names, dtype_names, shapes, packed: false}}`` while rank 0 broadcasts
  each tensor in that order, then ``/finish_weight_update``.

The group is torch's own: a TCPStore served by rank 0 at ``rl.publish.master_address:master_port`` and, over its
``group_name/`` prefix, gloo on a CPU, NCCL on a GPU. A server joins it as SGLang's ``init_custom_process_group``
does (torch.distributed's rendezvous at ``tcp://address:port``); vLLM's NCCL engine forms its group with its own
``StatelessProcessGroup``, which this does not speak: the routes are vLLM's, the group must be torch's.

The tensors come from ``final.walk`` as hf_model/'s writer would write them (names, the serving dtype, a LoRA model
merged): one whole tensor at a time, never the model, and each broadcast completes before the next tensor, so what
the server holds when the route replies is the version of that step, whatever the trainer does next. An HTTP
call runs in a thread while rank 0 sends: the server's route replies once it has received every tensor.
"""

from __future__ import annotations

import datetime
import json
import threading
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ..models.export import Entry

TIMEOUT_S = 600.0
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.int64: "int64", torch.int32: "int32", torch.uint8: "uint8", torch.bool: "bool"}


class TransferError(RuntimeError):
    """The server refused a route, did not answer, or a tensor could not be sent."""


class Call:
    """One POST in a thread: started before the broadcasts it waits for, joined after them."""

    def __init__(self, url: str, body: Dict[str, Any]):
        self.url, self.reply = url, None
        self.thread = threading.Thread(target=self._run, args=(json.dumps(body).encode(),), daemon=True)
        self.thread.start()

    def _run(self, data: bytes) -> None:
        request = urllib.request.Request(self.url, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
                self.reply = (response.status, response.read().decode(errors="replace"))
        except urllib.error.HTTPError as err:
            self.reply = (err.code, err.read().decode(errors="replace"))
        except (urllib.error.URLError, OSError) as err:
            self.reply = (None, f"no reply: {err}")

    def result(self) -> None:
        """Raises unless the server replied 200 (and, where the reply is JSON with ``success``, true)."""
        self.thread.join(TIMEOUT_S)
        status, text = self.reply or (None, "no reply in time")
        ok = status == 200
        try:
            body = json.loads(text)
            if isinstance(body, dict) and "success" in body:
                ok = ok and body["success"] is True
        except ValueError:
            pass
        if not ok:
            raise TransferError(f"POST {self.url} was not accepted (HTTP {status}: {text[:500]})")


class Channel:
    """Rank 0's side of the group; ``connect`` at the first publication, then ``send`` per version."""

    def __init__(self, mode: str, url: str, address: str, port: int, world_size: int, group_name: str,
                 device: torch.device):
        self.mode, self.url = mode, url.rstrip("/")
        self.address, self.port, self.world_size, self.group_name = address, port, world_size, group_name
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.group: Optional[Any] = None

    def _post(self, route: str, body: Dict[str, Any]) -> Call:
        return Call(self.url + route, body)

    def connect(self) -> None:
        if self.group is not None:
            return
        info = {"master_address": self.address, "master_port": self.port, "rank_offset": 1,
                "world_size": self.world_size}
        call = (self._post("/init_weights_update_group", {**info, "group_name": self.group_name,
                                                          "backend": self.backend})
                if self.mode == "broadcast" else self._post("/init_weight_transfer_engine", {"init_info": info}))
        timeout = datetime.timedelta(seconds=TIMEOUT_S)
        try:
            store = dist.TCPStore(self.address, self.port, self.world_size, is_master=True, timeout=timeout)
            prefixed = dist.PrefixStore(f"{self.group_name}/", store)
            group_type = dist.ProcessGroupNCCL if self.backend == "nccl" else dist.ProcessGroupGloo
            self.group = group_type(prefixed, 0, self.world_size, timeout)
        finally:
            call.result()
        self.store = store  # the server's ranks reach the group through it: kept for the run

    def sink(self, entries: List[Entry]) -> "Sender":
        """What hf_model/'s writer hands each tensor to, for one version (``HFModelWriter(sink=...)``)."""
        self.connect()
        names = [e.name for e in entries]
        shapes = [list(e.shape) for e in entries]
        dtypes = [DTYPE_NAMES.get(e.dtype, str(e.dtype).removeprefix("torch.")) for e in entries]
        if self.mode == "broadcast":
            call = self._post("/update_weights_from_distributed", {
                "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": self.group_name,
                "flush_cache": True})
        else:
            self._post("/start_weight_update", {"is_checkpoint_format": True}).result()
            call = self._post("/update_weights", {"update_info": {
                "names": names, "dtype_names": dtypes, "shapes": shapes, "packed": False}})
        return Sender(self, entries, call)

    def broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([tensor], opts).wait()


class Sender:
    """One version's tensors, in the announced order, each broadcast whole before the next."""

    def __init__(self, channel: Channel, entries: List[Entry], call: Call):
        self.channel, self.entries, self.call, self.sent = channel, entries, call, 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        entry = self.entries[self.sent] if self.sent < len(self.entries) else None
        if entry is None or entry.name != name or tuple(tensor.shape) != entry.shape or tensor.dtype != entry.dtype:
            raise TransferError(f"{name} {tuple(tensor.shape)} {tensor.dtype} sent where "
                                f"{entry.name if entry else 'nothing more'} was announced")
        self.channel.broadcast(tensor.detach().to(self.channel.device).contiguous())
        self.sent += 1

    def close(self) -> None:
        if self.sent != len(self.entries):
            raise TransferError(f"{self.sent} of {len(self.entries)} announced tensors sent")
        self.call.result()
        if self.channel.mode == "vllm":
            self.channel._post("/finish_weight_update", {}).result()

    def abandon(self) -> None:
        pass  # the server's route fails on its own when the group's tensors stop: the run's error says why
