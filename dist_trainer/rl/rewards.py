"""task=grpo's rewards: ``rl.reward``, a built-in by name or any callable ``(prompt, completion, **record) -> float``.

The reward is called on the rank that sampled the group, once per completion, with the record's prompt (as the
file holds it), the completion's text (its tokens before the end of turn, decoded) and the record's other fields as
keyword arguments; what it returns is kept as a float64 and given to every rank with the completions.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from hydra.utils import get_method

from ..config import ConfigError


def exact_answer(prompt: Any, completion: str, answer: Any = None, **record: Any) -> float:
    """1 where the completion, stripped of surrounding white space, is the record's ``answer`` (as text), else 0.
    A completion that did not end its turn within rl.rollout.max_new_tokens gets 0 (``build_reward``), as the
    held-out evaluation counts it: its answer was never finished."""
    if answer is None:
        raise ConfigError("rl.reward=exact_answer reads each record's 'answer' field, and a record has none: add it "
                          "to data.files, or name another reward in rl.reward._target_")
    return float(completion.strip() == str(answer).strip())


BUILT_IN = {"exact_answer": exact_answer}
NEEDS_END = {exact_answer}  # built-ins that give 0 to a completion cut at rl.rollout.max_new_tokens


def build_reward(spec: Any, prompt_key: str) -> Callable[[dict, str, bool], float]:
    """``rl.reward`` as ``(record, completion text, whether it ended its turn) -> float``; a callable of the
    user's is given the text as it stands, ended or not."""
    if isinstance(spec, str):
        fn = BUILT_IN[spec]
    else:
        try:
            fn = get_method(spec["_target_"])
        except Exception as err:  # an import's own error, named with the key
            raise ConfigError(f"rl.reward._target_={spec['_target_']!r}: cannot be imported ({err})") from err

    def reward(record: dict, completion: str, ended: bool = True) -> float:
        if fn in NEEDS_END and not ended:
            return 0.0
        rest = {k: v for k, v in record.items() if k != prompt_key}
        value = float(fn(record.get(prompt_key), completion, **rest))
        if not math.isfinite(value):
            raise ValueError(f"rl.reward returned {value} for a completion of {record.get(prompt_key)!r}: a reward "
                             "must be a finite number")
        return value

    return reward
