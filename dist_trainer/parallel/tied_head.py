"""A head tied to the input embedding, under fsdp on CPU: its gradient reduced when the head's backward makes it.

A weight tied between the embedding and the output head (the built-in GPT; qwen2, llama or gpt2 with
``tie_word_embeddings``) sits in the root FSDP unit, and its two uses meet in one gradient. Autograd holds the
head's part (the whole weight's size) from the head's backward, the first of the backward, until the embedding's
backward, the last, adds its own; and FSDP keeps the root's gathered weight all that time, for the root's
post-backward. Measured under fsdp on 2 ranks with a 216 MiB qwen2 (a 24 MiB embedding): 48 MiB more through
every unit's backward, a quarter of what the model's shards add to a rank.

Here the head's part goes its own way. A hook on the autograd node that hands it to the weight takes it, reduces
it as FSDP reduces the whole gradient (reduce-scatter over the shard group, averaged; under hsdp the shard then
averaged across replicas), keeps this rank's shard, and frees the gathered weight, which nothing later in the
backward reads (the embedding's backward needs the token ids only). The embedding's part reaches FSDP as before,
and the kept shard is added to the sharded gradient once the backward is done. The gradient is the sum of two
reductions instead of the reduction of the sum: equal up to rounding. It costs one reduce-scatter of the weight
(and, hsdp, one all-reduce of its shard) per backward that reduces, which plan mode counts (``extra_collectives``).

Where: fsdp or hsdp on CPU (host memory is what this is for; CUDA runs keep FSDP's own path, not measured with
it) with shard groups of two ranks or more, without tp, pp, compilation or the chunked loss (which do not call
the head module), on a tied weight that trains and that the root unit holds.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from .state import local_tensor, parameter_ties


def tied_head(model: nn.Module, blocks: list, mesh: Any, device_type: str, compile: bool) -> Optional[nn.Module]:
    """The head module whose weight is tied to the embedding and gets its own reduction, or None where the
    rules above leave FSDP's own path: the same answer in plan mode (a meta model) and in the run."""
    chunked = getattr(getattr(model, "loss_options", None), "chunked", False)
    # A shard group of one rank gathers nothing: its gathered weight is no second copy to free.
    if (mesh.strategy != "fsdp" or mesh.shard == 1 or mesh.tp > 1 or mesh.pp > 1 or device_type != "cpu" or compile
            or chunked):
        return None
    ties = parameter_ties(model)
    if not ties:
        return None
    later = next(iter(ties))  # the head's name of the weight (named after the embedding's)
    module_name, _, param_name = later.rpartition(".")
    head = model.get_submodule(module_name)
    weight = getattr(head, param_name)
    in_blocks = any(weight is p for block in blocks for p in block.parameters())
    if param_name != "weight" or not weight.requires_grad or in_blocks:
        return None
    return head


def extra_collectives(accum_sync: str, mesh: Any, accum_steps: int, shard_elements: int) -> Dict[str, int]:
    """What the tied head's own reduction adds to a step's collectives (``shard_elements``: one rank's padded
    shard of the weight; gradients reduce in FP32): a reduce-scatter per backward that reduces (accum_sync=last:
    the last; every: each, or under hsdp the last, where the replicas' all-reduce is), and under hsdp one
    all-reduce of the shard."""
    reducing = accum_steps if accum_sync == "every" and mesh.replicate == 1 else 1
    counts = {"reduce_scatters": reducing, "reduce_scatter_bytes": reducing * mesh.shard * shard_elements * 4}
    if mesh.replicate > 1:
        counts.update(allreduces=1, allreduce_bytes=shard_elements * 4)
    return counts


class TiedHeadReduction:
    """The head's part of a tied weight's gradient, reduced in the head's backward (see the module's text)."""

    def __init__(self, head: nn.Module, fsdp_param: Any, shard_group: dist.ProcessGroup,
                 replica_group: Optional[dist.ProcessGroup], counts: Dict[str, int]):
        self.fsdp_param = fsdp_param  # FSDP2's record of the weight: its shards, its gathered copy
        self.shard_group, self.replica_group, self.counts = shard_group, replica_group, counts
        self.reduces = self.frees = False  # set per micro-batch by arm()
        self.shard: Optional[torch.Tensor] = None  # this rank's reduced part, until added to the gradient
        head.register_forward_hook(self._after_forward)

    def arm(self, reduces: bool, frees: bool) -> None:
        """``reduces``: this micro-batch's backward reduces the weight's gradient (and all-reduces it across
        replicas under hsdp); ``frees``: FSDP frees the root's gathered parameters after it."""
        self.reduces, self.frees = reduces, frees

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not (self.reduces and torch.is_grad_enabled() and isinstance(output, torch.Tensor)):
            return
        weight = module.weight  # FSDP's gathered parameter: the leaf autograd accumulates into
        # The node whose edge hands the head's part to the weight (a transpose or the matmul), a few nodes from
        # the head's output; searched there only, so the embedding's own edge is never taken.
        todo, seen = [(output.grad_fn, 0)], set()
        while todo:
            node, depth = todo.pop()
            if node is None or node in seen or depth > 4:
                continue
            seen.add(node)
            for index, (nxt, _) in enumerate(node.next_functions):
                if nxt is not None and getattr(nxt, "variable", None) is weight:
                    node.register_hook(lambda grads_in, grads_out, i=index: self._reduce(grads_in, i))
                    return
                todo.append((nxt, depth + 1))
        raise RuntimeError(f"the tied head {type(module).__name__}: no edge from its output to its weight found")

    @torch.no_grad()
    def _reduce(self, grads_in: tuple, index: int) -> tuple:
        grad = grads_in[index]
        if grad is None:
            return grads_in
        passed_on = tuple(None if i == index else g for i, g in enumerate(grads_in))  # the weight's edge: nothing
        world, rank = dist.get_world_size(self.shard_group), dist.get_rank(self.shard_group)
        rows = -(-grad.shape[0] // world)  # FSDP2 cuts dim 0 as torch.chunk does, padded to equal chunks
        flat = torch.zeros((world * rows, *grad.shape[1:]), dtype=torch.float32, device=grad.device)
        flat[:grad.shape[0]].copy_(grad)
        del grad, grads_in  # the head's part, now in flat: freed when the hook returns
        self.counts["reduce_scatters"] += 1
        self.counts["reduce_scatter_bytes"] += flat.numel() * flat.element_size()
        dist.all_reduce(flat, group=self.shard_group)  # in place: gloo's reduce-scatter would copy it first
        shard = flat[rank * rows:(rank + 1) * rows].div_(world).clone()
        del flat
        if self.replica_group is not None:
            self.counts["allreduces"] += 1
            self.counts["allreduce_bytes"] += shard.numel() * shard.element_size()
            dist.all_reduce(shard, group=self.replica_group)
            shard.div_(dist.get_world_size(self.replica_group))
        self.shard = shard if self.shard is None else self.shard.add_(shard)
        if self.frees:
            # FSDP2 has no public call to free one parameter's gathered copy; the root's post-backward frees it
            # again (a no-op) and the next forward gathers it anew.
            self.fsdp_param.free_unsharded_param()
        return passed_on

    def add_to_gradient(self) -> None:
        """After the backward: the kept shard into the weight's sharded gradient (FSDP's, from the embedding).
        Disarmed until the next micro-batch: a forward outside the step (evaluation, a trial) reduces nothing."""
        self.reduces = self.frees = False
        if self.shard is None:
            return
        grad = self.fsdp_param.sharded_param.grad
        if grad is None:
            raise RuntimeError("the tied weight has no sharded gradient from FSDP to add the head's part to")
        local = local_tensor(grad)
        local.add_(self.shard[:local.shape[0]].view_as(local))
        self.shard = None
