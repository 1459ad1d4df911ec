"""spectie: why vLLM speculative decoding stops early on Qwen3.5, measured and reported.

The package holds the logic behind the book's chapters: run records, environments, chapters and
their staleness, and (in later chapters) prompts, engines, margins and sweeps.
"""

__version__ = "0.1.0"
