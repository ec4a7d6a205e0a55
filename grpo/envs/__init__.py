"""Environments for multi-turn (agentic) rollouts: the protocol, a registry, and built-ins
(`single_turn`: today's one-turn behaviour; `calculator`: arithmetic tool calls; `python`: a
code interpreter for tool-integrated reasoning)."""

from grpo.envs.base import (
    Environment,
    SingleTurn,
    Step,
    available_envs,
    check_step,
    env_factory,
    env_metadata,
    register_env,
)
from grpo.envs.calculator import CalculatorEnv
from grpo.envs.python import PYTHON_TOOL, PythonEnv
from grpo.envs.sandbox import Isolation, PythonResult, isolation, run_python

register_env("calculator", CalculatorEnv)
register_env("python", PythonEnv)

__all__ = [
    "PYTHON_TOOL",
    "CalculatorEnv",
    "Environment",
    "PythonEnv",
    "PythonResult",
    "SingleTurn",
    "Step",
    "available_envs",
    "check_step",
    "env_factory",
    "env_metadata",
    "isolation",
    "Isolation",
    "register_env",
    "run_python",
]
