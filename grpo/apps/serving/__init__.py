"""The parts of `grpo serve`: the batching engine, request parsing, the FastAPI app
(`grpo.apps.serving.app`, imported on use: fastapi and uvicorn are the `serve` extra)."""

from grpo.apps.serving.engine import Choice, Engine, Job, SamplingParams, Unavailable
from grpo.apps.serving.protocol import RequestError, parse_request
from grpo.apps.serving.service import Service

__all__ = [
    "Choice",
    "Engine",
    "Job",
    "RequestError",
    "SamplingParams",
    "Service",
    "Unavailable",
    "parse_request",
]
