"""task=grpo's rollouts: each prompt's group of completions, sampled by the policy, keyed, the same on any world size.

A group is sampled as one batch of ``rl.group_size`` rows of the same prompt (no padding), by one rank: the step's
prompts, in increasing index, go to the ranks in turn. A row's token t is the argmax of its logits over the
temperature plus Gumbel noise drawn from the row's own generator, seeded by (trainer.seed, step, prompt, sample):
an exact draw from the tempered distribution, whose randomness does not depend on which rank samples the group,
how many ranks there are, or the process's RNG (which a resume restores anyway). The batch a group is sampled in is
the same whatever the world size, so its logits, and so its tokens, are the same bits.

Where a forward is a collective (fsdp's and hsdp's gathers), every rank runs the same number of sampling passes:
as many rounds as the rank with the most groups, each the full ``rl.rollout.max_new_tokens`` (a rank without a
group left samples one again and discards it). Elsewhere a group stops once each of its rows has ended.

A completion is its tokens up to and including the first end of turn (``Prompts.stop_ids``), found by position;
one that has not ended after ``max_new_tokens`` is truncated there and trained as it stands.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist

from ..data.loader import hash_key
from .dpo import evaluation

# What a rank hands the others for each prompt it sampled: (completions' tokens, their rewards)
Sampled = Dict[int, Tuple[List[List[int]], List[float]]]


def gather_objects(value: Any) -> List[Any]:
    """Every rank's ``value`` (pickled, over the default group), in rank order; ``[value]`` in one process."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [value]
    out: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def cut(tokens: Sequence[int], stop_ids: Sequence[int]) -> Tuple[List[int], bool]:
    """A row's completion, by position: through its first end of turn; and whether it was truncated instead."""
    for i, token in enumerate(tokens):
        if token in stop_ids:
            return list(tokens[:i + 1]), False
    return list(tokens), True


class Sampler:
    """Samples groups with ``module`` (the strategy's: its forward gathers under fsdp), through the objective's
    decode seam (``HFModel.decode_step``)."""

    def __init__(self, module: torch.nn.Module, seed: int, group_size: int, max_new_tokens: int, temperature: float,
                 stop_ids: Sequence[int], lockstep: bool, autocast: Callable[[], Any]):
        self.module, self.seed, self.group_size = module, seed, group_size
        self.max_new_tokens, self.temperature = max_new_tokens, float(temperature)
        self.stop_ids, self.lockstep, self.autocast = tuple(stop_ids), lockstep, autocast

    @torch.no_grad()
    def group(self, prompt_ids: torch.Tensor, prompt: int, step: int) -> List[List[int]]:
        """The group's raw tokens ``[group_size][<= max_new_tokens]`` for ``prompt`` at optimizer step ``step``."""
        rows = self.group_size
        generators = [torch.Generator().manual_seed(hash_key(self.seed, step, prompt, sample, 7_919))
                      for sample in range(rows)]
        x = prompt_ids.unsqueeze(0).expand(rows, -1).contiguous()
        cache, tokens = None, []
        ended = torch.zeros(rows, dtype=torch.bool)
        stops = torch.tensor(self.stop_ids, dtype=torch.long)
        with evaluation(self.module), self.autocast():
            for _ in range(self.max_new_tokens):
                logits, cache = self.module({"decode": x, "cache": cache})
                noise = torch.stack([gumbel(g, logits.shape[-1]) for g in generators])
                chosen = (logits.double().cpu() / self.temperature + noise).argmax(dim=-1)
                tokens.append(chosen)
                ended |= torch.isin(chosen, stops)
                if bool(ended.all()) and not self.lockstep:
                    break
                x = chosen.unsqueeze(1).to(prompt_ids.device)
        return torch.stack(tokens, dim=1).tolist()


def gumbel(generator: torch.Generator, size: int) -> torch.Tensor:
    """Gumbel(0, 1) noise in float64, drawn from ``generator``: argmax(logits / T + noise) samples softmax(logits / T)."""
    u = torch.rand(size, generator=generator, dtype=torch.float64)
    return -torch.log(-torch.log(u))


def roll_out(sampler: Sampler, prompts: Any, step_prompts: List[int], step: int, rank: int, world: int,
             reward: Callable[[dict, str, bool], float], device: torch.device) -> Tuple[Sampled, float, float]:
    """Every prompt of the step sampled and rewarded, each group by one rank, given to every rank; with the seconds
    this rank spent sampling and rewarding."""
    owned = step_prompts[rank::world]
    rounds = -(-len(step_prompts) // world) if sampler.lockstep else len(owned)
    mine: Sampled = {}
    gen_s = score_s = 0.0
    for r in range(rounds):
        prompt = owned[r] if r < len(owned) else step_prompts[0]  # past this rank's own: only to keep lockstep
        began = time.perf_counter()
        raw = sampler.group(torch.as_tensor(prompts.ids[prompt], device=device), prompt, step)
        gen_s += time.perf_counter() - began
        if r >= len(owned):
            continue
        began = time.perf_counter()
        cuts = [cut(row, prompts.stop_ids) for row in raw]
        completions = [c for c, _ in cuts]
        rewards = [reward(prompts.records[prompt], prompts.completion_text(c), not truncated)
                   for c, truncated in cuts]
        score_s += time.perf_counter() - began
        mine[prompt] = (completions, rewards)
    sampled: Sampled = {}
    for part in gather_objects(mine):
        sampled.update(part)
    return sampled, gen_s, score_s
