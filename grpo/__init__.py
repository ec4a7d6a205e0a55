"""grpo: group relative policy optimization for LLMs in pure PyTorch."""

__version__ = "0.1.0"
