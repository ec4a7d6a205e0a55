"""Environments for multi-turn (agentic) rollouts: the protocol, a registry, and built-ins
(`single_turn`: today's one-turn behaviour; `calculator`: arithmetic tool calls)."""

from grpo.envs.base import (
    Environment,
    SingleTurn,
    Step,
    available_envs,
    check_step,
    env_factory,
    register_env,
)
from grpo.envs.calculator import CalculatorEnv

register_env("calculator", CalculatorEnv)

__all__ = [
    "CalculatorEnv",
    "Environment",
    "SingleTurn",
    "Step",
    "available_envs",
    "check_step",
    "env_factory",
    "register_env",
]
