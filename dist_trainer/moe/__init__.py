"""Mixture of experts: the layer (``layer``), its routing statistics and balancing terms (``routing``).

The model owns a ``Routing`` shared by its MoE layers; the trainer asks ``routing_of(model)`` for it (a
``NoRouting`` for a dense model) and calls it at the step's few points: before the window (the counts the
global balancing term needs), at the step's all-reduce (the counts, aux and z sums), after an applied update
(the aux-loss-free bias).
"""

from .layer import Experts, MoE, Router, SharedExperts, inactive_params
from .routing import BalanceConfig, NoRouting, Routing, routing_of

__all__ = ["BalanceConfig", "Experts", "MoE", "NoRouting", "Router", "Routing", "SharedExperts", "inactive_params",
           "routing_of"]
